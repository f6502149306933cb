"""Find and end the processes of one run by the HARNESS_RUN_ID in their environment.

torchrun starts its workers in sessions of their own, so signalling the agent's process group does
not reach a worker whose agent was SIGKILLed. The run id every node carries is exact (never a name
pattern), so sweeping by it ends precisely that run's processes and nothing else. This file has no
imports from the package so that its source can also run on a remote host with a bare Python.
"""

from __future__ import annotations

import os
import signal
import sys


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
        except ProcessLookupError:
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


if __name__ == "__main__":
    # Remote form: python - RUN_ID [NODE_RANK] < procs.py  -> kills and prints the PIDs.
    killed = kill_run_processes(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    print(" ".join(map(str, killed)))
