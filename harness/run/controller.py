"""The run controller: one run through one backend, from plan to summary; and how other terminals
stop it.

launch: plan -> check (nothing exists yet when it fails) -> run directory -> start every node ->
supervise -> summary and exit status. Stop protocol: `harness stop` writes the run's stop marker and
SIGTERMs the controller, which stops every node through its backend; a controller that is gone is
replaced by a sweep of the run's processes on this machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO

from harness.errors import HarnessError
from harness.node.agent import is_alive, kill_run_processes, start_ticks
from harness.plan.planner import STORE_WATCH_ENV, NoSpareHosts, Plan
from harness.plan.render import render_json, render_text
from harness.run import worker_output
from harness.run.records import (
    Attempt,
    ControllerId,
    Failure,
    NodeResult,
    RunDir,
    RunState,
    RunStatus,
    RunSummary,
    create_run_dir,
    run_dir,
    write_text_atomic,
)
from harness.run.recovery import NodeFailure, attempt_failures, attempt_kind, backoff_seconds, no_restart_reason
from harness.run.supervisor import NodeRecord, Supervisor
from harness.spec.job import JobSpec
from harness.targets.base import Backend, CheckFailed, Outcome

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
DETACH_STARTUP_TIMEOUT = 300.0


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


def say(out: IO[str], message: str) -> None:
    out.write(f"harness: {message}\n")
    out.flush()


def _describe(failure: Failure) -> str:
    """Where and how: `node 1 (h2, global rank 1): exit code 1 after 3.2 s`, then the class and the
    evidence when they add to that."""
    first, last = failure.ranks[0], failure.ranks[-1]
    who = f"global rank {failure.rank}" if failure.rank is not None else \
        f"global rank {first}" if first == last else f"global ranks {first}-{last}"
    text = f"node {failure.node_rank} ({failure.host}, {who}): {failure.description} after {failure.after_s} s"
    extra = "" if failure.evidence in (failure.description, f"rank {failure.rank} {failure.description}") \
        else f": {failure.evidence}"
    return f"{text} ({failure.kind.value}{extra})"


def _report(out: IO[str], summary: RunSummary, run: RunDir) -> None:
    if len(summary.attempts) > 1:
        for attempt in summary.attempts:
            recovered = f", recovered in {attempt.recover_s} s" if attempt.recover_s is not None else ""
            how = f"failed on {_describe(attempt.failures[0])}" if attempt.failures else attempt.status.value
            say(out, f"attempt {attempt.attempt} on {', '.join(attempt.hosts)}{recovered}: {how}")
    failure = summary.first_failure
    if summary.status is RunStatus.SUCCEEDED:
        warned = "".join(f", but {warning}" for warning in summary.warnings)
        say(out, f"run {summary.run_id} succeeded in {summary.duration_s} s{warned}; logs in {run.path}/")
    elif failure is not None:
        if failure.error is not None:  # what the user must change first: the exception and their own frame
            say(out, f"run {summary.run_id} FAILED: {failure.error}")
            if failure.error_at is not None:
                out.write(f"    at {failure.error_at}\n" + (f"        {failure.error_source}\n"
                                                           if failure.error_source else ""))
            say(out, f"first failure on {_describe(failure)}")
        else:
            say(out, f"run {summary.run_id} FAILED: first failure on {_describe(failure)}")
        if failure.hint:
            say(out, f"hint: {failure.hint}")
        if summary.reason:
            say(out, f"not restarted: {summary.reason}")
        say(out, f"last lines of node{failure.node_rank}" + (f", rank {failure.rank}:" if failure.rank is not None
                                                             else ":"))
        for line in failure.last_lines[-10:]:
            out.write(f"    {line}\n")
        last = summary.attempts[-1].attempt
        say(out, f"full logs: {run.log_file(failure.node_rank, last)}; summary: {run.summary_file}")
    elif summary.reason:
        say(out, f"run {summary.run_id} FAILED: {summary.reason}")
    else:
        say(out, f"run {summary.run_id} {summary.status.value}: every node stopped; logs in {run.path}/")
    out.flush()


def _ready_plan(backend: Backend, spec: JobSpec, run_id: str, log_dir: Path, attempt: int, down: set[str],
                out: IO[str]) -> Plan:
    """Plan on the hosts not down and check them; a host that fails the check is down too and a spare
    takes its place, until the check passes or no spare is left (the check's report is then the error)."""
    while True:
        plan = backend.plan(spec, run_id, log_dir, attempt, frozenset(down))
        try:
            return backend.check(plan, spec)
        except CheckFailed as exc:
            if not exc.hosts or exc.hosts <= down:
                raise
            down |= exc.hosts
            try:
                backend.plan(spec, run_id, log_dir, attempt, frozenset(down))
            except NoSpareHosts as none_left:
                raise CheckFailed(f"{exc}\n{none_left}", exc.hosts) from None
            say(out, f"preflight failed on {', '.join(sorted(exc.hosts))}: a spare host takes its place")


def launch(backend: Backend, spec: JobSpec, spec_path: Path, runs_root: Path, run_id: str,
           out: IO[str] = sys.stdout) -> int:
    """Run the job on backend to its end, restarting it as spec.restarts allows; returns the harness
    exit status. Nothing exists yet when the first plan or check fails. The backend is closed."""
    try:
        down: set[str] = set()
        began = time.time()
        log_dir = run_dir(runs_root, run_id).backend_logs
        plan = _ready_plan(backend, spec, run_id, log_dir, 0, down, out)
        run = create_run_dir(runs_root, run_id)
        shutil.copyfile(spec_path, run.spec_copy)
        state = RunState(run_id=run_id, name=plan.name, mode=backend.name, status=RunStatus.RUNNING,
                         started_at=began, nnodes=plan.nnodes, world_size=plan.world_size,
                         controller=ControllerId(os.getpid(), start_ticks(os.getpid())),
                         hosts=[n.host for n in plan.nodes])
        return _run(backend, spec, run, state, plan, down, out)
    finally:
        backend.close()


def _run(backend: Backend, spec: JobSpec, run: RunDir, state: RunState, plan: Plan, down: set[str],
         out: IO[str]) -> int:
    """Attempt after attempt until one succeeds, the program fails (restarts.on: infra), the restarts
    or spares run out, or a stop is asked for (Ctrl-C, `harness stop`: no further attempt)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    attempts: list[Attempt] = []
    reason: str | None = None
    try:
        preflight_s = time.time() - state.started_at
        while True:
            write_text_atomic(run.plan_json(plan.attempt), render_json(plan))
            write_text_atomic(run.plan_text(plan.attempt), render_text(plan))
            state = replace(state, attempt=plan.attempt, hosts=[n.host for n in plan.nodes])
            run.write_state(state)
            attempts.append(_attempt(backend, plan, spec, run, stop, preflight_s, attempts, out))
            if attempts[-1].status is not RunStatus.FAILED or stop.is_set():
                break
            reason = no_restart_reason(spec.restarts, attempts)
            if reason is not None:
                break
            down |= set(attempts[-1].down)
            delay = backoff_seconds(spec.restarts, len(attempts) - 1)
            cause = attempts[-1].failures[0]
            say(out, f"attempt {plan.attempt} failed at the {attempts[-1].kind} level on {cause.host} "
                      f"({cause.evidence}); restart {len(attempts)} of {spec.restarts.max} in {delay:g} s"
                      + (f", without {', '.join(sorted(down))}" if down else ""))
            attempts[-1] = replace(attempts[-1], backoff_s=delay)
            if stop.wait(delay):
                break
            began = time.time()
            try:
                plan = _ready_plan(backend, spec, run.run_id, run.backend_logs, plan.attempt + 1, down, out)
            except (CheckFailed, NoSpareHosts) as exc:
                reason = f"attempt {plan.attempt + 1} could not start: {exc}"
                break
            preflight_s = time.time() - began
            if stop.is_set():
                break
    except BaseException as exc:
        run.write_state(replace(state, status=RunStatus.ERROR, error=str(exc), ended_at=time.time()))
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return finish(run, state, attempts, stop, reason, out)


def _attempt(backend: Backend, plan: Plan, spec: JobSpec, run: RunDir, stop: threading.Event, preflight_s: float,
             before: list[Attempt], out: IO[str]) -> Attempt:
    """Start every node of plan, supervise them to their end, and say how this attempt went."""
    watched = all(STORE_WATCH_ENV.items() <= n.env.items() for n in plan.nodes)
    sup = Supervisor(grace=spec.timeouts.stop_grace, out=out,
                     log_file=lambda node: run.log_file(node.node_rank, plan.attempt),
                     quiet_cpp_info=watched and not STORE_WATCH_ENV.keys() & spec.env.keys())
    which = f"run {plan.run_id}: " if plan.attempt == 0 else f"run {plan.run_id} attempt {plan.attempt}, "
    hosts = ", ".join(n.host for n in plan.nodes)
    sup.say(f"{which}{plan.nnodes} node(s) x {plan.nproc_per_node} process(es) on {hosts}, "
            f"master {plan.master_addr}:{plan.master_port}, logs in {run.path}/")
    started = time.time()
    try:
        try:
            nodes = backend.start(plan, spec)
        except OSError as exc:  # e.g. an argument list too long for the OS: only the OS can refuse it
            raise HarnessError(f"could not start the nodes: {exc.strerror or exc}") from None
        sup.start(nodes)
        sup.wait(stop)
    finally:
        sup.finish()
        backend.close()
    ended = time.time()
    found = attempt_failures(sup.records, sup.stopping_since)
    failures = [failure_of(f, started, ended) for f in found]
    if stop.is_set():
        status = stopped_status(run)
    else:
        status = RunStatus.FAILED if sup.first_failure is not None else RunStatus.SUCCEEDED
    previous_failure = before[-1].failures[0] if before and before[-1].failures else None
    return Attempt(
        attempt=plan.attempt, hosts=[n.host for n in plan.nodes], status=status, started_at=started, ended_at=ended,
        nodes=[node_result(r, run, plan.attempt) for r in sup.records], failures=failures,
        kind=attempt_kind(found) if status is RunStatus.FAILED else None,
        down=sorted({f.host for f in failures if f.host_down}), preflight_s=round(preflight_s, 3),
        teardown_s=round(ended - sup.stopping_since, 3) if sup.stopping_since else None,
        recover_s=round(started - (before[-1].started_at + previous_failure.after_s), 3)
        if previous_failure else None,
        joined_ranks=sorted(set().union(*(r.joined for r in sup.records))) if watched else None,
    )


def _not_distributed(attempt: Attempt) -> str | None:
    """A script that exits 0 without creating a process group (e.g. after "not enough GPUs") is no
    distributed success. Unknown (None) where the nodes' output was not watched."""
    world = sum(len(node.ranks) for node in attempt.nodes)
    if attempt.joined_ranks != [] or world < 2:
        return None
    return (f"it did not run distributed: none of its {world} ranks joined a process group (no "
            f"init_process_group reached the rendezvous store at MASTER_ADDR:MASTER_PORT)")


def stopped_status(run: RunDir) -> RunStatus:
    """A stop asked for by `harness stop` (its marker) or by Ctrl-C/SIGTERM."""
    return RunStatus.STOPPED if run.stop_marker.exists() else RunStatus.INTERRUPTED


def finish(run: RunDir, state: RunState, attempts: list[Attempt], stop: threading.Event, reason: str | None,
            out: IO[str]) -> int:
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
    summary = RunSummary(
        run_id=state.run_id, name=state.name, status=status, exit_code=code, started_at=state.started_at,
        ended_at=ended, duration_s=round(ended - state.started_at, 3), nodes=last.nodes if last else [],
        first_failure=last.failures[0] if last and last.failures and status is RunStatus.FAILED else None,
        attempts=attempts, reason=reason, warnings=warnings,
    )
    run.write_summary(summary)
    run.write_state(replace(state, status=status, ended_at=ended))
    _report(out, summary, run)
    return code


def start_detached(argv: Sequence[str], run: RunDir, timeout: float = DETACH_STARTUP_TIMEOUT) -> int:
    """Start `harness launch` (argv) in a session of its own, so the run outlives this terminal, and
    return once its run record exists; if it fails before that, show its output and its exit status."""
    run.path.mkdir(parents=True)
    with open(run.controller_log, "w") as log:
        controller = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    deadline = time.monotonic() + timeout
    while not run.state_file.exists() and controller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not run.state_file.exists():
        sys.stderr.write(run.controller_log.read_text())
        if controller.poll() is None:
            controller.kill()
        code = controller.wait()
        shutil.rmtree(run.path, ignore_errors=True)  # no run started: leave no directory `status` cannot list
        return code
    print(f"run {run.run_id} started in the background (controller pid {controller.pid})\n"
          f"  follow: tail -f {run.controller_log}\n  status: harness status {run.run_id}\n"
          f"  stop:   harness stop {run.run_id}")
    return EXIT_OK


def controller_alive(state: RunState) -> bool:
    return is_alive(state.controller.pid, state.controller.start_ticks)


def stop_run(run: RunDir, timeout: float) -> int:
    """Ask the run's controller to stop its nodes; if the controller is gone, end the nodes directly."""
    state = run.read_state()
    if state.status is not RunStatus.RUNNING:
        print(f"run {run.run_id} already ended: {state.status.value}")
        return EXIT_OK
    if controller_alive(state):
        run.stop_marker.touch()
        os.kill(state.controller.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while controller_alive(state):
            if time.monotonic() > deadline:
                print(f"harness: run {run.run_id}: controller {state.controller.pid} did not stop within {timeout} s")
                return EXIT_FAILED
            time.sleep(0.1)
        print(f"run {run.run_id} stopped")
        return EXIT_OK
    if state.scheduler_job is not None:  # the batch system owns the processes: it ends them
        from harness.targets.slurm.client import SlurmClient

        SlurmClient().cancel(int(state.scheduler_job))
        done = f"cancelled Slurm job {state.scheduler_job}"
    else:
        done = f"ended {len(kill_run_processes(run.run_id))} leftover process(es)"
    run.write_state(replace(state, status=RunStatus.STOPPED, ended_at=time.time()))
    print(f"run {run.run_id}: controller was gone; {done}")
    return EXIT_OK
