"""A run that a controller in a Slurm batch job continues (`harness batch-step`): the user's `harness
launch` made its directory and state; the attempts of the job's earlier runs (before a requeue) count,
and one that the end of an allocation cut short (its plan is there, its record is not) is recorded as
such."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from harness.record.rundir import RunDir
from harness.record.schema import Attempt, FailureKind, RunStatus


@dataclass(frozen=True)
class Continued:
    """time_up: why the allocation ends now (Slurm's time-limit warning), or None; requeue: have Slurm
    run the job again, on a new allocation."""

    run: RunDir
    before: list[Attempt]
    time_up: Callable[[], str | None]
    requeue: Callable[[], None]


def earlier_attempts(run: RunDir, requeued: int) -> list[Attempt]:
    """The attempts of the job's earlier runs: as recorded after each, then those cut short, failed and
    ended by the requeue (requeued: Slurm's count of them). A run whose controller ended it (its state no
    longer running) and that runs again was requeued by Slurm (preempted, `scontrol requeue`): its last
    attempt was ended by that."""
    ended_by = f"the allocation ended while it ran (Slurm requeued the job: restart {requeued})"
    attempts = run.read_attempts()
    if attempts and attempts[-1].ended_by is None and run.read_state().status is not RunStatus.RUNNING:
        attempts[-1] = replace(attempts[-1], status=RunStatus.FAILED, kind=attempts[-1].kind or FailureKind.INFRA,
                               ended_by=ended_by)
    while run.plan_json(len(attempts)).exists():
        plan = json.loads(run.plan_json(len(attempts)).read_text())
        started = run.plan_json(len(attempts)).stat().st_mtime
        attempts.append(Attempt(
            attempt=len(attempts), hosts=[node["host"] for node in plan["nodes"]], status=RunStatus.FAILED,
            started_at=started, ended_at=started, nodes=[], failures=[], kind=FailureKind.INFRA, down=[],
            preflight_s=0.0, nnodes=plan["nnodes"], world_size=plan["world_size"],
            ended_by=ended_by))
    return attempts
