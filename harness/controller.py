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

from harness.backends.base import Backend, Outcome
from harness.backends.node_agent import is_alive, kill_run_processes, start_ticks
from harness.errors import HarnessError
from harness.plan import Plan
from harness.render import render_json, render_text
from harness.runs import (
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
from harness.spec import JobSpec
from harness.supervisor import NodeRecord, Supervisor

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
DETACH_STARTUP_TIMEOUT = 300.0


def _node_result(record: NodeRecord, run: RunDir) -> NodeResult:
    outcome = record.outcome
    return NodeResult(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks),
        exit_code=outcome.exit_code if outcome else None,
        signal=signal.Signals(outcome.signal).name if outcome and outcome.signal else None,
        error=outcome.error if outcome else None,
        duration_s=round((record.ended or time.time()) - record.started, 3),
        log=str(run.log_file(record.node.node_rank)),
    )


def _failure(record: NodeRecord | None, started_at: float, now: float) -> Failure | None:
    if record is None or record.outcome is None:
        return None
    rank, rank_code = record.root_cause()
    # The failing rank's own exit code says more than torchrun's (always 1 when a worker failed).
    description = Outcome.from_returncode(rank_code).describe() if rank_code is not None \
        else record.outcome.describe()
    return Failure(
        node_rank=record.node.node_rank, host=record.node.host, ranks=list(record.node.ranks),
        rank=rank, rank_exit_code=rank_code, exit_code=record.outcome.exit_code,
        description=description, after_s=round((record.ended or now) - started_at, 3),
        last_lines=record.last_lines(rank),
    )


def _report(sup: Supervisor, summary: RunSummary, run: RunDir) -> None:
    failure = summary.first_failure
    if summary.status is RunStatus.SUCCEEDED:
        sup.say(f"run {summary.run_id} succeeded in {summary.duration_s} s; logs in {run.path}/")
    elif failure is not None:
        who = f"global rank {failure.rank}" if failure.rank is not None else \
            f"ranks {failure.ranks[0]}-{failure.ranks[-1]}"
        sup.say(f"run {summary.run_id} FAILED: first failure on node {failure.node_rank} "
                f"({failure.host}, {who}): {failure.description} after {failure.after_s} s")
        sup.say(f"last lines of node{failure.node_rank}:")
        for line in failure.last_lines[-10:]:
            sup.out.write(f"    {line}\n")
        sup.say(f"full logs: {run.log_file(failure.node_rank)}; summary: {run.summary_file}")
    else:
        sup.say(f"run {summary.run_id} {summary.status.value}: every node stopped; logs in {run.path}/")


def launch(backend: Backend, spec: JobSpec, spec_path: Path, runs_root: Path, run_id: str,
           out: IO[str] = sys.stdout) -> int:
    """Run the job on backend to its end; returns the harness exit status. The backend is closed."""
    try:
        plan = backend.plan(spec, run_id, run_dir(runs_root, run_id).backend_logs)
        backend.check(plan, spec)
        run = create_run_dir(runs_root, run_id)
        shutil.copyfile(spec_path, run.spec_copy)
        write_text_atomic(run.plan_json, render_json(plan))
        write_text_atomic(run.plan_text, render_text(plan))
        state = RunState(run_id=run_id, name=plan.name, mode=backend.name, status=RunStatus.RUNNING,
                         started_at=time.time(), nnodes=plan.nnodes, world_size=plan.world_size,
                         controller=ControllerId(os.getpid(), start_ticks(os.getpid())),
                         hosts=[n.host for n in plan.nodes])
        run.write_state(state)
        return _supervise(backend, plan, spec, run, state, out)
    finally:
        backend.close()


def _supervise(backend: Backend, plan: Plan, spec: JobSpec, run: RunDir, state: RunState, out: IO[str]) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(grace=spec.timeouts.stop_grace, out=out, log_file=lambda node: run.log_file(node.node_rank))
    try:
        sup.say(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nproc_per_node} process(es), "
                f"master {plan.master_addr}:{plan.master_port}, logs in {run.path}/")
        try:
            nodes = backend.start(plan, spec)
        except OSError as exc:  # e.g. an argument list too long for the OS: only the OS can refuse it
            raise HarnessError(f"could not start the nodes: {exc.strerror or exc}") from None
        sup.start(nodes)
        sup.wait(stop)
    except BaseException as exc:
        run.write_state(replace(state, status=RunStatus.ERROR, error=str(exc), ended_at=time.time()))
        raise
    finally:
        sup.finish()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.is_set():
        status = RunStatus.STOPPED if run.stop_marker.exists() else RunStatus.INTERRUPTED
        code = EXIT_INTERRUPTED
    elif sup.first_failure is not None:
        status, code = RunStatus.FAILED, EXIT_FAILED
    else:
        status, code = RunStatus.SUCCEEDED, EXIT_OK
    ended = time.time()
    summary = RunSummary(
        run_id=state.run_id, name=state.name, status=status, exit_code=code, started_at=state.started_at,
        ended_at=ended, duration_s=round(ended - state.started_at, 3),
        nodes=[_node_result(r, run) for r in sup.records],
        first_failure=_failure(sup.first_failure, state.started_at, ended),
    )
    run.write_summary(summary)
    run.write_state(replace(state, status=status, ended_at=ended))
    _report(sup, summary, run)
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
    killed = kill_run_processes(run.run_id)
    run.write_state(replace(state, status=RunStatus.STOPPED, ended_at=time.time()))
    print(f"run {run.run_id}: controller was gone; ended {len(killed)} leftover process(es)")
    return EXIT_OK
