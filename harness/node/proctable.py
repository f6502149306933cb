"""The process table, read from /proc: a run's processes by their environment, a process's
descendants, a pid's identity across reuse, and the end of a whole tree. Standard library only (it is
shipped to nodes).

A run's processes are found by the HARNESS_RUN_ID (and NODE_RANK, HARNESS_ATTEMPT) in their
environment, never by a name pattern: the node agent sweeps its node this way, `harness stop`
a run whose controller is gone, and the tests what a run left behind.

Shipped as a program, it ends a process and everything below it on its own machine (kill_tree):

    python -c BOOT harness-kill-tree PID      (stdin: shipped("proctable", [PID, GRACE]))

A remote command that overruns its deadline is ended this way: closing its SSH channel alone would
leave it running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time


def environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment as it started ({} when gone or another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return dict(item.partition(b"=")[::2] for item in handle.read().split(b"\0") if item)
    except OSError:
        return {}


def run_processes(run_id: str, node_rank: str | None = None, attempt: str | None = None) -> list[int]:
    """PIDs whose environment says they belong to run_id (and node_rank and attempt, when given)."""
    wanted = {b"HARNESS_RUN_ID": run_id.encode()}
    if node_rank is not None:
        wanted[b"NODE_RANK"] = node_rank.encode()
    if attempt is not None:
        wanted[b"HARNESS_ATTEMPT"] = attempt.encode()
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()
            and wanted.items() <= environ(int(entry)).items()]


def kill_run_processes(run_id: str, node_rank: str | None = None, attempt: str | None = None,
                       sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process of the run (of one node of one attempt, when given); returns the PIDs signalled."""
    return signal_all(run_processes(run_id, node_rank, attempt), sig)


def process_tree(pid: int) -> tuple[list[int], list[int]]:
    """(every living process below pid, pid's dead children). Walked down from pid through the kernel's lists of
    each thread's children, so that it costs what the tree holds, not what the machine runs (a node agent samples
    every second, and simulated nodes share one machine); from the whole process table where the kernel keeps no
    such list (CONFIG_PROC_CHILDREN)."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return _process_tree_by_table(pid)
    found, zombies, stack = [], [], [pid]
    while stack:
        parent = stack.pop()
        for child in children(parent):
            fields = stat_fields(child)
            if fields is None:
                continue
            if fields[0] == b"Z":
                if parent == pid:
                    zombies.append(child)
                continue
            found.append(child)
            stack.append(child)
    return found, zombies


def children(pid: int) -> list[int]:
    """pid's children: those of each of its threads."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                found += [int(child) for child in handle.read().split()]
    return found


def _process_tree_by_table(pid: int) -> tuple[list[int], list[int]]:
    """process_tree from one reading of the whole process table."""
    children: dict[int, list[int]] = {}
    zombies = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))):
            if fields[0] != b"Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
            elif int(fields[1]) == pid:
                zombies.append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found, zombies


def signal_all(pids: list[int], sig: int) -> list[int]:
    """Send sig to each pid that still exists and is ours to signal; returns those signalled."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except (ProcessLookupError, PermissionError):  # gone, or another uid's (e.g. in a container)
            continue
    return signalled


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name (state [0], ppid [1], utime [11], stime [12],
    start time [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of pid: with the pid it identifies a process even after pid reuse."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None


def is_alive(pid: int, ticks: int | None) -> bool:
    """The same process (not a reused pid) and still running (an exited, unreaped zombie is not)."""
    fields = stat_fields(pid)
    return fields is not None and ticks is not None and int(fields[19]) == ticks and fields[0] != b"Z"


def kill_tree(root: int, grace: float) -> None:
    """SIGTERM root, `grace` seconds, then SIGKILL to the whole tree as it was before the TERM (children of a
    dead parent are re-parented and lost) and as it is now."""
    doomed = set(process_tree(root)[0]) | {root}
    if _exists(root):
        os.kill(root, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _exists(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_all(sorted(doomed | set(process_tree(root)[0])), signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    kill_tree(int(sys.argv[1]), float(sys.argv[2]))
