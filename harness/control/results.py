"""A finished attempt's nodes and failures as run-record entries (harness.record.schema), whichever
target ran them: each LiveNode (control/live.py) becomes a RecordedNode, each node failure a Failure."""

from __future__ import annotations

import signal
import time

from harness.control import worker_output
from harness.control.live import LiveNode
from harness.control.recovery import NodeFailure
from harness.health.rendezvous import RendezvousVerdict
from harness.health.verdict import Verdict
from harness.record.rundir import RunDir
from harness.record.schema import Failure, FailureKind, HealthEvent, RecordedNode, RunStatus
from harness.targets.base import Outcome


def recorded_node(live: LiveNode, run: RunDir, attempt: int) -> RecordedNode:
    outcome = live.outcome
    return RecordedNode(
        node_rank=live.node.node_rank, host=live.node.host, ranks=list(live.node.ranks),
        exit_code=outcome.exit_code if outcome else None,
        signal=signal.Signals(outcome.signal).name if outcome and outcome.signal else None,
        error=outcome.error if outcome else None,
        duration_s=round((live.ended or time.time()) - live.started, 3),
        log=str(run.log_file(live.node.node_rank, attempt)),
    )


def failure_of(found: NodeFailure, started_at: float, now: float) -> Failure:
    record = found.live
    assert record.outcome is not None
    # The failing rank's own exit code says more than torchrun's (always 1 when a worker failed).
    description = Outcome.from_returncode(found.rank_exit_code).describe() if found.rank_exit_code is not None \
        else record.outcome.describe()
    own = worker_output.rank_lines(record.tail, found.rank) if found.rank is not None else []
    error = worker_output.user_error(own)
    exception = error.exception if error else worker_output.cpp_exception(own)
    return Failure(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks),
        rank=found.rank, rank_exit_code=found.rank_exit_code, exit_code=record.outcome.exit_code,
        description=description, after_s=round((record.ended or now) - started_at, 3),
        last_lines=record.last_lines(found.rank), kind=found.kind, evidence=found.evidence, host_down=found.host_down,
        error=exception, error_at=error.where if error else None,
        error_source=error.source if error else None, hint=found.hint or worker_output.hint(own or record.tail),
    )


def slow_failure(weighed: HealthEvent, nodes: list[LiveNode], started_at: float) -> Failure:
    """A slowness the harness stopped the job for, as the attempt's first failure: on the slow rank's node, whose host
    is out of the next attempt (host_down) and remembered as slow."""
    record = next(r for r in nodes if weighed.rank in r.node.ranks)
    node = record.node
    pace = f"at {weighed.pace_now / weighed.pace_before:.2f}x its pace " if weighed.pace_before and \
        weighed.pace_now is not None else ""
    lasted = f"for {weighed.at - weighed.since:.0f} s" if weighed.since is not None else ""
    return Failure(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks), rank=weighed.rank,
        rank_exit_code=None, exit_code=None, description="slow", after_s=round(weighed.at - started_at, 3),
        last_lines=record.last_lines(weighed.rank), kind=FailureKind.SLOW, host_down=True,
        evidence=f"rank {weighed.rank} ({node.label} on {node.host}) held the job {pace}{lasted}, and a restart "
                 f"without {node.host} cost less",
    )


def summary_error(first_failure: Failure | None, reason: str | None) -> str | None:
    """What a failed run's summary says went wrong: the first failure's exception, else its evidence,
    else why no attempt could run (reason); None only when nothing failed."""
    if first_failure is not None:
        return first_failure.error or first_failure.evidence
    return reason


def stopped_status(run: RunDir) -> RunStatus:
    """A stop asked for by `harness stop` (its marker) or by Ctrl-C/SIGTERM."""
    return RunStatus.STOPPED if run.stop_marker.exists() else RunStatus.INTERRUPTED


def unjoined_failures(unjoined: RendezvousVerdict, nodes: list[LiveNode], started_at: float, at: float) -> \
        list[Failure]:
    """A rendezvous that did not complete in time, as the attempt's first failures: each node at fault (its host
    down: a spare takes its place), the verdict as evidence."""
    return [Failure(node_rank=live.node.node_rank, host=live.node.host, ranks=list(live.node.ranks), rank=None,
                    rank_exit_code=None, exit_code=None, description="did not join the rendezvous",
                    after_s=round(at - started_at, 3), last_lines=live.last_lines(None), kind=FailureKind.INFRA,
                    evidence=unjoined.text, host_down=True)
            for live in nodes if live.node.node_rank in unjoined.culprits]


def hang_failure(hang: Verdict, hang_at: float, nodes: list[LiveNode], started_at: float) -> Failure:
    """The hang as the attempt's first failure: on the first odd rank's node, its verdict as evidence."""
    odd = hang.odd[0] if len(hang.odd) == 1 else None  # a mismatch has two sides and no culprit
    record = next((r for r in nodes if odd in r.node.ranks), nodes[0])
    return Failure(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks), rank=odd,
        rank_exit_code=None, exit_code=None, description="hung", after_s=round(hang_at - started_at, 3),
        last_lines=record.last_lines(odd if odd is not None else record.node.ranks[0]), kind=FailureKind.HANG,
        evidence=hang.text,
    )
