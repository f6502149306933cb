"""A run's training processes by global rank, on this machine, for the tests and benchmarks that kill, stop or
throttle one: torchrun sets RANK in its workers' environment (their DataLoader workers inherit it); a warm worker (the
harness's standby, harness.node.standby) or a stand-in rank (forked by testbed/standin's torchrun) has it only in its
Python's os.environ and announces it in its agent's directory instead."""

from __future__ import annotations

from harness.node.proctable import environ, run_processes
from harness.node.ranks import announced


def rank_pids(run_id: str, rank: int, attempt: int | None = None) -> list[int]:
    """The live processes of run_id's global rank (of attempt, when given), the rank's own first; none where it is
    not running (or runs in a pid namespace of its own, whose numbers its announcement holds)."""
    pids = run_processes(run_id, attempt=None if attempt is None else str(attempt))
    found = [pid for pid in pids if environ(pid).get(b"RANK") == str(rank).encode()]
    directories = {environ(pid).get(b"HARNESS_AGENT_DIR") or b"" for pid in pids} - {b""}
    for directory in directories:
        if (pid := announced(pids, directory.decode()).get(rank)) is not None:
            found.insert(0, pid)
    return found
