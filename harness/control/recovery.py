"""Why an attempt failed, and whether the run goes on with another one. Pure: the attempt's nodes in, verdicts out.

A failure on one node shows up on its peers too (gloo's "Connection closed by peer", NCCL's remote
errors), often first. So every node that failed on its own is classified, the peers' errors are
recognised as consequences, and the attempt is infra if any node failed at the infra level.
Nodes that ended because the supervisor stopped them are not failures.

A rank the kernel's OOM killer ended is infra: the machine ran out of memory, and the next attempt may
not (a spare host, a host no longer shared with another job, a container given more); a program that
needs more than any host has fails on every attempt and uses up restarts.max, with the hint to lower
its demand. What the program does wrong whatever machine runs it is program: its own exception (even
when the process then ends by a signal), a collective mismatch, the same failure at the same place
on two attempts in a row.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from harness.control import worker_output
from harness.control.live import LiveNode
from harness.plan.setup_script import FAILED as SETUP_FAILED
from harness.record.schema import Attempt, Failure, FailureKind
from harness.spec.job import MAX_BACKOFF, Restarts

# A worker's error when a peer (process, host or link) went away: a consequence, not a cause.
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"ncclRemoteError|NCCL communicator was aborted|DistNetworkError",
    re.IGNORECASE,
)
# The rendezvous did not complete: a node never came, or the store stopped answering.
RDZV_TIMEOUT = re.compile(r"RendezvousTimeoutError|DistStoreError|Socket Timeout|timed out after \d+")
# The ranks called different collectives, or the same one with different sizes: a bug in the program
# (gloo aborts the rank: SIGABRT), however it ends.
COLLECTIVE_MISMATCH = re.compile(
    r"collective mismatch|mismatch between collectives|Detected mismatch|Mismatched collective|"
    r"Received data size doesn't match expected size",
    re.IGNORECASE,
)
# A disk the rank writes to is full or read-only, in the words of the OS, of torch's stream writer (a short write:
# `unexpected pos 1664 vs 1568`) or of the payload's checkpoints (`its file system is full`).
DISK_TROUBLE = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|unexpected pos \d+ vs "
                          r"\d+|file system is (?:full|read-only)")
DISK_HINT = ("free space on that disk (or point the job's checkpoints and output at one with room); a restart resumes "
             "from the newest checkpoint written whole")
# A place in source code: `train.py:42`, `pair.cc:464`.
SOURCE_PLACE = re.compile(r"\w\.(py|c|cc|cpp|cu|h|hpp):\d+")
OOM_HINT = ("the kernel ran out of memory for this rank: lower the batch size (or the data loader's workers and "
            "prefetching), run fewer processes per node, or use hosts (or a container limit) with more memory")


@dataclass(frozen=True)
class NodeFailure:
    """One node that failed on its own. consequence: its error says a peer went away, so the cause is
    elsewhere (it counts as infra only when no node shows a cause)."""

    live: LiveNode
    rank: int | None
    rank_exit_code: int | None
    kind: FailureKind
    evidence: str
    host_down: bool = False
    consequence: bool = False
    hint: str | None = None  # advice the evidence alone gives (the OOM killer's record)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def node_failure(live: LiveNode, stopping_since: float | None, verdict: bool = False) -> NodeFailure | None:
    """How live's node failed, or None when it succeeded or ended because the supervisor stopped it. verdict: the
    supervisor stopped the attempt on a verdict of its own (a hang, a slow host, a rendezvous not done in time), not
    on a node's failure: a rank that lost a peer after the stop began lost it to the stop."""
    outcome = live.outcome
    if outcome is None or outcome.ok:
        return None
    rank, code = live.root_cause()
    if outcome.error is not None:
        return NodeFailure(live, rank, code, FailureKind.INFRA, outcome.error, host_down=True)
    stopped = stopping_since is not None and (live.ended or stopping_since) >= stopping_since
    if stopped and (rank is None or code == -signal.SIGTERM):
        # torchrun reports a root cause only for a worker that failed by itself; on the supervisor's
        # TERM it ends with a SignalException instead, and on KILL with nothing at all. The TERM reaches
        # the node's whole process group: a torchrun that sees its worker end by it first names that
        # worker, whose end was still the stop's.
        return None
    if rank is None and any(line.startswith(SETUP_FAILED) for line in live.last_lines(None)[-2:]):
        return NodeFailure(live, None, None, FailureKind.PROGRAM, f"the job's setup failed, {outcome.describe()}; "
                                                                    f"torchrun was not started")
    # torchrun killed by a signal is infra, unless the signal is the supervisor's own stop reaching a node
    # whose worker had already failed: then that worker's end says what happened.
    if outcome.signal is not None and not (stopped and outcome.signal in (signal.SIGTERM, signal.SIGKILL)):
        return NodeFailure(live, rank, code, FailureKind.INFRA, f"torchrun killed by {_signal_name(outcome.signal)}")
    who = f"rank {rank}" if rank is not None else "a worker"
    own = live.last_lines(rank)
    lost = next((line for line in reversed(own) if PEER_LOST.search(line)), None)
    if stopped and verdict and lost:
        return None
    exit_text = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else \
        f"exit code {code}" if code is not None else outcome.describe()
    if mismatch := next((line for line in reversed(own) if COLLECTIVE_MISMATCH.search(line)), None):
        return NodeFailure(live, rank, code, FailureKind.PROGRAM, f"{who} {exit_text}: a collective mismatch: "
                           f"{_message(mismatch)}")
    if disk := next((line for line in reversed(own) if DISK_TROUBLE.search(line)), None):
        return NodeFailure(live, rank, code, FailureKind.INFRA, f"{who} {exit_text}: a disk it writes to is full or "
                           f"read-only: {_message(disk)}", hint=DISK_HINT)
    if rank is not None and code in (-signal.SIGKILL, 128 + signal.SIGKILL) and (oom := live.oom.get(rank)):
        return NodeFailure(live, rank, code, FailureKind.INFRA, f"{who} killed by the kernel's OOM killer: "
                           f"{oom.strip()[:300]}", hint=OOM_HINT)
    if code is not None and code < 0:
        if -code == signal.SIGABRT and lost:  # gloo aborts a rank whose peer went away: the cause is elsewhere
            return NodeFailure(live, rank, code, FailureKind.PROGRAM, f"{who} killed by SIGABRT after losing a "
                               f"peer: {lost.strip()[:200]}", consequence=True)
        error = worker_output.user_error(worker_output.rank_lines(live.tail, rank)) if rank is not None \
            else None
        # Only another process or the kernel sends SIGKILL; any other end after the user's own exception
        # (gloo's threads abort an interpreter that is going down) follows from that exception.
        if error is not None and -code != signal.SIGKILL and not PEER_LOST.search(error.exception):
            where = f" at {error.where}" if error.where else ""
            return NodeFailure(live, rank, code, FailureKind.PROGRAM, f"{who} raised {error.exception[:200]}"
                               f"{where}, then was {exit_text}")
        return NodeFailure(live, rank, code, FailureKind.INFRA, f"{who} {exit_text}")
    if timeout := next((line for line in reversed(own) if RDZV_TIMEOUT.search(line)), None):
        return NodeFailure(live, rank, code, FailureKind.INFRA, f"rendezvous timed out: {timeout.strip()[:200]}")
    if lost:
        return NodeFailure(live, rank, code, FailureKind.PROGRAM, f"{who} {exit_text} after losing a peer: "
                           f"{lost.strip()[:200]}", consequence=True)
    return NodeFailure(live, rank, code, FailureKind.PROGRAM, f"{who} {exit_text}")


def _message(line: str) -> str:
    """A rank's line without its prefix and C++'s `what():`, at most 300 characters."""
    text = worker_output.RANK_PREFIX.sub("", line).strip()
    return text.removeprefix("what():").strip()[:300]


def attempt_failures(nodes: list[LiveNode], stopping_since: float | None, verdict: bool = False) -> list[NodeFailure]:
    """Every node that failed on its own: causes first, then consequences, each in the order they ended (verdict:
    node_failure's)."""
    found = [f for live in nodes if (f := node_failure(live, stopping_since, verdict)) is not None]
    return sorted(found, key=lambda f: (f.consequence, f.live.ended or 0.0))


def attempt_kind(failures: list[NodeFailure]) -> FailureKind | None:
    """infra if any node failed at the infra level, or if every failure is a lost peer (the cause left no
    trace: a host whose traffic vanished); program otherwise."""
    if not failures:
        return None
    if any(f.kind is FailureKind.INFRA for f in failures) or all(f.consequence for f in failures):
        return FailureKind.INFRA
    return FailureKind.PROGRAM


HOST_PART = re.compile(r" \(node\d+ on [^()]*\)")  # a hang verdict's "(node1 on h2)"


def failure_place(failure: Failure) -> str | None:
    """Where a failure happened, when it says: a hang's verdict (where the ranks were), the exception's
    type at the innermost frame of the user's code, or evidence naming a place in source code (gloo's
    `pair.cc:464`). None for a failure that names no place (a killed rank, a lost host)."""
    if failure.kind is FailureKind.HANG:  # where the ranks were, not on which hosts (a spare may replace one)
        return HOST_PART.sub("", failure.evidence)
    if failure.error_at is not None:
        return f"{(failure.error or 'an exception').split(':')[0]} at {failure.error_at}"
    return failure.evidence if SOURCE_PLACE.search(failure.evidence) else None


def repeated_failure(attempts: list[Attempt]) -> str | None:
    """Where the last two attempts both failed first, when that is the same place: the same failure
    twice in a row is the program's, however it was classed, since a third attempt meets it again."""
    if len(attempts) < 2 or not attempts[-1].failures or not attempts[-2].failures:
        return None
    place = failure_place(attempts[-1].failures[0])
    return place if place is not None and place == failure_place(attempts[-2].failures[0]) else None


def no_restart_reason(restarts: Restarts, attempts: list[Attempt]) -> str | None:
    """Why the last failed attempt is the run's last, or None when the run goes on."""
    last = attempts[-1]
    done = len(attempts) - 1
    if restarts.max == 0:
        return "restarts are off (restarts.max: 0)"
    if FailureKind.PROGRAM not in restarts.on and (place := repeated_failure(attempts)):
        return f"the same failure at the same place twice: {place}"
    if last.kind is not None and last.kind not in restarts.on:
        what = {FailureKind.PROGRAM: "the program failed (not the infrastructure)", FailureKind.HANG: "the job hung",
                FailureKind.INFRA: "the infrastructure failed"}[last.kind]
        return (f"{what}, and restarts.on is {', '.join(restarts.on)}: a job spec with `restarts: {{on: any}}` "
                f"(`--save-job` writes one) retries every kind")
    if done >= restarts.max:
        return f"every restart is used up (restarts.max: {restarts.max})"
    return None


def backoff_seconds(restarts: Restarts, restarts_done: int) -> float:
    """backoff before the first restart, doubling for each one after it, at most MAX_BACKOFF."""
    return float(min(restarts.backoff * 2 ** restarts_done, MAX_BACKOFF))
