"""Run a plan to completion: run directory, signals, supervision, summary, exit status."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from harness.errors import UsageError
from harness.plan import Plan
from harness.procs import start_ticks
from harness.render import render_json, render_text
from harness.runs import RunDir, create_run_dir, write_json_atomic
from harness.spec import JobSpec
from harness.supervisor import NodeProcess, Supervisor

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
STOP_REQUEST = "stop-requested"


def check_local_entrypoint(spec: JobSpec, workdir: Path) -> None:
    """A missing script should fail before any node starts, not as N identical tracebacks."""
    script = spec.entrypoint.script
    if script is not None and not (workdir / script).is_file():
        raise UsageError(f"entrypoint.script {script!r} not found in {workdir} (paths are relative to the "
                         f"directory harness is run from)")


def _record_start(run: RunDir, plan: Plan, spec_path: Path, mode: str) -> dict[str, object]:
    shutil.copyfile(spec_path, run.path / "spec.yaml")
    (run.path / "plan.json").write_text(render_json(plan))
    (run.path / "plan.txt").write_text(render_text(plan))
    state: dict[str, object] = {
        "run_id": plan.run_id, "name": plan.name, "mode": mode, "status": "running",
        "started_at": time.time(), "nnodes": plan.nnodes, "world_size": plan.world_size,
        "controller": {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid())},
        "hosts": [n.host for n in plan.nodes],
    }
    write_json_atomic(run.state_file, state)
    return state


def _summary(sup: Supervisor, state: dict[str, object], status: str, code: int) -> dict[str, object]:
    ended = time.time()
    first = sup.first_failure
    failure = None
    if first is not None and first.outcome is not None:
        rank, rank_code = first.root_cause()
        failure = {
            "node_rank": first.node.node_rank, "host": first.node.host, "ranks": list(first.node.ranks),
            "rank": rank, "rank_exit_code": rank_code,
            "exit_code": first.outcome.exit_code, "description": first.outcome.describe(),
            "after_s": round((first.ended or ended) - float(state["started_at"]), 3),  # type: ignore[arg-type]
            "last_lines": first.last_lines(rank),
        }
    return {
        "run_id": state["run_id"], "name": state["name"], "status": status, "exit_code": code,
        "started_at": state["started_at"], "ended_at": ended,
        "duration_s": round(ended - float(state["started_at"]), 3),  # type: ignore[arg-type]
        "nodes": [r.to_json(sup.run) for r in sup.records],
        "first_failure": failure,
    }


def _report(sup: Supervisor, summary: dict[str, object]) -> None:
    run_dir = sup.run.path
    failure = summary["first_failure"]
    if summary["status"] == "succeeded":
        sup.say(f"run {summary['run_id']} succeeded in {summary['duration_s']} s; logs in {run_dir}/")
        return
    if isinstance(failure, dict):
        who = f"global rank {failure['rank']}" if failure["rank"] is not None else \
            f"ranks {failure['ranks'][0]}-{failure['ranks'][-1]}"
        sup.say(f"run {summary['run_id']} FAILED: first failure on node {failure['node_rank']} "
                f"({failure['host']}, {who}): {failure['description']} after {failure['after_s']} s")
        sup.say("last lines of node{}:".format(failure["node_rank"]))
        for line in failure["last_lines"][-10:]:
            sup.out.write(f"    {line}\n")
        sup.say(f"full logs: {run_dir}/node{failure['node_rank']}.log; summary: {run_dir}/summary.json")
    else:
        sup.say(f"run {summary['run_id']} {summary['status']}: every node stopped; logs in {run_dir}/")


def run_plan(
    plan: Plan,
    spec: JobSpec,
    spec_path: Path,
    runs_root: Path,
    start_nodes: Callable[[Plan], list[NodeProcess]],
    mode: str,
    out: IO[str] = sys.stdout,
) -> int:
    """Launch every node of the plan and supervise them; returns the harness exit status."""
    run = create_run_dir(runs_root, plan.run_id)
    state = _record_start(run, plan, spec_path, mode)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(plan, run, grace=spec.timeouts.stop_grace, out=out)
    try:
        sup.say(f"run {plan.run_id}: {plan.nnodes} node(s) x {plan.nproc_per_node} process(es), "
                f"master {plan.master_addr}:{plan.master_port}, logs in {run.path}/")
        sup.start(start_nodes(plan))
        sup.wait(stop)
    except BaseException as exc:
        write_json_atomic(run.state_file, state | {"status": "error", "error": str(exc), "ended_at": time.time()})
        raise
    finally:
        sup.finish()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.is_set():
        status = "stopped" if (run.path / STOP_REQUEST).exists() else "interrupted"
        code = EXIT_INTERRUPTED
    elif sup.first_failure is not None:
        status, code = "failed", EXIT_FAILED
    else:
        status, code = "succeeded", EXIT_OK
    summary = _summary(sup, state, status, code)
    write_json_atomic(run.summary_file, summary)
    write_json_atomic(run.state_file, state | {"status": status, "ended_at": summary["ended_at"]})
    _report(sup, summary)
    return code
