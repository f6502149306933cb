"""`harness stacks RUN_ID`: every rank's Python stack of a running job, from every node, ranks with the
same stack shown once. The run's controller holds the link to every node agent, so this leaves a
request in the run's stacks directory (one on a Slurm batch job's first node reads it through the file
system the nodes share); the controller's supervisor asks every agent, which reads its
ranks with py-spy (a pause of milliseconds per rank: the job goes on), and writes the answer beside it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from harness.errors import UsageError
from harness.health.rank_stack import RankStack, grouped
from harness.plan.planner import Node
from harness.record.atomic import file_mode, folder_mode, make_folders
from harness.record.liveness import controller_alive, live_status
from harness.record.rundir import RunDir, new_stacks_tag
from harness.record.schema import RunStatus

ANSWER_SECONDS = 30.0  # the supervisor looks every half second; the nodes answer within STACKS_SECONDS


def run_stacks(run: RunDir, timeout: float = ANSWER_SECONDS) -> str:
    """The grouped stacks of run's ranks now; UsageError when the run is not running under a controller."""
    state = run.read_state()
    if live_status(state) is not RunStatus.RUNNING:
        raise UsageError(f"run {run.run_id} is not running ({state.status.value}); the stacks of a hang are kept "
                         f"in {run.stacks}/attempt-N/")
    if state.scheduler_job is not None and state.hosts == []:
        raise UsageError(f"run {run.run_id}: {state.mode.capitalize()} job {state.scheduler_job} has not started its "
                         f"nodes yet (`harness status {run.run_id}`)")
    tag = new_stacks_tag()
    make_folders(run.stacks, folder_mode(run.path))
    request = run.stacks / f"request-{tag}"
    request.touch(mode=file_mode(run.path))
    deadline = time.monotonic() + timeout
    while request.exists():
        if time.monotonic() > deadline or not controller_alive(state):
            request.unlink(missing_ok=True)
            raise UsageError(f"run {run.run_id}: its controller did not answer within {timeout:g} s")
        time.sleep(0.1)
    stacks = kept_stacks(run.stacks / tag)
    if not stacks:
        return f"run {run.run_id}: no rank is running yet\n"
    return grouped(stacks) + f"\n(kept in {run.stacks / tag}/)\n"


def kept_stacks(where: Path) -> list[RankStack]:
    """The stacks kept in where/stacks.json (a hang's, or what `harness stacks` asked for); OSError, ValueError,
    KeyError or TypeError where it cannot be read."""
    answer = json.loads((where / "stacks.json").read_text(encoding="utf-8"))
    return [RankStack.from_answer(int(rank), Node(host=a["host"], address=a["host"], node_rank=a["node"], nproc=0),
                                  a) for rank, a in answer.items()]
