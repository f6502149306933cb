"""Own the processes of one run: find and end them by the HARNESS_RUN_ID in their environment.

torchrun starts its workers in sessions of their own, so signalling the agent's process group does
not reach a worker whose agent was SIGKILLed. The run id every node carries is exact (never a name
pattern), so sweeping by it ends precisely that run's processes and nothing else.

This file imports nothing from the package: the SSH backend sends its source to each host and runs
it there with the host's own Python as the node's agent (see `supervise_node`), so remote hosts need
no harness install.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

EXIT_MARKER = "\x1eharness-node-exit"


def run_processes(run_id: str, node_rank: str | None = None) -> list[int]:
    """PIDs whose environment says they belong to run_id (and node_rank, when given)."""
    wanted = {f"HARNESS_RUN_ID={run_id}".encode()}
    if node_rank is not None:
        wanted.add(f"NODE_RANK={node_rank}".encode())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = set(handle.read().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            found.append(int(entry))
    return found


def kill_run_processes(run_id: str, node_rank: str | None = None, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process of the run; returns the PIDs signalled."""
    signalled = []
    for pid in run_processes(run_id, node_rank):
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except (ProcessLookupError, PermissionError):  # gone, or another uid's (e.g. in a container)
            continue
    return signalled


def _stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], start time is [19])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of pid: with the pid it identifies a process even after pid reuse."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def is_alive(pid: int, ticks: int | None) -> bool:
    """The same process (not a reused pid) and still running (an exited, unreaped zombie is not)."""
    fields = _stat(pid)
    return fields is not None and ticks is not None and int(fields[19]) == ticks and fields[0] != b"Z"


def supervise_node(run_id: str, node_rank: str, grace: float, command: str, cleanup: str = "") -> int:
    """Run one node's shell command in a session of its own, stopped by the controller's word.

    Reads the controller's commands on stdin: TERM (SIGTERM to the node's process group) and KILL
    (SIGKILL, then a sweep by run id, then the cleanup command, e.g. removing the node's container,
    which a SIGKILLed `docker run` leaves behind). End of stdin means the controller or its
    connection died: the node is stopped the same way, so a lost controller never leaves a job running.
    """
    child = subprocess.Popen(["/bin/sh", "-c", command], start_new_session=True, stdin=subprocess.DEVNULL)

    def signal_group(sig: int) -> None:
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass

    def kill() -> None:
        signal_group(signal.SIGKILL)
        kill_run_processes(run_id, node_rank)
        if cleanup:
            subprocess.run(["/bin/sh", "-c", cleanup], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60, check=False)

    def obey_controller() -> None:
        for line in sys.stdin:
            word = line.strip()
            if word == "TERM":
                signal_group(signal.SIGTERM)
            elif word == "KILL":
                kill()
        signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        kill()

    threading.Thread(target=obey_controller, daemon=True).start()
    code = child.wait()
    kill_run_processes(run_id, node_rank)
    sys.stdout.flush()
    print(f"{EXIT_MARKER} {code}", flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    # On a host: python -c "$(cat procs.py)" RUN_ID NODE_RANK GRACE_SECONDS SHELL_COMMAND [CLEANUP_COMMAND]
    sys.exit(supervise_node(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], *sys.argv[5:6]))
