"""A finished attempt's nodes and failures as run-record entries (harness.run.records), whichever
target ran them: the supervisor's NodeRecords become NodeResults and Failures."""

from __future__ import annotations

import signal
import time

from harness.run import worker_output
from harness.run.records import Failure, NodeResult, RunDir, RunStatus
from harness.run.recovery import NodeFailure
from harness.run.supervisor import NodeRecord
from harness.targets.base import Outcome


def node_result(record: NodeRecord, run: RunDir, attempt: int) -> NodeResult:
    outcome = record.outcome
    return NodeResult(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks),
        exit_code=outcome.exit_code if outcome else None,
        signal=signal.Signals(outcome.signal).name if outcome and outcome.signal else None,
        error=outcome.error if outcome else None,
        duration_s=round((record.ended or time.time()) - record.started, 3),
        log=str(run.log_file(record.node.node_rank, attempt)),
    )


def failure_of(found: NodeFailure, started_at: float, now: float) -> Failure:
    record = found.record
    assert record.outcome is not None
    # The failing rank's own exit code says more than torchrun's (always 1 when a worker failed).
    description = Outcome.from_returncode(found.rank_exit_code).describe() if found.rank_exit_code is not None \
        else record.outcome.describe()
    own = worker_output.rank_lines(record.tail, found.rank) if found.rank is not None else []
    error = worker_output.user_error(own)
    return Failure(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks),
        rank=found.rank, rank_exit_code=found.rank_exit_code, exit_code=record.outcome.exit_code,
        description=description, after_s=round((record.ended or now) - started_at, 3),
        last_lines=record.last_lines(found.rank), kind=found.kind, evidence=found.evidence, host_down=found.host_down,
        error=error.exception if error else None, error_at=error.where if error else None,
        error_source=error.source if error else None, hint=worker_output.hint(own or record.tail),
    )


def stopped_status(run: RunDir) -> RunStatus:
    """A stop asked for by `harness stop` (its marker) or by Ctrl-C/SIGTERM."""
    return RunStatus.STOPPED if run.stop_marker.exists() else RunStatus.INTERRUPTED


