"""The run controller: one run through one target, from the first check to the summary and the exit
status, whichever kind of target it is (harness.targets.base):

- a Backend's nodes are started and supervised here, attempt after attempt: plan -> check (nothing
  exists yet when the first fails) -> start -> supervise -> classify -> restart on spares or stop;
- a Scheduler's job is prepared (checked with the scheduler), submitted and followed (follow.py);
  its requeues are its attempts.

Both share one life cycle, here only: the run directory and its state, the signal handlers that turn
Ctrl-C and `harness stop` into a stop, the error state when the controller itself fails, the summary
and the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO

from harness.control.continued import Continued
from harness.control.follow import Follower
from harness.control.recovery import attempt_failures, attempt_kind, backoff_seconds, no_restart_reason
from harness.control.results import (
    failure_of,
    hang_failure,
    recorded_node,
    slow_failure,
    stopped_status,
    summary_error,
    unjoined_failures,
)
from harness.control.stopper import stop_on_signals
from harness.control.summary_text import report
from harness.control.supervisor import Supervisor
from harness.control.terminal import Terminal
from harness.errors import HarnessError
from harness.health.judge import HealthJudge
from harness.health.slowdown import SlowPolicy
from harness.node.proctable import start_ticks
from harness.node.protocol import COLLAPSE_ABOVE
from harness.plan.planner import STORE_WATCH_ENV, NoSpareHosts, Plan, take_healthy
from harness.plan.render import render_json, render_text
from harness.record.disk import RESERVE_BYTES, RecordDisk, size_text, space_text
from harness.record.entrypoint import write_entrypoint_record
from harness.record.goodput import restart_of, run_goodput
from harness.record.hosts_out import RunsHosts, hosts_file
from harness.record.index import create_run_dir
from harness.record.rundir import RunDir, run_dir
from harness.record.schema import (
    Attempt,
    ControllerId,
    FailureKind,
    Origin,
    RecordError,
    RunState,
    RunStatus,
    RunSummary,
    Unwatched,
)
from harness.record.stream import FOLLOWER_FILE, HARNESS_FILE, StreamRecord
from harness.spec.job import JobSpec
from harness.spec.secrets import masked_spec_text
from harness.targets.base import Announcing, Backend, CheckFailed, NodeProcess, Scheduler

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
HOSTS_NAMED = 16  # hosts a run's first line names; beyond, the first few and the last (status lists them all)
STANDBY_AFTER = 10.0  # seconds into an attempt whose ranks were not seen joining, when its standbys start anyway
REPLAY_WAIT = 60.0  # seconds an attach waits for every agent's replay of what it kept, before it records the attach


def launch(target: Backend | Scheduler, spec: JobSpec, spec_text: str, source: str, runs_root: Path, run_id: str,
           out: IO[str] = sys.stdout, detach: bool = False, collapse: bool = True, metrics: str | None = None,
           origin: Origin | None = None, taken_back_by: str | None = None) -> int:
    """Run the job on target to its end (restarting it as spec.restarts allows); the harness's exit
    status. Nothing exists yet when the first check fails. A backend is closed at the end. spec_text:
    the spec as its file holds it (kept as the run's spec.yaml); source: that file, or the command that
    made the spec. detach: a scheduler's job is submitted, not followed. collapse: identical lines of
    many ranks are shown as one on the terminal (control/terminal.py; False: --no-collapse). metrics: where the run's
    metrics are served (view/metrics.py; None: nowhere), said first and kept in its state. origin: where it was
    launched from, for `harness attach`. taken_back_by: who takes the nodes back should this controller be lost (words;
    None: `harness attach` where origin is given, else no one: the nodes stop with it)."""
    terminal = Terminal(out)
    target_run: _TargetRun = _SchedulerRun(target, spec, terminal, detach) if isinstance(target, Scheduler) else \
        _BackendRun(target, spec, terminal)
    target_run.collapse = collapse
    with _closing(target_run, terminal):
        began = time.time()
        target_run.prepare(source, runs_root, run_id)
        run = _new_record(runs_root, run_id, terminal, target_run.record_file, spec, spec_text, target.name)
        if isinstance(target, Announcing):
            target.announce_to(terminal.say)
        taker = taken_back_by or (f"`harness attach {run_id}`" if origin is not None else None)
        target_run.state = RunState(run_id=run_id, name=spec.name, mode=target.name, status=RunStatus.RUNNING,
                                started_at=began, nnodes=target_run.nnodes, world_size=target_run.world_size,
                                controller=_this_controller(), hosts=target_run.hosts, metrics=metrics,
                                grace=spec.supervision.grace if taker is not None else 0.0, origin=origin)
        _say_metrics(terminal, run_id, metrics)
        if taker is not None and spec.supervision.grace > 0:
            terminal.say(f"run {run_id}: should this controller be lost, the nodes run on for "
                         f"{spec.supervision.grace:g} s (supervision.grace): {taker} takes them back")
        return _run(target_run, run, terminal)


def _say_metrics(terminal: Terminal, run_id: str, metrics: str | None) -> None:
    if metrics is not None:
        terminal.say(f"run {run_id}: metrics on {metrics}")


def _new_record(runs_root: Path, run_id: str, terminal: Terminal, record_file: str, spec: JobSpec, spec_text: str,
                mode: str) -> RunDir:
    """The run's directory with its first files and its disk's reserve (record/disk.py), the terminal's record
    in it; or, where the disk cannot take them, an error before anything starts, and nothing of it left."""
    made = not run_dir(runs_root, run_id).path.exists()  # a detached launch made it already (for its log)
    try:
        run = create_run_dir(runs_root, run_id)
        disk = RecordDisk(run.path)
        disk.keep_reserve()
        terminal.record = StreamRecord(run.stream, record_file, disk)
        # no disk yet: its failure fails the launch
        run.write_text(run.spec_copy, masked_spec_text(spec_text), "the job's spec")
        write_entrypoint_record(run, spec, mode)
    except OSError as exc:
        if terminal.record is not None:
            terminal.record.close()
            terminal.record = None
        if made:
            shutil.rmtree(run_dir(runs_root, run_id).path, ignore_errors=True)
        raise HarnessError(f"cannot create the run's record in {runs_root}/: {exc.strerror or exc} "
                           f"({space_text(runs_root)}; a run needs {size_text(RESERVE_BYTES)} there to start)") \
            from None
    disk.notice = lambda line: terminal.say(line, kept=False)
    terminal.logs_command = f"harness logs {run_id}"
    return replace(run, disk=disk)


def continue_run(backend: Backend, spec: JobSpec, continued: Continued, out: IO[str] = sys.stdout,
                 metrics: str | None = None) -> int:
    """launch, for a run whose directory exists: its next attempt on backend, and on to the run's end,
    unless the allocation's time is up first (then the job is requeued, and the run goes on there)."""
    terminal = Terminal(out)
    disk = RecordDisk(continued.run.path, lambda line: terminal.say(line, kept=False))
    run = replace(continued.run, disk=disk)
    target_run = _BackendRun(backend, spec, terminal, continued)
    with _closing(target_run, terminal):
        target_run.prepare(str(run.spec_copy), run.path.parent, run.run_id)
        with disk.writing("the run's reserve"):
            disk.keep_reserve()
        terminal.record = StreamRecord(run.stream, disk=disk)
        terminal.logs_command = f"harness logs {run.run_id}"
        target_run.state = replace(run.read_state(), status=RunStatus.RUNNING, controller=_this_controller(),
                                   nnodes=target_run.nnodes, world_size=target_run.world_size,
                                   hosts=target_run.hosts, metrics=metrics)
        _say_metrics(terminal, run.run_id, metrics)
        return _run(target_run, run, terminal)


def attach_run(backend: Backend, spec: JobSpec, run: RunDir, out: IO[str] = sys.stdout,
               metrics: str | None = None) -> int:
    """launch, for a run whose controller is gone while its nodes' agents hold them (supervision.grace): its
    current attempt taken back as it runs (what its nodes said meanwhile into its logs and record, not onto the
    terminal), then on to the run's end as its own controller would have gone."""
    terminal = Terminal(out)
    disk = RecordDisk(run.path, lambda line: terminal.say(line, kept=False))
    run = replace(run, disk=disk)
    state = run.read_state()
    target_run = _BackendRun(backend, spec, terminal, attached=state)
    with _closing(target_run, terminal):
        target_run.prepare(str(run.spec_copy), run.path.parent, run.run_id)
        terminal.record = StreamRecord(run.stream, disk=disk)
        terminal.logs_command = f"harness logs {run.run_id}"
        if isinstance(backend, Announcing):
            backend.announce_to(terminal.say)
        target_run.state = replace(state, controller=_this_controller(), metrics=metrics)
        run.write_state(target_run.state)
        _say_metrics(terminal, run.run_id, metrics)
        return _run(target_run, run, terminal)


@contextmanager
def _closing(target_run: _TargetRun, terminal: Terminal) -> Iterator[None]:
    """The target's resources released and the terminal and the record closed, however the run ends."""
    try:
        yield
    finally:
        target_run.close()
        terminal.close()
        if terminal.record is not None:
            terminal.record.close()
            terminal.record.disk.close()


def _this_controller() -> ControllerId:
    return ControllerId(os.getpid(), start_ticks(os.getpid()), socket.gethostname())


def _run(target_run: _TargetRun, run: RunDir, terminal: Terminal) -> int:
    """The target_run's run under the signals that stop it, to its summary and exit status."""
    stop = threading.Event()
    with stop_on_signals(stop):
        try:
            attempts, reason = target_run.run(run, stop)
        except BaseException as exc:
            run.write_state(replace(target_run.state, status=RunStatus.ERROR, error=str(exc), ended_at=time.time()))
            target_run.failed()
            raise
    if target_run.ended_elsewhere():
        return target_run.exit_code
    return _finish(run, target_run.state, attempts, stop, reason, terminal)


class _TargetRun:
    """How one kind of target runs: what launch needs before the run directory exists, then the run."""

    state: RunState
    nnodes: int
    world_size: int
    hosts: list[str]
    record_file = HARNESS_FILE  # where the stream record keeps the harness's own words
    exit_code = EXIT_OK
    collapse = True  # identical lines of many ranks shown as one on the terminal (False: --no-collapse)

    def ended_elsewhere(self) -> bool:
        """The run's summary is not this controller's to write (another one wrote it or will): exit_code."""
        return False

    def prepare(self, source: str, runs_root: Path, run_id: str) -> None:
        """Everything that can fail before anything exists: nnodes, world_size and hosts are known after."""
        raise NotImplementedError

    def run(self, run: RunDir, stop: threading.Event) -> tuple[list[Attempt], str | None]:
        """The attempts, and why no further one started (None: none was needed, or a stop)."""
        raise NotImplementedError

    def failed(self) -> None:
        """The controller itself failed: what the user must know about what is left."""

    def collapse_for(self, out: Terminal, world_size: int) -> None:
        """Few ranks' lines are shown each as it is; an attempt of more collapses identical ones."""
        out.collapse = self.collapse and world_size > COLLAPSE_ABOVE

    def close(self) -> None:
        """Release the target's resources."""


class _BackendRun(_TargetRun):
    """A Backend: every node started here and supervised, attempt after attempt (after those of a
    continued run)."""

    def __init__(self, backend: Backend, spec: JobSpec, out: Terminal, continued: Continued | None = None,
                 attached: RunState | None = None) -> None:
        self.backend, self.spec, self.out, self.continued = backend, spec, out, continued
        self.attached = attached  # the state of a run whose current attempt is taken back (attach_run)
        self.before: list[Attempt] = list(continued.before) if continued else []
        self.down: set[str] = set()
        self.requeued = False

    def prepare(self, source: str, runs_root: Path, run_id: str) -> None:
        first = len(self.continued.before) if self.continued else 0
        machines = self.backend.machines()
        self.hosts_out = RunsHosts(hosts_file(), machines, run_id, self.spec.restarts.cooldown,
                                   self.spec.restarts.out_limit(len(machines)))
        if self.attached is not None:
            self._prepare_attached(run_dir(runs_root, run_id), machines)
            return
        for line in self.hosts_out.keep_out_earlier():
            self.out.say(line)
        self.down |= set(self.hosts_out.kept_out)
        unfit: dict[str, str] = {}
        planned = self.backend.plan(self.spec, run_id, first, frozenset(self.down))
        early = self._stand_by_first(planned) if not self.backend.standbys_await_check else None
        try:
            self.plan = _ready_plan(self.backend, self.spec, run_id, first, self.down, self.out, unfit, planned)
        finally:
            self._keep_out(unfit)
            if early is not None:
                early.join()  # whatever the check found, its standbys are known: close() ends them on a failure
        if self.backend.standbys_await_check:
            self._stand_by_first(self.plan).join()
        self.nnodes, self.world_size = self.plan.nnodes, self.plan.world_size
        self.hosts = [n.host for n in self.plan.nodes]

    def _stand_by_first(self, plan: Plan) -> threading.Thread:
        """The first attempt's standbys for the plan's nodes (restarts.standby; false: none), started by a thread:
        while the check runs, where they need nothing of it, so that the nodes' imports are done once it passed."""
        def stand_by() -> None:
            if self.spec.restarts.standby is not None:
                with contextlib.suppress(HarnessError):  # none: the nodes start afresh, and the check says why
                    self.backend.stand_by(self.spec, plan.run_id, plan.attempt, frozenset(), plan)
        thread = threading.Thread(target=stand_by, daemon=True)
        thread.start()
        return thread

    def _prepare_attached(self, run: RunDir, machines: dict[str, str]) -> None:
        """The running attempt's plan again, on its hosts, with its port: the nodes it names are taken back, not
        started. The hosts down so far stay down for any later attempt."""
        state = self.attached
        assert state is not None
        self.before = run.read_attempts()
        self.down = set().union(*(a.down for a in self.before), *(a.kept_out for a in self.before))
        try:
            recorded = json.loads(run.plan_json(state.attempt).read_text())
        except (OSError, ValueError) as exc:
            raise HarnessError(f"run {run.run_id}: cannot read the plan of its attempt {state.attempt} "
                               f"({run.plan_json(state.attempt)}): {exc}") from None
        others = set(machines) - set(state.hosts) if machines else self.down
        self.plan = self.backend.plan(self.spec.at_port(recorded["master_port"]), run.run_id,
                                      state.attempt, frozenset(others))
        if (planned := [n.host for n in self.plan.nodes]) != state.hosts:
            raise HarnessError(f"run {run.run_id}: its attempt {state.attempt} runs on {', '.join(state.hosts)}, but "
                               f"its job and hosts now plan {', '.join(planned)}: did the inventory change?")
        self.nnodes, self.world_size, self.hosts = self.plan.nnodes, self.plan.world_size, state.hosts

    def _keep_out(self, failed: dict[str, str]) -> None:
        for line in self.hosts_out.keep_out(failed):
            self.out.say(line)

    def run(self, run: RunDir, stop: threading.Event) -> tuple[list[Attempt], str | None]:
        """Attempt after attempt until one succeeds, the program fails (restarts.on: infra), the restarts
        or spares run out, or a stop is asked for (Ctrl-C, `harness stop`: no further attempt)."""
        backend, spec, out, plan, down = self.backend, self.spec, self.out, self.plan, self.down
        attempts: list[Attempt] = list(self.before)
        reason = no_restart_reason(spec.restarts, attempts) if attempts and self.attached is None else None
        if reason is not None:
            return attempts, reason  # the job's earlier runs used up every restart
        preflight_s = time.time() - self.state.started_at
        taken = self.attached
        while True:
            if taken is None:
                run.write_text(run.plan_json(plan.attempt), render_json(plan), "the attempt's plan")
                run.write_text(run.plan_text(plan.attempt), render_text(plan), "the attempt's plan")
            self.state = replace(self.state, attempt=plan.attempt, hosts=[n.host for n in plan.nodes],
                                 nnodes=plan.nnodes, world_size=plan.world_size,
                                 attempt_started_at=taken.attempt_started_at if taken else time.time(),
                                 attempt_preflight_s=taken.attempt_preflight_s if taken else round(preflight_s, 3))
            run.write_state(self.state)
            self.collapse_for(out, plan.world_size)
            if plan.nnodes < spec.nnodes:
                out.say(_fewer_nodes(spec, plan, down))
            standby = frozenset(down) if spec.restarts.standby is not None and len(attempts) < spec.restarts.max \
                else None
            attempt = _attempt(backend, plan, spec, run, stop, self.state.attempt_preflight_s, attempts, out, standby,
                               self._taking_back(run) if taken is not None else None,
                               self.state.attempt_started_at, self._slow_policy(plan, attempts))
            taken = None
            attempts.append(replace(attempt, unwatched=[u for u in self.state.unwatched if u.attempt == plan.attempt],
                                    kept_out={name: f"{entry.reason} (run {entry.run_id})"
                                              for name, entry in self.hosts_out.kept_out.items()}))
            time_up = self.continued.time_up() if self.continued is not None else None
            if time_up is not None:
                attempts[-1] = replace(attempts[-1], status=RunStatus.FAILED, ended_by=time_up,
                                       kind=attempts[-1].kind or FailureKind.INFRA)
            run.write_attempts(attempts)  # for a requeued job's next run, and for status and metrics meanwhile
            if time_up is not None:
                stop.clear()  # the batch script's SIGTERM after the warning, not a stop asked for
                reason = self._requeue(time_up, attempts)
                break
            if attempts[-1].status is not RunStatus.FAILED or stop.is_set():
                break
            # Kept out of later runs whether or not this one restarts: the host lost first, and any lost before the
            # stop began (one whose agent ended after it may be the stop's own doing: an srun step it killed).
            failed = attempts[-1]
            stopping = failed.ended_at - (failed.teardown_s or 0.0)
            self._keep_out({f.host: f.evidence for i, f in enumerate(failed.failures)
                            if f.host_down and (i == 0 or failed.started_at + f.after_s < stopping)})
            reason = no_restart_reason(spec.restarts, attempts)
            if reason is not None:
                break
            down |= set(attempts[-1].down)
            cause = attempts[-1].failures[0]
            slow = attempts[-1].kind is FailureKind.SLOW  # the harness's choice: no failure to back off from
            delay = 0.0 if slow else backoff_seconds(spec.restarts, len(attempts) - 1)
            out.say((f"attempt {plan.attempt} stopped for {cause.host}'s slowness" if slow else
                     f"attempt {plan.attempt} failed at the {attempts[-1].kind} level on {cause.host} "
                     f"({cause.evidence})") + f"; restart {len(attempts)} of {spec.restarts.max} in {delay:g} s"
                    + (f", without {', '.join(sorted(down))}" if down else ""))
            attempts[-1] = replace(attempts[-1], backoff_s=delay)
            if stop.wait(delay):
                break
            began = time.time()
            unfit: dict[str, str] = {}
            try:
                plan = _ready_plan(backend, spec, run.run_id, plan.attempt + 1, down, out, unfit)
            except (CheckFailed, NoSpareHosts) as exc:
                reason = f"attempt {plan.attempt + 1} could not start: {exc}"
                break
            finally:
                self._keep_out(unfit)
            preflight_s = time.time() - began
            if stop.is_set():
                break
        return attempts, reason

    def _slow_policy(self, plan: Plan, attempts: list[Attempt]) -> SlowPolicy:
        """What a slowness in plan's attempt is weighed against: a restart on the hosts left without the slow one
        (a spare in its place, or fewer nodes as restarts.min_nnodes allows), and the run's measured recovery. The
        pool is asked when the slowness is weighed: a spare pod may dial in after the attempt started."""
        spec, down = self.spec, frozenset(self.down)

        def without(host: str) -> float | str:
            try:
                left = take_healthy(spec, self.backend.pool(spec), down | {host}, what="host", pool="the job's")
            except NoSpareHosts:
                return (f"no spare host is left and restarts.min_nnodes ({spec.fewest_nnodes}) does not allow fewer "
                        f"than {plan.nnodes} nodes")
            return min(1.0, len(left) / plan.nnodes)

        done = len(attempts)
        recovered = [a.recover_s for a in attempts if a.recover_s is not None]
        return SlowPolicy(spec.health.slow_for, "slow" in spec.restarts.on,
                          f"restarts.max: {spec.restarts.max}" if done >= spec.restarts.max else None, without,
                          recovered[-1] if recovered else None)

    def _taking_back(self, run: RunDir) -> Callable[[Supervisor], None]:
        """What is done once the attached nodes' agents replayed what they kept: the time without a controller
        recorded (state.json, then the attempt) and said once, with where its lines are."""
        attached_at = time.time()

        def taken_back(sup: Supervisor) -> None:
            deadline = time.monotonic() + REPLAY_WAIT
            for process in sup.processes:
                process.replayed.wait(max(0.0, deadline - time.monotonic()))
            lost = [at for p in sup.processes if p.unwatched and (at := p.unwatched.get("lost_at")) is not None]
            by = self.state.controller
            entry = Unwatched(self.state.attempt, attached_at, f"{by.pid}@{by.host}", min(lost) if lost else None)
            self.state = replace(self.state, unwatched=[*self.state.unwatched, entry])
            run.write_state(self.state)
            lines = sum(live.unwatched_lines for live in sup.nodes)
            since = f"its controller was lost {attached_at - entry.lost_at:.1f} s before; " if entry.lost_at else ""
            held = [p.node.label for p in sup.processes if p.unwatched is None]
            sup.say(f"run {run.run_id}: taken back by {entry.by}; {since}the {lines} line(s) its nodes said "
                    f"meanwhile are in its logs (`harness logs {run.run_id}`), not shown here"
                    + (f"; no agent held {', '.join(held)}" if held else ""))

        return taken_back

    def _requeue(self, time_up: str, attempts: list[Attempt]) -> str | None:
        """The allocation ends: the job runs again on a new one when a restart is left (the reason why not,
        else)."""
        assert self.continued is not None
        most = self.spec.restarts.max
        if len(attempts) > most:
            return f"{time_up}, and no restart is left (restarts.max: {most})"
        self.out.say(f"{time_up}: requeueing the job (restart {len(attempts)} of {most}); the next attempt "
                     f"resumes from the newest checkpoint")
        self.continued.requeue()
        self.requeued = True
        return None

    def ended_elsewhere(self) -> bool:
        """Requeued: the run goes on in the job's next run, which writes the summary."""
        return self.requeued

    def close(self) -> None:
        self.backend.stand_down()
        self.backend.close()


class _SchedulerRun(_TargetRun):
    """A Scheduler: the job submitted, its controller in the allocation (the job's batch step) writing the
    run's record; this one follows that record and the job's state to the end (follow.py), or only
    submits the job (detach). It writes the summary only when the job ended without its controller's."""

    record_file = FOLLOWER_FILE

    def __init__(self, scheduler: Scheduler, spec: JobSpec, out: Terminal, detach: bool) -> None:
        self.scheduler, self.spec, self.out, self.detach = scheduler, spec, out, detach
        self.job_id: str | None = None
        self.follower: Follower | None = None
        self.summary: RunSummary | None = None

    def prepare(self, source: str, runs_root: Path, run_id: str) -> None:
        self.submission = self.scheduler.prepare(self.spec, source, run_id, run_dir(runs_root, run_id).path)
        self.nnodes, self.world_size, self.hosts = self.submission.nnodes, self.submission.world_size, []

    def run(self, run: RunDir, stop: threading.Event) -> tuple[list[Attempt], str | None]:
        for name, text in self.submission.files.items():
            run.write_text(run.path / name, text, name)
        for note in self.submission.notes:
            self.out.say(note)
        self.job_id = self.scheduler.submit(self.submission, run.path / self.submission.file_name)
        self.state = replace(self.state, scheduler_job=self.job_id)
        run.write_state(self.state)
        what = f"{self.scheduler.name.capitalize()} job {self.job_id}"
        nproc = self.world_size // self.nnodes
        self.out.say(f"run {run.run_id}: submitted {what} ({self.nnodes} node(s) x {nproc} process(es)); "
                     f"logs in {run.path}/")
        if self.detach:
            # Until the job's controller starts, the run is the scheduler's: not lost when this one exits.
            self.state = replace(self.state, controller=ControllerId(0, None, what))
            run.write_state(self.state)
            self.out.say(f"follow: harness logs {run.run_id} --follow; status: harness status {run.run_id}; stop: "
                         f"harness stop {run.run_id}")
            return [], None
        self.collapse_for(self.out, self.world_size)
        self.follower = Follower(self.scheduler, run, self.job_id, self.out, self.record_file)
        job = self.follower.follow(stop)
        self.summary = run.read_summary()
        if self.summary is not None:
            self.exit_code = self.summary.exit_code
            return self.summary.attempts, None
        self.state = replace(run.read_state(), controller=self.state.controller)
        return [], self.follower.ended_without_record(job)

    def ended_elsewhere(self) -> bool:
        return self.detach or self.summary is not None

    def failed(self) -> None:
        if self.job_id is not None and not (self.follower and self.follower.cancelled):
            what = f"{self.scheduler.name.capitalize()} job {self.job_id}"
            self.out.say(f"{what} is still in {self.scheduler.name.capitalize()}'s hands: `harness stop "
                         f"{self.state.run_id}` cancels it")


def _ready_plan(backend: Backend, spec: JobSpec, run_id: str, attempt: int, down: set[str],
                out: Terminal, unfit: dict[str, str], planned: Plan | None = None) -> Plan:
    """Plan on the hosts not down (planned: that plan, made already) and check them; a host that fails the check is
    down too and a spare takes its place, until the check passes or no spare is left (the check's report is then the
    error). With no spare left the plan has fewer nodes as restarts.min_nnodes allows (the planner's
    take_healthy), and the check gets the spec on that many nodes. unfit gets the hosts whose machine
    failed the check (CheckFailed.unfit), to be kept out of later runs too."""
    plan = planned or backend.plan(spec, run_id, attempt, frozenset(down))
    while True:
        try:
            return backend.check(plan, spec.at_nnodes(plan.nnodes))
        except CheckFailed as exc:
            if not exc.hosts or exc.hosts <= down:
                raise
            down |= exc.hosts
            unfit.update(exc.unfit)
            try:
                again = backend.plan(spec, run_id, attempt, frozenset(down))
            except NoSpareHosts as none_left:
                raise CheckFailed(f"{exc}\n{none_left}", exc.hosts) from None
            instead = "a spare host takes its place" if again.nnodes == plan.nnodes else "no spare is left"
            out.say(f"preflight failed on {', '.join(sorted(exc.hosts))}: {instead}")
            plan = again


def _fewer_nodes(spec: JobSpec, plan: Plan, down: set[str]) -> str:
    """What an attempt on fewer nodes than the job's changes, said before it starts."""
    return (f"{', '.join(sorted(down))} down and no spare left: attempt {plan.attempt} runs on {plan.nnodes} of the "
            f"job's {spec.nnodes} nodes (restarts.min_nnodes: {spec.fewest_nnodes}), world size {plan.world_size} "
            f"instead of {spec.nnodes * plan.nproc_per_node}, ranks renumbered, master {plan.nodes[0].host}")


def _stand_by(backend: Backend, spec: JobSpec, plan: Plan, down: frozenset[str], sup: Supervisor,
              ended: threading.Event) -> None:
    """The next attempt's standbys, started restarts.standby seconds after every rank of this one joined its
    process group (their imports are done then, and its start-up no longer competes with theirs for the CPU;
    ranks not seen joining: STANDBY_AFTER seconds into the attempt)."""
    began = time.monotonic()
    while sum(len(live.joined) for live in sup.nodes) < plan.world_size and time.monotonic() - began < STANDBY_AFTER:
        if ended.wait(0.2):
            return
    assert spec.restarts.standby is not None
    if not ended.wait(spec.restarts.standby):
        with contextlib.suppress(HarnessError):  # no plan for the next attempt now: it starts afresh
            backend.stand_by(spec, plan.run_id, plan.attempt + 1, down)


def _attempt(backend: Backend, plan: Plan, spec: JobSpec, run: RunDir, stop: threading.Event, preflight_s: float,
             before: list[Attempt], out: Terminal, standby: frozenset[str] | None = None,
             taking_back: Callable[[Supervisor], None] | None = None, started_at: float | None = None,
             slow_policy: SlowPolicy | None = None) -> Attempt:
    """Start every node of plan (spec on the plan's nodes, which may be fewer than the job's), supervise
    them to their end, and say how this attempt went. standby: the hosts down, where the next attempt's
    standbys are to be started while this one runs (None: none). taking_back: the nodes run already, their
    controller lost: they are attached, not started, and this is told of it once the supervisor has them;
    started_at: when the attempt started (None: now); slow_policy: what a lasting slowness is weighed against."""
    # The ranks' joining is seen at their start: not by a controller that takes a running attempt back.
    watched = all(STORE_WATCH_ENV.items() <= n.env.items() for n in plan.nodes) and taking_back is None
    furthest = max((a.progress.last_step for a in before if a.progress), default=None)
    sup = Supervisor(grace=spec.timeouts.stop_grace, terminal=out,
                     log_file=lambda node: run.log_file(node.node_rank, plan.attempt),
                     quiet_cpp_info=watched and not STORE_WATCH_ENV.keys() & spec.env.keys(),
                     judge=HealthJudge(spec.health.stall, spec.health.slow, plan.world_size, spec.timeouts.rendezvous)
                     if spec.health.watched else None, run=run,
                     attempt=plan.attempt, record=out.record, progress=spec.health.progress_pattern,
                     furthest=furthest,
                     checkpoint=spec.health.checkpoint_pattern, rendezvous=spec.timeouts.rendezvous,
                     slow_policy=slow_policy if spec.health.slow > 0 else None)
    if taking_back is not None:  # its progress goes on from what its lost controller last recorded
        with contextlib.suppress(RecordError):
            recorded = run.read_health(plan.attempt)
            sup.health_loop.progress = recorded.progress if recorded is not None else None
        sup.health_loop.attempt_started_at = started_at or sup.health_loop.started_at
    which = f"run {plan.run_id}: " if plan.attempt == 0 else f"run {plan.run_id} attempt {plan.attempt}, "
    hosts = _hosts_text([n.host for n in plan.nodes])
    sup.say(f"{which}{'taking back ' if taking_back else ''}{plan.nnodes} node(s) x {plan.nproc_per_node} "
            f"process(es) on {hosts}, master {plan.master_addr}:{plan.master_port}, logs in {run.path}/")
    started = started_at or time.time()
    if before and before[-1].failures and taking_back is None:  # the run's recovery figure, said as soon as it is known
        failed = before[-1]
        sup.health_loop.on_first_step = lambda progress: sup.say(
            f"attempt {plan.attempt} {restart_of(failed, started, _joined(sup), progress, furthest).describe()}")
    over = threading.Event()
    warming = threading.Thread(target=_stand_by, args=(backend, spec, plan, standby, sup, over), daemon=True)
    warm: list[str] = []
    try:
        try:
            nodes = backend.attach(plan, spec, run.resume_points(plan.attempt, [n.node_rank for n in plan.nodes])) \
                if taking_back else backend.start(plan, spec.at_nnodes(plan.nnodes))
        except OSError as exc:  # e.g. an argument list too long for the OS: only the OS can refuse it
            raise HarnessError(f"could not start the nodes: {exc.strerror or exc}") from None
        warm = [n.node.host for n in nodes if n.warm]
        if warm and before:
            sup.say(f"{', '.join(warm)} started warm: torchrun and its workers were started, their imports done, "
                    f"while attempt {plan.attempt - 1} ran (restarts.standby)")
        if not before:  # said once: every later attempt's nodes are warm where its standbys were
            for line in _cold_starts(nodes, spec):
                sup.say(line)
        sup.start(nodes, started if taking_back else None)
        if taking_back is not None:
            threading.Thread(target=taking_back, args=(sup,), daemon=True).start()
        if standby is not None:
            warming.start()
        sup.wait(stop)
    finally:
        sup.finish()
        over.set()
        if warming.is_alive():
            warming.join()
        backend.close()
    ended = time.time()
    found = attempt_failures(sup.nodes, sup.stopping_since, verdict=bool(sup.hang or sup.slow_out or sup.unjoined))
    failures = [failure_of(f, started, ended) for f in found]
    if sup.hang is not None:
        failures.insert(0, hang_failure(sup.hang, sup.hang_at or started, sup.nodes, started))
    if sup.slow_out is not None:
        failures.insert(0, slow_failure(sup.slow_out, sup.nodes, started))
    if sup.unjoined is not None:
        failures[:0] = unjoined_failures(sup.unjoined, sup.nodes, started, sup.stopping_since or ended)
    if stop.is_set():
        status = stopped_status(run)
    else:
        status = RunStatus.FAILED if sup.first_failure is not None or sup.hang or sup.unjoined or sup.slow_out else \
            RunStatus.SUCCEEDED
    previous_failure = before[-1].failures[0] if before and before[-1].failures else None
    progress = sup.health_loop.track_progress([])
    restart = restart_of(before[-1], started, _joined(sup), progress, furthest) if previous_failure else None
    return Attempt(
        attempt=plan.attempt, hosts=[n.host for n in plan.nodes], status=status, started_at=started, ended_at=ended,
        nodes=[recorded_node(r, run, plan.attempt) for r in sup.nodes], failures=failures,
        kind=(FailureKind.HANG if sup.hang else FailureKind.SLOW if sup.slow_out else FailureKind.INFRA
              if sup.unjoined else attempt_kind(found))
        if status is RunStatus.FAILED else None,
        down=sorted({f.host for f in failures if f.host_down}), preflight_s=round(preflight_s, 3),
        teardown_s=round(ended - sup.stopping_since, 3) if sup.stopping_since else None,
        recover_s=restart.total_s if restart is not None and restart.stepped else None,
        joined_ranks=sorted(set().union(*(r.joined for r in sup.nodes))) if watched else None,
        nnodes=plan.nnodes, world_size=plan.world_size, health=sup.health_loop.events, progress=progress,
        restart=restart, warm=warm,
    )


def _cold_starts(nodes: list[NodeProcess], spec: JobSpec) -> list[str]:
    """Why the first attempt's nodes that had no standby started cold: their torchrun and workers import torch
    one after the other, as by hand, instead of once and before the check had passed."""
    why: dict[str, list[str]] = {}
    for node in nodes:
        if not node.warm:
            reason = "restarts.standby is false" if spec.restarts.standby is None else node.cold
            why.setdefault(reason or "no standby was started for it", []).append(node.node.host)
    return [f"{_hosts_text(hosts)} started cold (torchrun, then its workers, each importing torch): {reason}"
            for reason, hosts in why.items()]


def _hosts_text(named: list[str]) -> str:
    """Hosts in one line: every one up to HOSTS_NAMED, beyond them the first few and the last."""
    return ", ".join(named) if len(named) <= HOSTS_NAMED else f"{', '.join(named[:3])}, ..., {named[-1]}"


def _joined(sup: Supervisor) -> list[float]:
    """When each rank of the attempt joined its process group, as far as seen."""
    return [at for live in sup.nodes for at in live.joined.values()]


def _not_distributed(attempt: Attempt) -> str | None:
    """A script that exits 0 without creating a process group (e.g. after "not enough GPUs") is no
    distributed success. Unknown (None) where the nodes' output was not watched."""
    world = sum(len(node.ranks) for node in attempt.nodes)
    if attempt.joined_ranks != [] or world < 2:
        return None
    return (f"it did not run distributed: none of its {world} ranks joined a process group (no "
            f"init_process_group reached the rendezvous store at MASTER_ADDR:MASTER_PORT)")


def _finish(run: RunDir, state: RunState, attempts: list[Attempt], stop: threading.Event, reason: str | None,
             out: Terminal) -> int:
    last = attempts[-1] if attempts else None
    if stop.is_set():
        status, code, reason = stopped_status(run), EXIT_INTERRUPTED, None
    elif last is not None and last.status is RunStatus.SUCCEEDED:
        status, code, reason = RunStatus.SUCCEEDED, EXIT_OK, None
    else:
        status, code = RunStatus.FAILED, EXIT_FAILED
    ended = time.time()
    warnings = [not_distributed] if status is RunStatus.SUCCEEDED and last is not None and \
        (not_distributed := _not_distributed(last)) else []
    if run.disk is not None and run.disk.incomplete:
        warnings.append(run.disk.incomplete)
    first_failure = last.failures[0] if last and last.failures and status is RunStatus.FAILED else None
    summary = RunSummary(
        run_id=state.run_id, name=state.name, status=status, exit_code=code, started_at=state.started_at,
        ended_at=ended, duration_s=round(ended - state.started_at, 3), nodes=last.nodes if last else [],
        first_failure=first_failure, attempts=attempts, reason=reason, warnings=warnings,
        error=summary_error(first_failure, reason) if status is RunStatus.FAILED else None,
        goodput=run_goodput(state.started_at, ended, attempts),
    )
    run.write_summary(summary)
    report(out, summary, run)  # before the state says the run ended: `logs --follow` stops there, with these lines
    run.write_state(replace(state, status=status, ended_at=ended))
    return code
