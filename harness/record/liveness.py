"""Whether a run still runs: its record says running and its controller is alive (one on another machine, a
Slurm batch step's, is taken at its record's word). The one answer every verb uses: a run recorded as running
whose controller is gone is unwatched while its nodes' agents hold it for `harness attach` (supervision.grace),
lost after."""

from __future__ import annotations

import socket
import time

from harness.node.proctable import is_alive, run_processes
from harness.record.rundir import RunDir
from harness.record.schema import RunState, RunStatus


def elsewhere(state: RunState) -> bool:
    """Whether the run's controller runs on another machine (a Slurm batch step's)."""
    return state.controller.host not in (None, socket.gethostname())


def controller_alive(state: RunState) -> bool:
    """Whether the controller still runs; one on another machine is taken at its record's word."""
    return elsewhere(state) or is_alive(state.controller.pid, state.controller.start_ticks)


def live_status(state: RunState, run: RunDir | None = None) -> RunStatus:
    """What the record says, except that a running run whose controller is gone is unwatched while its agents
    may hold it (run: its directory, whose last write is when the controller was last seen), lost after."""
    if state.status is RunStatus.RUNNING and not controller_alive(state):
        return RunStatus.UNWATCHED if unwatched_for(state, run) is not None else RunStatus.LOST
    return state.status


def unwatched_for(state: RunState, run: RunDir | None) -> float | None:
    """Seconds since the run's lost controller was last seen, while its nodes' agents may still hold them: a local
    run's while a process of it runs, another's within supervision.grace (None: they hold nothing now)."""
    if state.grace <= 0 or state.mode not in ("local", "ssh") or run is None:
        return None
    seen = run.last_written() or state.started_at
    since = max(0.0, time.time() - seen)
    if state.mode == "local":
        return since if run_processes(state.run_id) else None
    return since if since < state.grace else None


def has_ended(run: RunDir) -> bool:
    """Whether the run has ended, by its record or by its controller's end (not while its agents hold it)."""
    return live_status(run.read_state(), run) not in (RunStatus.RUNNING, RunStatus.UNWATCHED)
