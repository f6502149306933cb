"""Whether a run still runs: its record says running and its controller is alive (one on another machine, a
Slurm batch step's, is taken at its record's word). The one answer every verb uses: a run recorded as running
whose controller is gone is lost."""

from __future__ import annotations

import socket

from harness.node.proctable import is_alive
from harness.record.rundir import RunDir
from harness.record.schema import RunState, RunStatus


def elsewhere(state: RunState) -> bool:
    """Whether the run's controller runs on another machine (a Slurm batch step's)."""
    return state.controller.host not in (None, socket.gethostname())


def controller_alive(state: RunState) -> bool:
    """Whether the controller still runs; one on another machine is taken at its record's word."""
    return elsewhere(state) or is_alive(state.controller.pid, state.controller.start_ticks)


def live_status(state: RunState) -> RunStatus:
    """What the record says, except that a running run whose controller is gone is lost."""
    if state.status is RunStatus.RUNNING and not controller_alive(state):
        return RunStatus.LOST
    return state.status


def has_ended(run: RunDir) -> bool:
    """Whether the run has ended, by its record or by its controller's end."""
    return live_status(run.read_state()) is not RunStatus.RUNNING
