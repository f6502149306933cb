"""Whether a run still runs: its record says running and its controller is alive (one on another machine, a
Slurm batch step's, is taken at its record's word). The one answer every verb uses: a run recorded as running
whose controller is gone is unwatched while its nodes' agents hold it for `harness attach` (supervision.grace),
lost after."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from harness.errors import UsageError
from harness.node.proctable import is_alive, run_processes
from harness.record.index import list_runs
from harness.record.rundir import RunDir
from harness.record.schema import RunState, RunStatus
from harness.record.trust import check_run_folder

# How far ahead of this machine's clock another machine's may be: a controller's last sign of life later than that
# was written by no controller (a record planted with a time to come would be held for good).
CLOCK_SKEW = 30.0


def elsewhere(state: RunState) -> bool:
    """Whether the run's controller runs on another machine (a Slurm batch step's)."""
    return state.controller.host not in (None, socket.gethostname())


def controller_alive(state: RunState) -> bool:
    """Whether the controller still runs; one on another machine is taken at its record's word."""
    return elsewhere(state) or is_alive(state.controller.pid, state.controller.start_ticks)


def live_status(state: RunState, run: RunDir | None = None) -> RunStatus:
    """What the record says, except that a running run whose controller is gone is unwatched while its agents
    may hold it (run: its directory, where the controller was last seen: last_seen), lost after."""
    if state.status is RunStatus.RUNNING and not controller_alive(state):
        return RunStatus.UNWATCHED if unwatched_for(state, run) is not None else RunStatus.LOST
    return state.status


def last_seen(state: RunState, run: RunDir) -> float:
    """When the run's controller was last seen alive: its health watch's last tick (health.json's time, written twice
    a second while it watches an attempt), else the last write of its record. Not the folder's newest file: nothing
    but the controller writes there, but a `harness stacks` or `stop` asks there too."""
    health = run.read_health(state.attempt)
    return health.t if health is not None and health.t is not None else run.last_written() or state.started_at


def unwatched_for(state: RunState, run: RunDir | None) -> float | None:
    """Seconds since the run's lost controller was last seen, while its nodes' agents may still hold them: a local
    run's while a process of it runs, another's within supervision.grace (None: they hold nothing now)."""
    if state.grace <= 0 or state.mode not in ("local", "ssh", "k8s") or run is None:
        return None
    since = time.time() - last_seen(state, run)
    if since < -CLOCK_SKEW:
        return None
    since = max(0.0, since)
    if state.mode == "local":
        return since if run_processes(state.run_id) else None
    return since if since < state.grace else None


def has_ended(run: RunDir) -> bool:
    """Whether the run has ended, by its record or by its controller's end (not while its agents hold it)."""
    return live_status(run.read_state(), run) not in (RunStatus.RUNNING, RunStatus.UNWATCHED)


def left_by_a_lost_controller(root: Path, name: str, mode: str, grace: float,
                              say: Callable[[str], None] = lambda line: None) -> RunDir | None:
    """The newest run of job `name` on target `mode` under root that its record says runs, whose nodes its agents
    may still hold: where a target runs one controller at a time (a Kubernetes Job's controller pod), a new one finds
    there the run its lost predecessor left, to take back. Only a record the caller may believe (trust.py: its own,
    in a runs directory no one else may write), its controller last seen within grace (the caller's own
    supervision.grace, not the record's) and not later than now (CLOCK_SKEW); say: why a running record of the job is
    not taken back."""
    for entry in reversed(list_runs(root)):
        state = entry.state
        if state is None or (state.name, state.mode, state.status) != (name, mode, RunStatus.RUNNING):
            continue
        seen = last_seen(state, entry.run)
        if seen > time.time() + CLOCK_SKEW:
            say(f"run {state.run_id} is not taken back: its record says its controller was last seen "
                f"{seen - time.time():.0f} s from now, a time no controller wrote")
            continue
        since = unwatched_for(state, entry.run)
        if since is None or since >= grace:
            continue
        try:
            check_run_folder(entry.run.path, state.run_id)
        except UsageError as refused:
            say(f"run {state.run_id} is not taken back: {refused}")
            continue
        return entry.run
    return None
