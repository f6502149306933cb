"""Benchmarks 9 and 10: the health watch (harness/health/judge.py). How fast a hung job is found and
whether the right rank is named, against torchrun alone; and what the watch costs a job that is well.

9. bench/hang_fault.py on 2 simulated nodes x 1 process (gloo), `health: {stall: S}`, one fault per
   launch, on a rank drawn at random (as many faults on rank 0 as on rank 1, in shuffled order), at a
   random step; the fault kinds interleaved, so that a burst of load hits one attempt, not one kind:
     stop   the bench SIGSTOPs the rank's worker (found by HARNESS_RUN_ID and RANK in /proc/PID/environ)
            when rank 0 has printed that step;
     sleep  the rank is stuck in time.sleep inside its step;
     skip   the rank skips an all_reduce and ends its loop (its peers wait in that all_reduce forever).
   Detection: the fault (the time the rank wrote, or the SIGSTOP) to the arrival of the launch's
   `harness: hang: ...` line; also less S (what the watch adds to its own threshold). Culprit:
   summary.json's first failure (kind hang, evidence the verdict) names the injected rank as its
   `rank` (the first odd rank of the verdict); a skipped all_reduce is a collective mismatch at one
   sequence number, whose verdict names both sides and neither as the culprit: right when it does.
   Stacks: rank<R>.txt files kept in runs/<id>/stacks/attempt-0/. Left: processes of the run alive
   after the launch exited.
   torchrun alone: the same faults under two torchrun agents by hand with init_process_group's
   timeout set to T (its default: 30 min for gloo, 10 min for NCCL, which no benchmark waits out):
   when the first line of an error shows, whether any line names the injected rank, and what is left
   running a bounded wait later.
10. The payload (synthetic data, small model) under `harness launch`, health on (the default: stall
   300 s, slow 20%, agents sample every 5 s, Flight Recorder on and read with each sample), health on
   without Flight Recorder (`env: {TORCH_FR_BUFFER_SIZE: '0'}`: the hook still serves, the reads find
   nothing) and off (`health: {stall: 0, slow: 0}`), interleaved: rank 0's img/s over the steps after
   warm-up, and the time from the command's start to rank 0's first step.
12. Serving the run's metrics to Prometheus (health.metrics_port): the controller's CPU per scrape and per
   rank at a scrape every 5 s, beside the controller's own CPU rate (metrics_cost).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import procs
from bench.launch import died_at, torchrun_by_hand
from harness.node.collectives import read_trace
from harness.node.proctable import process_tree, run_processes
from harness.node.ranks import children_of, find_ranks, sample
from harness.spec.job import Health

SCRIPT = "bench/hang_fault.py"
KINDS = {"stop": "rank SIGSTOPped", "sleep": "rank stuck in time.sleep in its step",
         "skip": "rank skips an all_reduce and ends its loop"}
JOB = """\
name: {name}
nnodes: 2
nproc_per_node: 1
backend: gloo
master_port: {port}
entrypoint:
  {entry}
{health}env: {env}
timeouts: {{stop_grace: 3}}
"""
VERDICT = r"^harness: hang: (.*)"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# What torchrun's output shows first when a rank's collective times out (the exception, the agent's report).
TORCHRUN_ERROR = re.compile(r"(?i)timed out|timeout|ChildFailedError|Root Cause|exitcode")
RANK_NAMED = re.compile(r"(?i)\brank\b\s*[:=#]?\s*(\d+)")


def _flow(values: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}: "{v}"' for k, v in values.items()) + "}"


def write_job(path: Path, entry: str, env: dict[str, str], health: str | None) -> Path:
    path.write_text(JOB.format(name=f"bench-{path.stem}", port=procs.free_port(), entry=entry,
                               health=f"health: {health}\n" if health is not None else "", env=_flow(env)))
    return path


def worker_pid(pids: list[int], rank: int) -> int:
    """The training process of a global rank among pids: RANK=rank in its environment, not in its parent's
    (torchrun sets RANK only in its workers; a child of the worker would inherit it)."""
    def rank_of(pid: int) -> bytes | None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((item.split(b"=", 1)[1] for item in env if item.startswith(b"RANK=")), None)

    wanted = str(rank).encode()
    for pid in pids:
        if rank_of(pid) == wanted:
            with contextlib.suppress(OSError, IndexError):
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if rank_of(parent) != wanted:
                    return pid
    raise RuntimeError(f"no worker with RANK={rank} among {pids}")


def _fault_env(kind: str, rank: int, step: int, fault_file: Path) -> dict[str, str]:
    return ONE_THREAD | {"FAULT": "" if kind == "stop" else kind, "FAULT_RANK": str(rank), "FAULT_STEP": str(step),
                         "FAULT_FILE": str(fault_file)}


def _inject(kind: str, rank: int, step: int, fault_file: Path, watched: procs.Proc, pids: Any,
            first_step: str) -> float:
    """Wait for the fault, or cause it (stop); when it happened, on this process's monotonic clock."""
    if kind != "stop":
        return died_at(fault_file, watched, timeout=180)
    watched.wait_for(first_step.format(step=step), timeout=180)
    os.kill(worker_pid(pids(), rank), signal.SIGSTOP)
    return time.monotonic()


def harness_fault(tmp: Path, kind: str, rank: int, step: int, stall: float, index: int) -> dict[str, Any]:
    fault_file = tmp / f"fault-{kind}-{index}"
    job = write_job(tmp / f"hang-{kind}.yaml", f"script: {SCRIPT}", _fault_env(kind, rank, step, fault_file),
                    f"{{stall: {stall:g}}}")
    runs = tmp / "runs"
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(runs)]) as p:
        _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
        run_id = header.group(1)
        fault_at = _inject(kind, rank, step, fault_file, p, lambda: run_processes(run_id), r"\[rank0\]: step {step}$")
        try:
            seen, verdict = p.wait_for(VERDICT, timeout=stall + 120, after=fault_at)
        except RuntimeError as exc:
            code = p.wait(timeout=60) if p.proc.poll() is not None else None
            return {"kind": kind, "injected_rank": rank, "step": step, "run_id": run_id, "found": False,
                    "exit_code": code, "error": str(exc).splitlines()[0], "output": p.output[-6000:]}
        judged = next((when for when, line in p.lines if when > fault_at and line.startswith("harness: no progress")),
                      None)
        code = p.wait(timeout=120)
        assert p.ended is not None
        left = sorted(set(run_processes(run_id)) | (set(procs.tagged(p.tag)) - {p.proc.pid}))
    summary = json.loads((runs / run_id / "summary.json").read_text())
    failure = summary.get("first_failure") or {}
    kept = sorted(f.name for f in (runs / run_id / "stacks" / "attempt-0").glob("rank*.txt"))
    named = failure.get("rank")
    row = {"kind": kind, "injected_rank": rank, "step": step, "run_id": run_id, "found": True,
           "detected_s": round(seen - fault_at, 2), "beyond_stall_s": round(seen - fault_at - stall, 2),
           "judged_s": None if judged is None else round(judged - fault_at, 2),
           "exit_s": round(p.ended - fault_at, 2), "exit_code": code, "named_rank": named,
           "right": named == rank or (kind == "skip" and _both_sides(verdict.group(1))),
           "failure_kind": failure.get("kind"),
           "evidence_is_verdict": failure.get("evidence") == verdict.group(1).split(" (stacks in ")[0],
           "stacks_kept": kept, "left": len(left), "verdict": verdict.group(1).split(" (stacks in ")[0]}
    if not row["right"]:
        row["output"] = "\n".join(line for _, line in p.lines if not re.search(r"\]: step \d+$", line))[-6000:]
    return row


def _both_sides(verdict: str) -> bool:
    """A skipped all_reduce is a collective mismatch (rank R in barrier, its peer in all_reduce, at the same
    sequence number): the verdict names both sides and neither as the culprit, as it should (Flight
    Recorder cannot tell a skipped call from the program's other mismatches)."""
    return re.search(r"collective mismatch at #\d+: rank 0 in (all_reduce|barrier) .*, rank 1 in (all_reduce|barrier) ",
                     verdict) is not None


def torchrun_fault(tmp: Path, kind: str, rank: int, step: int, pg_timeout: float, wait: float,
                   index: int) -> dict[str, Any]:
    """The same fault under plain torchrun, 2 agents by hand, with init_process_group's timeout set."""
    fault_file = tmp / f"torchrun-fault-{kind}-{index}"
    env = _fault_env(kind, rank, step, fault_file) | {"PG_TIMEOUT": f"{pg_timeout:g}"}
    agents = torchrun_by_hand([SCRIPT], env)
    tag = agents[0].tag
    try:
        fault_at = _inject(kind, rank, step, fault_file, agents[0], lambda: procs.tagged(tag), r"^step {step}$")
        deadline = fault_at + pg_timeout + wait
        first_error = first_exit = None
        while time.monotonic() < deadline:
            lines = [(when, line) for a in agents for when, line in a.lines if when > fault_at]
            errors = sorted(when for when, line in lines if TORCHRUN_ERROR.search(line))
            first_error = errors[0] if errors else None
            ended = [a.ended for a in agents if a.ended is not None]
            first_exit = min(ended) if ended else None
            if len(ended) == len(agents):
                break
            time.sleep(0.1)
        left = len(procs.tagged(tag))
        after = [line for a in agents for when, line in a.lines if when > fault_at]
    finally:
        for agent in agents:
            agent.kill()
    named = sorted({int(m.group(1)) for line in after for m in RANK_NAMED.finditer(line)
                    if "skipped the all_reduce" not in line})
    return {"kind": kind, "injected_rank": rank, "step": step, "pg_timeout_s": pg_timeout,
            "error_shown_s": None if first_error is None else round(first_error - fault_at, 2),
            "first_agent_exit_s": None if first_exit is None else round(first_exit - fault_at, 2),
            "ranks_named": named, "culprit_named": named == [rank], "left_after_s": round(pg_timeout + wait, 1),
            "left": left, "error_lines": [line for line in after if TORCHRUN_ERROR.search(line)][:6]}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None, "min": None}
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2),
            "min": round(min(values), 2)}


def _kind_row(kind: str, runs: list[dict[str, Any]], stall: float) -> dict[str, Any]:
    found = [r for r in runs if r["found"]]
    right = [r for r in found if r["right"]]
    return {"kind": kind, "fault": KINDS[kind], "faults": len(runs), "found": len(found),
            "right": len(right), "accuracy": round(len(right) / len(runs), 3) if runs else None,
            "per_rank": {str(k): sum(r["injected_rank"] == k for r in runs) for k in (0, 1)},
            "detected_s": _stats([r["detected_s"] for r in found]),
            "beyond_stall_s": _stats([r["detected_s"] - stall for r in found]),
            "exit_s": _stats([r["exit_s"] for r in found]),
            "all_stacks_kept": sum(r["stacks_kept"] == ["rank0.txt", "rank1.txt"] for r in found),
            "left": max((r["left"] for r in found), default=0),
            "named": {str(k): sum(r["named_rank"] == k for r in found) for k in (0, 1, None)},
            "example_verdict": found[-1]["verdict"] if found else None}


def hangs(cfg: dict[str, Any]) -> dict[str, Any]:
    tree_at_start = _harness_tree()
    rng = random.Random(cfg["seed"])
    stall, count = cfg["stall"], cfg["faults"]
    plan: dict[str, list[tuple[int, int]]] = {}
    for kind in KINDS:
        ranks = [i % 2 for i in range(count)]
        rng.shuffle(ranks)
        plan[kind] = [(rank, rng.randint(*cfg["steps"])) for rank in ranks]
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    baseline: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
        for i in range(count):
            for kind in KINDS:  # interleaved kinds
                rank, step = plan[kind][i]
                row = harness_fault(Path(tmp), kind, rank, step, stall, i)
                runs[kind].append(row)
                print(f"bench: hangs: {kind} #{i + 1} rank {rank}: "
                      + (f"found in {row['detected_s']} s, named {row['named_rank']}" if row["found"]
                         else f"NOT FOUND ({row['error']})"), flush=True)
        for i in range(cfg["torchrun_repeats"]):
            for kind in KINDS:
                rank, step = rng.randrange(2), rng.randint(*cfg["steps"])
                row = torchrun_fault(Path(tmp), kind, rank, step, cfg["torchrun_timeout"], cfg["torchrun_wait"], i)
                baseline.append(row)
                print(f"bench: hangs: torchrun {kind} rank {rank}: error after {row['error_shown_s']} s, "
                      f"names ranks {row['ranks_named']}", flush=True)
    rows = [_kind_row(kind, runs[kind], stall) for kind in KINDS]
    misses = [r for kind in KINDS for r in runs[kind] if not r["found"] or not r["right"]]
    torchrun_rows = []
    for kind in KINDS:
        mine = [r for r in baseline if r["kind"] == kind]
        if mine:
            torchrun_rows.append({
                "kind": kind, "runs": len(mine), "pg_timeout_s": cfg["torchrun_timeout"],
                "error_shown_s": _stats([r["error_shown_s"] for r in mine if r["error_shown_s"] is not None]),
                "culprit_named": sum(r["culprit_named"] for r in mine),
                "ranks_named": [r["ranks_named"] for r in mine], "injected": [r["injected_rank"] for r in mine],
                "first_agent_exit_s": [r["first_agent_exit_s"] for r in mine],
                "left": [r["left"] for r in mine], "left_after_s": mine[0]["left_after_s"],
                "error_lines": mine[0]["error_lines"]})
    return {"script": f"{SCRIPT}: 2 nodes x 1 process, gloo on CPU, each step ~0.02 s of compute, an all_reduce "
                      "and a 0.03 s sleep",
            "stall_s": stall, "faults_per_kind": count, "seed": cfg["seed"], "fault_steps": cfg["steps"],
            "bound_s": stall + 15, "statistic": "median / max", "rows": rows, "misses": misses,
            "torchrun": torchrun_rows, "torchrun_defaults_s": {"gloo": 1800, "nccl": 600},
            "harness_tree_at_start": tree_at_start, "harness_tree": _harness_tree(), "notes": [],
            "attempts": {k: [_brief(r) for r in v] for k, v in runs.items()},
            "torchrun_attempts": baseline}


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "output"}


def _harness_tree() -> list[str]:
    """The commit, and the files of harness/ that differ from it: the figures come from this tree. Taken at
    the start and the end, so that a tree edited during the run shows (each launch runs the tree of its time)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(procs.REPO), *args], capture_output=True, text=True,
                              check=False).stdout

    changed = [line[3:] for line in git("status", "--porcelain", "--", "harness").splitlines()]
    return [f"commit {git('rev-parse', '--short=12', 'HEAD').strip()}", *changed]


# --- 10: the watch's cost -------------------------------------------------------------------------

FIRST = re.compile(r"\[rank0\]: epoch 1/1 step 1/")
STEP_RATE = re.compile(r"\[rank0\]: epoch 1/1 step (\d+)/\d+ .*img/s (\d+)")
WATCH = {"on": None, "no-fr": None, "off": "{stall: 0, slow: 0}"}  # None: the spec says nothing, the defaults hold
ARM_ENV = {"no-fr": {"TORCH_FR_BUFFER_SIZE": "0"}}


def sampling_cost(root: int, run_id: str, repeats: int = 50) -> float:
    """CPU seconds one health sample costs a node agent: what RankObserver.sample_every does each time (the process
    tree, its ranks, their /proc figures), here over the whole job's tree (both nodes: an upper bound)."""
    began = time.thread_time()
    for _ in range(repeats):
        below, _ = process_tree(root)
        if not sample(find_ranks(below, run_id), children_of(below)):
            raise RuntimeError(f"no ranks of {run_id} below pid {root}")
    return (time.thread_time() - began) / repeats


def flight_recorder_cost(root: int, run_id: str, repeats: int = 50) -> dict[str, float]:
    """CPU seconds one read of a rank's Flight Recorder costs, as the agent reads it with each health sample:
    in the rank (torch's worker server builds the JSON) and in the agent (the request and its parsing),
    and how many entries it held."""
    below, _ = process_tree(root)
    rank, pid = min(find_ranks(below, run_id).items())
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    directory = next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(b"HARNESS_AGENT_DIR="))

    entries = read_trace(directory, rank)
    if isinstance(entries, str):
        raise RuntimeError(f"rank {rank}'s Flight Recorder: {entries}")
    before, began = procs.process_cpu_s(pid), time.thread_time()
    for _ in range(repeats):
        read_trace(directory, rank)
    agent = (time.thread_time() - began) / repeats
    return {"rank_cpu_s": (procs.process_cpu_s(pid) - before) / repeats, "agent_cpu_s": agent, "entries": len(entries)}


def payload_run(tmp: Path, arm: str, cfg: dict[str, Any], measure: bool = False) -> dict[str, Any]:
    steps, batch = cfg["steps"], cfg["batch_size"]
    args = ["--data", "synthetic", "--subset", str(2 * batch * steps), "--model", cfg["model"], "--epochs", "1",
            "--max-steps", str(steps), "--batch-size", str(batch), "--log-every", "1", "--device", "cpu"]
    load = os.getloadavg()[0]
    job = write_job(tmp / f"watch-{arm}.yaml", "module: harness.payload.train\n  args: " + json.dumps(args),
                    ARM_ENV.get(arm, {}), WATCH[arm])
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(tmp / "runs")]) as p:
        if measure:  # an extra run, not timed: the bench's own CPU would slow the payload
            _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
            p.wait_for(r"\[rank0\]: epoch 1/1 step 60/", timeout=300)  # the recorder's buffer full
            return {"sample_cpu_s": sampling_cost(p.proc.pid, header.group(1)),
                    "flight_recorder": flight_recorder_cost(p.proc.pid, header.group(1))}
        code = p.wait(timeout=600)
        if code != 0:
            raise RuntimeError(f"the payload with the watch {arm} exited {code}:\n{p.output[-3000:]}")
        first = next(when for when, line in p.lines if FIRST.search(line))
        timed = [(int(m.group(1)), float(m.group(2))) for _, line in p.lines if (m := STEP_RATE.search(line))]
    steady = [rate for step, rate in timed if step > cfg["warmup"]]
    return {"arm": arm, "load_at_start": round(load, 2), "first_step_s": round(first - p.started, 2),
            "images_per_s": round(len(steady) / sum(1 / r for r in steady), 1), "steps_timed": len(steady)}


def watch_cost(cfg: dict[str, Any]) -> dict[str, Any]:
    attempts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        for i in range(cfg["repeats"]):  # interleaved, and the order alternated: on, no-fr, off, off, no-fr, on, ...
            for arm in ("on", "no-fr", "off") if i % 2 == 0 else ("off", "no-fr", "on"):
                attempts.append(payload_run(Path(tmp), arm, cfg))
                print(f"bench: watch_cost: {arm}: {attempts[-1]}", flush=True)
        measured = payload_run(Path(tmp), "on", cfg, measure=True)
    cost, recorder = measured["sample_cpu_s"], measured["flight_recorder"]
    interval = Health().sample_seconds
    rounds = [{a["arm"]: a for a in attempts[3 * i:3 * i + 3]} for i in range(cfg["repeats"])]
    pairs = [(r["on"], r["off"]) for r in rounds]
    rate_ratios = [on["images_per_s"] / off["images_per_s"] for on, off in pairs]
    fr_ratios = [r["on"]["images_per_s"] / r["no-fr"]["images_per_s"] for r in rounds]
    step_ratios = [on["first_step_s"] / off["first_step_s"] for on, off in pairs]
    rows = []
    for arm in WATCH:
        mine = [a for a in attempts if a["arm"] == arm]
        rows.append({"arm": arm, "health": WATCH[arm] or "(default) {stall: 300, slow: 20}",
                     "env": ARM_ENV.get(arm, {}),
                     "images_per_s": round(statistics.median(a["images_per_s"] for a in mine), 1),
                     "first_step_s": round(statistics.median(a["first_step_s"] for a in mine), 2),
                     "attempts_images_per_s": [a["images_per_s"] for a in mine],
                     "attempts_first_step_s": [a["first_step_s"] for a in mine]})
    return {"job": f"payload: synthetic data, {cfg['model']} model, batch {cfg['batch_size']} x 2 nodes x 1 process, "
                   f"gloo on CPU, {cfg['steps']} steps, img/s over the steps after {cfg['warmup']}",
            "repeats": cfg["repeats"], "statistic": "median of the pairs' ratios", "rows": rows,
            "images_per_s_ratio": round(statistics.median(rate_ratios), 4),
            "pair_images_per_s_ratios": [round(r, 4) for r in rate_ratios],
            "flight_recorder_images_per_s_ratio": round(statistics.median(fr_ratios), 4),
            "pair_flight_recorder_ratios": [round(r, 4) for r in fr_ratios],
            "first_step_ratio": round(statistics.median(step_ratios), 3),
            "pair_first_step_ratios": [round(r, 3) for r in step_ratios], "goal_ratio": 0.99,
            "sample_cpu_ms": round(1000 * cost, 2), "sample_every_s": interval,
            "sampling_cpu_share": round(cost / interval, 5),
            "flight_recorder_read": {"entries": recorder["entries"],
                                     "rank_cpu_ms": round(1000 * recorder["rank_cpu_s"], 2),
                                     "agent_cpu_ms": round(1000 * recorder["agent_cpu_s"], 2),
                                     "rank_cpu_share": round(recorder["rank_cpu_s"] / interval, 5)}}


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return len(answer.read())


def _synthetic_scrape(ranks: int, repeats: int) -> dict[str, float]:
    """CPU seconds one scrape of a run of `ranks` ranks costs the serving process (what RunMetrics reads and
    prometheus-client writes), on a record made here: without a job, any size."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from harness.record.index import create_run_dir
    from harness.record.schema import ControllerId, LiveHealth, Progress, RankRow, RunState, RunStatus
    from harness.view.metrics import RunMetrics

    with tempfile.TemporaryDirectory(prefix="bench-metrics-record-") as tmp:
        run = create_run_dir(Path(tmp), "bench-20261126-000000-000000")
        now, per_node = time.time(), 8
        run.write_state(RunState(run_id=run.run_id, name="bench", mode="ssh", status=RunStatus.RUNNING,
                                 started_at=now - 600, nnodes=ranks // per_node, world_size=ranks,
                                 controller=ControllerId(os.getpid(), None),
                                 hosts=[f"h{n}" for n in range(ranks // per_node)]))
        rows = {rank: RankRow(node=f"node{rank // per_node}", host=f"h{rank // per_node}", state="computing", cpu=0.98,
                              busy=0.9, last_line=f"[rank{rank}]: epoch 1/3 step 512/1000 loss 1.2345",
                              last_line_at=now - 1, step=512, step_rate=8.5, gpu_util=97.0, gpu_memory=40 << 30,
                              idle=0.0, step_at=now - 1) for rank in range(ranks)}
        run.write_health(LiveHealth(attempt=0, t=now, ranks=rows, started_at=now - 590,
                                    progress=Progress(1, now - 580, 512, now - 1, now - 580, 3000, 8.5)))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunMetrics(run))
        size = len(generate_latest(registry))
        began = time.thread_time()
        for _ in range(repeats):
            generate_latest(registry)
        return {"ranks": ranks, "cpu_ms": round(1000 * (time.thread_time() - began) / repeats, 2), "bytes": size}


def metrics_cost(cfg: dict[str, Any]) -> dict[str, Any]:
    """12. What serving the metrics costs the controller: the payload (2 nodes x 1 process) launched with
    health.metrics_port; the controller's own CPU rate over a quiet window (what the watch, the stream and the
    record cost it: bench 10 measures the agents' side), then `scrapes` scrapes back to back, whose CPU less
    that rate is the cost of one; and one scrape of records of 8 to 256 ranks, timed in process."""
    steps, batch = cfg["steps"], cfg["batch_size"]
    args = ["--data", "synthetic", "--subset", str(2 * batch * steps), "--model", cfg["model"], "--epochs", "1",
            "--max-steps", str(steps), "--batch-size", str(batch), "--log-every", "1", "--device", "cpu"]
    port = procs.free_port()
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        job = write_job(Path(tmp) / "metrics.yaml", "module: harness.payload.train\n  args: " + json.dumps(args),
                        ONE_THREAD, f"{{metrics_port: {port}}}")
        launch = [procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(Path(tmp) / "runs")]
        with procs.Proc(launch) as p:
            p.wait_for(r"\[rank0\]: epoch 1/1 step 50/", timeout=300)
            controller = p.proc.pid
            began, cpu = time.monotonic(), procs.process_cpu_s(controller)
            time.sleep(cfg["window"])
            quiet_rate = (procs.process_cpu_s(controller) - cpu) / (time.monotonic() - began)
            began, cpu = time.monotonic(), procs.process_cpu_s(controller)
            size = sum(_scrape(port) for _ in range(cfg["scrapes"])) // cfg["scrapes"]
            elapsed = time.monotonic() - began
            per_scrape = max(0.0, (procs.process_cpu_s(controller) - cpu) - quiet_rate * elapsed) / cfg["scrapes"]
            code = p.wait(timeout=600)
            if code != 0:
                raise RuntimeError(f"the payload with metrics served exited {code}:\n{p.output[-3000:]}")
    ranks, every = 2, cfg["every"]
    synthetic = [_synthetic_scrape(n, cfg["synthetic_repeats"]) for n in (8, 64, 256)]
    for row in synthetic:
        row["cpu_share_per_rank"] = round(row["cpu_ms"] / 1000 / every / row["ranks"], 7)
    return {"job": f"payload: synthetic data, {cfg['model']} model, batch {batch} x 2 nodes x 1 process, gloo on CPU, "
                   f"--log-every 1, health.metrics_port set",
            "scrape_every_s": every, "window_s": cfg["window"], "scrapes": cfg["scrapes"],
            "controller_cpu_share": round(quiet_rate, 5), "controller_cpu_share_per_rank": round(quiet_rate / ranks, 5),
            "scrape_cpu_ms": round(1000 * per_scrape, 2), "scrape_bytes": size,
            "scrape_cpu_share_per_rank": round(per_scrape / every / ranks, 7), "synthetic": synthetic}
