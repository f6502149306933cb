"""`harness stop`: ask a run's controller to stop its nodes, from any terminal (one in a Slurm batch step
through Slurm: SIGTERM to the batch step); when the controller is gone, end what it left directly (the
run's processes on this machine, or its scheduler's job)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace

from harness.node.proctable import kill_run_processes
from harness.record.atomic import file_mode
from harness.record.liveness import controller_alive, elsewhere
from harness.record.rundir import RunDir
from harness.record.schema import RunStatus
from harness.targets.base import Scheduler


def stop_run(run: RunDir, timeout: float, scheduler_for: Callable[[str], Scheduler]) -> int:
    """0 once the run has ended, 1 when its controller did not stop in time. scheduler_for: the run's
    scheduler by its mode, for a run whose job a scheduler owns."""
    state = run.read_state()
    if state.status is not RunStatus.RUNNING:
        print(f"run {run.run_id} already ended: {state.status.value}")
        return 0
    if elsewhere(state) and state.scheduler_job is not None:
        scheduler = scheduler_for(state.mode)
        if scheduler.describe(state.scheduler_job).state == "RUNNING":
            run.stop_marker.touch(mode=file_mode(run.path))
            scheduler.stop(state.scheduler_job)  # SIGTERM to the controller in the job's batch step
            return _ended(run, timeout, lambda: run.read_state().status is RunStatus.RUNNING,
                          f"the controller in {state.mode.capitalize()} job {state.scheduler_job}")
    elif controller_alive(state):
        run.stop_marker.touch(mode=file_mode(run.path))
        os.kill(state.controller.pid, signal.SIGTERM)
        return _ended(run, timeout, lambda: controller_alive(state), f"controller {state.controller.pid}")
    ended_at = run.last_written() or time.time()  # a lost run ended when it last wrote, unless something ran on
    if state.scheduler_job is not None:  # the batch system owns the processes: it ends them
        scheduler_for(state.mode).cancel(state.scheduler_job)
        done = f"cancelled {state.mode.capitalize()} job {state.scheduler_job}"
        ended_at = time.time()
    else:
        left = kill_run_processes(run.run_id)
        done = f"ended {len(left)} leftover process(es)"
        ended_at = time.time() if left else ended_at
    run.write_state(replace(state, status=RunStatus.STOPPED, ended_at=ended_at))
    print(f"run {run.run_id}: controller was gone; {done}")
    return 0


def _ended(run: RunDir, timeout: float, running: Callable[[], bool], who: str) -> int:
    deadline = time.monotonic() + timeout
    while running():
        if time.monotonic() > deadline:
            print(f"harness: run {run.run_id}: {who} did not stop within {timeout} s")
            return 1
        time.sleep(0.1)
    print(f"run {run.run_id} stopped")
    return 0
