"""Benchmark 6b: a lost controller. The controller (the `harness launch` process) is SIGKILLed mid-training; how
long until a controller watches the job again, how many steps are redone, and how the run ends, two ways side by
side, alternating, on 2 simulated nodes x 1 process:

  attach    today's answer: each node's agent holds its node (supervision.grace 300 s), the ranks train on, and
            `harness attach RUN_ID` takes every node back: from the kill to its `taken back by` line (every agent's
            spool replayed), then to the first step line it shows and to the run's end. The run's record (`harness
            logs RUN_ID --rank 0 --timestamps`) must hold every step line once, none missing and none repeated
            (steps redone 0), and the step lines stamped between the record's lost_at and attached_at are the
            steps trained while no controller watched. The run must succeed with 1 attempt (0 restarts).
  relaunch  the same fault answered as before the feature: `supervision: {grace: 0}` (every node stops as its
            controller goes), then the user launches the same job again at once (same checkpoint directory,
            `--resume`), which resumes from the newest checkpoint: from the kill to the new run's first step
            and to its end; steps redone: the last step the lost run recorded minus the global step the new run
            resumed from (negative differences are steps the ranks trained after the kill, which nobody recorded
            and the just-in-time checkpoint of their SIGTERM kept: steps_unrecorded).

With cfg["ssh"] (the full run), both again on 2 SSH hosts of a 3-host namespace cluster (testbed/cluster.py, root),
and a third fault there:

  cut       h2's traffic dropped (iptables in its namespace, both ways) for cut_s seconds at step kill_at, the
            controller alive: where h2's keepalive went unanswered (timeouts.connect), it links h2's node again
            itself (a new login and the relay) once h2 answers; else TCP alone carries the link over the cut.
            Figures: restarts (goal 0), from the cut's end to the `made again` line where there is one, the
            record's step lines missing or twice, and the run's end.

The job is bench/recovery.py's (synthetic data, the small model, a checkpoint every `ckpt_every` steps, `--resume`,
restarts max 1 with standbys from the start), `epochs` epochs long so that it trains on well past the attach. The
controller is killed once rank 0 reported step `kill_at` and the standbys have done their imports and wait
(recovery.standbys_idle, as in benchmark 6), at the same point in both cases. A relaunch starts as soon as the
killed controller is reaped: no human delay is counted in either case. Every case's processes are found by the
run id afterwards (`left`); a run that is still held is stopped (`harness stop`) whatever happens.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import procs
from bench.recovery import median, standbys_idle
from testbed.cluster import Cluster, missing_support, namespace_cluster

STEP = re.compile(r"\[rank0\]: epoch (\d+)/(\d+) step (\d+)/(\d+) ")
RESUMED = re.compile(r"\[rank0\]: resume: epoch \d+/\d+ step \d+/\d+ \(global step (\d+)\)")
FRESH = re.compile(r"\[rank0\]: resume: no checkpoint")
TAKEN_BACK = re.compile(r"^harness: run \S+: taken back by (\S+); its controller was lost ([\d.]+) s before; the "
                        r"(\d+) line\(s\) its nodes said meanwhile")
JOB = """\
name: bench-attach
nnodes: 2
nproc_per_node: 1
backend: gloo
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --subset, "16384", --model, small, --epochs, "{epochs}", --batch-size, "16",
         --log-every, "1", --global-batch, "32", --ckpt-dir, {ckpt}, --ckpt-every, "{every}", --resume,
         --device, cpu]
env: {{OMP_NUM_THREADS: "1"}}
restarts: {{max: 1, on: infra, backoff: 0, standby: 0}}
supervision: {{grace: {grace}}}
"""
CASES = {"attach": "controller SIGKILLed, nodes held (supervision.grace {grace:g} s), `harness attach RUN_ID`",
         "relaunch": "controller SIGKILLed with supervision.grace 0 (every node stops), the job launched again "
                     "(--resume)",
         "cut": "h2's traffic dropped for {cut:g} s, the controller alive: it links h2's node again itself"}
MADE_AGAIN = r"^harness: node1 on h2: its link was lost and is made again"


def _global(match: re.Match[str]) -> int:
    """The global step of a progress line: (epoch - 1) x steps per epoch + step."""
    epoch, _, step, per_epoch = (int(g) for g in match.groups())
    return (epoch - 1) * per_epoch + step


def _wall(stamp: str) -> float:
    """A record line's STAMP (`2026-11-25T17:10:59.123456Z`) as time.time()."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC).timestamp()


def _harness(*args: str, env: dict[str, str], timeout: float = 120) -> list[str]:
    return procs.run_lines([procs.PY, "-m", "harness.cli", *args], env, timeout=timeout)


def _steps(run_id: str, runs: Path, env: dict[str, str]) -> tuple[list[tuple[float, int]], int]:
    """Rank 0's step lines in the run's record, (stamp as time.time(), global step) in time order, and the job's
    steps in all."""
    found, total = [], 0
    for line in _harness("logs", run_id, "--runs-dir", str(runs), "--rank", "0", "--timestamps", env=env):
        if m := STEP.search(line):
            found.append((_wall(line.split(" ", 1)[0]), _global(m)))
            total = int(m.group(2)) * int(m.group(4))
    return found, total


def _left(run_id: str, within: float = 10.0) -> int:
    """Processes of the run still alive `within` seconds from now (0 as soon as none is)."""
    deadline = time.monotonic() + within
    while (alive := procs.with_env(f"HARNESS_RUN_ID={run_id}")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(alive)


def _gone_after(run_id: str, since: float, timeout: float = 30.0) -> float | None:
    """Seconds from since until no process of the run is left (None: some still ran after timeout)."""
    deadline = time.monotonic() + timeout
    while procs.with_env(f"HARNESS_RUN_ID={run_id}"):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return time.monotonic() - since


def _summary(runs: Path, run_id: str) -> dict[str, Any]:
    return json.loads((runs / run_id / "summary.json").read_text())


def _ended(runs: Path, run_id: str) -> bool:
    return (runs / run_id / "summary.json").exists()


@contextlib.contextmanager
def _stopped_at_the_end(runs: Path, env: dict[str, str], ids: list[str]) -> Iterator[None]:
    """Whatever happens, every run named in ids meanwhile that has not ended is stopped (its agents would hold its
    nodes for supervision.grace)."""
    try:
        yield
    finally:
        for run_id in ids:
            if not _ended(runs, run_id) and procs.with_env(f"HARNESS_RUN_ID={run_id}"):
                with contextlib.suppress(Exception):
                    _harness("stop", run_id, "--runs-dir", str(runs), env=env, timeout=60)


def _launch_and_kill(p: procs.Proc, kill_at: int) -> tuple[str, float, float]:
    """The run's id, and when (monotonic, wall) its controller was SIGKILLed: at step kill_at, once its standbys
    wait; the controller reaped."""
    _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
    run_id = header.group(1)
    p.wait_for(rf"\[rank0\]: epoch 1/\d+ step {kill_at}/", timeout=300)
    standbys_idle(run_id)
    killed, killed_wall = time.monotonic(), time.time()
    os.kill(p.proc.pid, signal.SIGKILL)
    p.wait(timeout=30)
    return run_id, killed, killed_wall


def _attach(tmp: Path, cfg: dict[str, Any], hosts: list[str]) -> dict[str, Any]:
    """Case (a): the controller killed, `harness attach` takes the held nodes back. hosts: launch's --hosts
    arguments (none: simulated nodes)."""
    job, env, runs = _setup(tmp, cfg, cfg["grace"])
    ids: list[str] = []
    launch = [procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(runs), *hosts]
    with procs.Proc(launch, env) as p, _stopped_at_the_end(runs, env, ids):  # stopped before the Proc's sweep
        run_id, killed, killed_wall = _launch_and_kill(p, cfg["kill_at"])
        ids.append(run_id)
        with procs.Proc([procs.PY, "-m", "harness.cli", "attach", run_id, "--runs-dir", str(runs)], env) as a:
            said, _ = a.wait_for(r"^harness: run \S+: taking back ", timeout=120)
            back, taken = a.wait_for(TAKEN_BACK.pattern, timeout=300)
            stepped, _ = a.wait_for(STEP.pattern, timeout=300, after=back)
            code = a.wait(timeout=900)
            ended = a.ended or time.monotonic()
        if code != 0:
            raise RuntimeError(f"`harness attach` exited {code}:\n{a.output[-3000:]}")
        left = _left(run_id)
        summary = _summary(runs, run_id)
        steps, total = _steps(run_id, runs, env)
    (attempt, *more) = summary["attempts"]
    spans = [(u["lost_at"], u["attached_at"]) for u in attempt.get("unwatched", []) if u.get("lost_at") is not None]
    numbers = [step for _, step in steps]
    before = [step for when, step in steps if when < killed_wall]
    return {"watched_again": back - killed, "attach_said": said - killed, "first_step": stepped - killed,
            "end": ended - killed, "kill_step": max(before, default=0),
            "redone": len(numbers) - len(set(numbers)),
            "missing": len(set(range(1, total + 1)) - set(numbers)),
            "missing_steps": sorted(set(range(1, total + 1)) - set(numbers))[:10],
            "repeated_steps": sorted({n for n in numbers if numbers.count(n) > 1})[:10],
            "in_order": numbers == sorted(numbers),
            "unwatched_steps": sum(1 for when, _ in steps if any(lost <= when <= at for lost, at in spans)),
            "recorded_unwatched": sum(at - lost for lost, at in spans), "unwatched_spans": len(spans),
            "said_lost": float(taken.group(2)), "lines_meanwhile": int(taken.group(3)),
            "status": summary["status"], "attempts": 1 + len(more), "goodput": summary["goodput"],
            "left": left, "total_steps": total, "run_id": run_id, "killed_at": killed_wall, "unwatched": spans}


def _relaunch(tmp: Path, cfg: dict[str, Any], hosts: list[str]) -> dict[str, Any]:
    """Case (b): grace 0, the controller killed, the job launched again at once from its newest checkpoint."""
    job, env, runs = _setup(tmp, cfg, 0)
    ids: list[str] = []
    launch = [procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(runs), *hosts]
    with procs.Proc(launch, env) as p, _stopped_at_the_end(runs, env, ids):  # stopped before the Proc's sweep
        lost_id, killed, killed_wall = _launch_and_kill(p, cfg["kill_at"])
        ids.append(lost_id)
        with procs.Proc(launch, env) as again:
            gone = _gone_after(lost_id, killed)
            said, header = again.wait_for(r"^harness: run (\S+): ", timeout=120)
            ids.append(header.group(1))
            resumed_at, resumed = again.wait_for(rf"{RESUMED.pattern}|{FRESH.pattern}", timeout=300)
            stepped, _ = again.wait_for(STEP.pattern, timeout=300, after=resumed_at)
            code = again.wait(timeout=900)
            ended = again.ended or time.monotonic()
        if code != 0:
            raise RuntimeError(f"the relaunch exited {code}:\n{again.output[-3000:]}")
        left = _left(lost_id) + _left(header.group(1))
        summary = _summary(runs, header.group(1))
        lost_steps, total = _steps(lost_id, runs, env)
        new_steps, _ = _steps(header.group(1), runs, env)
    reached = max((step for _, step in lost_steps), default=0)
    start = int(resumed.group(1)) if resumed.group(1) else 0
    numbers = [step for _, step in new_steps]
    return {"watched_again": stepped - killed, "attach_said": said - killed, "first_step": stepped - killed,
            "end": ended - killed, "kill_step": max((s for w, s in lost_steps if w < killed_wall), default=0),
            "reached": reached, "resumed": start, "redone": max(0, reached - start),
            "unrecorded": max(0, start - reached), "nodes_gone": gone,
            "missing": len(set(range(start + 1, total + 1)) - set(numbers)),
            "status": summary["status"], "attempts": len(summary["attempts"]), "goodput": summary["goodput"],
            "left": left, "total_steps": total}


def _cut(tmp: Path, cfg: dict[str, Any], cluster: Cluster, hosts: list[str]) -> dict[str, Any]:
    """Case (c), SSH only: h2 cut off for cut_s seconds, the controller alive."""
    job, env, runs = _setup(tmp, cfg, cfg["grace"])
    ids: list[str] = []
    launch = [procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(runs), *hosts]
    with procs.Proc(launch, env) as p, _stopped_at_the_end(runs, env, ids):
        _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
        run_id = header.group(1)
        ids.append(run_id)
        p.wait_for(rf"\[rank0\]: epoch 1/\d+ step {cfg['kill_at']}/", timeout=300)
        with cluster.firewall("h2", "-j", "DROP"), cluster.firewall("h2", "-j", "DROP", chain="OUTPUT"):
            time.sleep(cfg["cut_s"])  # the fault itself
        healed = time.monotonic()
        code = p.wait(timeout=900)
        ended = p.ended or time.monotonic()
        left = _left(run_id)
    if code != 0:
        raise RuntimeError(f"the cut run exited {code}:\n{p.output[-3000:]}")
    back = next((at for at, line in p.lines if re.search(MADE_AGAIN, line)), None)
    summary = _summary(runs, run_id)
    steps, total = _steps(run_id, runs, env)
    numbers = [step for _, step in steps]
    return {"made_again": back - healed if back is not None else None, "end": ended - healed,
            "restarts": len(summary["attempts"]) - 1,
            "redone": len(numbers) - len(set(numbers)), "missing": len(set(range(1, total + 1)) - set(numbers)),
            "status": summary["status"], "left": left, "total_steps": total}


def _setup(tmp: Path, cfg: dict[str, Any], grace: float) -> tuple[Path, dict[str, str], Path]:
    """The job file (a fresh checkpoint directory), its environment (a state directory of its own) and runs dir."""
    stamp = time.monotonic_ns()
    ckpt = tmp / f"ckpt-{stamp}"
    job = tmp / f"attach-{stamp}.yaml"
    job.write_text(JOB.format(epochs=cfg["epochs"], ckpt=ckpt, every=cfg["ckpt_every"], grace=grace))
    env = procs.clean_env(XDG_STATE_HOME=str(tmp / f"state-{stamp}"))
    return job, env, tmp / "runs"


def _row(case: str, runs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """The medians of a case's repeats, and every repeat's own figures where they are counts."""
    row: dict[str, Any] = {
        "case": case, "failure": CASES[case].format(grace=cfg["grace"]),
        "watched_again_s": median([r["watched_again"] for r in runs]),
        "attempts_watched_again_s": [round(r["watched_again"], 2) for r in runs],
        "new_controller_first_line_s": median([r["attach_said"] for r in runs]),
        "first_step_s": median([r["first_step"] for r in runs]),
        "end_s": median([r["end"] for r in runs]),
        "kill_steps": [r["kill_step"] for r in runs], "steps_redone": [r["redone"] for r in runs],
        "steps_missing": [r["missing"] for r in runs], "total_steps": runs[0]["total_steps"],
        "ckpt_every": cfg["ckpt_every"], "statuses": sorted({r["status"] for r in runs}),
        "attempts": [r["attempts"] for r in runs], "left": [r["left"] for r in runs],
        "goodput": median([r["goodput"]["goodput"] for r in runs]),
        **{f"time_{bucket}_s": median([r["goodput"]["seconds"][bucket] for r in runs])
           for bucket in runs[0]["goodput"]["seconds"]},
    }
    if case == "attach":
        row |= {"steps_unwatched": [r["unwatched_steps"] for r in runs],
                "missing_steps": [r["missing_steps"] for r in runs],
                "repeated_steps": [r["repeated_steps"] for r in runs],
                "in_order": all(r["in_order"] for r in runs),
                "recorded_unwatched_s": median([r["recorded_unwatched"] for r in runs]),
                "said_lost_s": median([r["said_lost"] for r in runs]),
                "lines_meanwhile": [r["lines_meanwhile"] for r in runs],
                "unwatched_spans": [r["unwatched_spans"] for r in runs]}
    else:
        row |= {"reached": [r["reached"] for r in runs], "resumed": [r["resumed"] for r in runs],
                "steps_unrecorded": [r["unrecorded"] for r in runs],
                "nodes_gone_s": median([r["nodes_gone"] for r in runs if r["nodes_gone"] is not None])
                if any(r["nodes_gone"] is not None for r in runs) else None}
    return row


def _alternating(tmp: Path, cfg: dict[str, Any], hosts: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Both answers, cfg["repeats"] of each, the order swapped each round."""
    done: dict[str, list[dict[str, Any]]] = {"attach": [], "relaunch": []}
    ways = {"attach": _attach, "relaunch": _relaunch}
    for i in range(cfg["repeats"]):
        for case in (("attach", "relaunch") if i % 2 == 0 else ("relaunch", "attach")):
            done[case].append(ways[case](tmp, cfg, hosts))
    return done


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-attach-") as tmp:
        done = _alternating(Path(tmp), cfg, [])
        ssh: dict[str, list[dict[str, Any]]] = {}
        if cfg.get("ssh") and (why := missing_support()) is None:
            with namespace_cluster(3, workdir=procs.REPO) as cluster:  # h3: the spare a relaunch does not need
                inventory = cluster.write_inventory(Path(tmp) / "hosts.yaml")
                hosts = ["--hosts", str(inventory), "--known-hosts", str(cluster.known_hosts)]
                ssh = _alternating(Path(tmp), cfg, hosts)
                ssh["cut"] = [_cut(Path(tmp), cfg, cluster, hosts) for _ in range(cfg["repeats"])]
        elif cfg.get("ssh"):
            notes.append(f"no SSH rows: {why}")
    return {"job": f"payload: synthetic data, small model, {cfg['epochs']} epoch(s) of 512 steps, batch 16 x 2 nodes, "
                   f"1 rank per node, gloo on CPU; a checkpoint every {cfg['ckpt_every']} steps, --resume; restarts "
                   f"max 1, backoff 0, standbys from the start",
            "kill_at_step": cfg["kill_at"], "grace_s": cfg["grace"], "repeats": cfg["repeats"], "statistic": "median",
            "rows": [_row(case, runs, cfg) for case, runs in done.items()],
            "ssh_rows": [_row(case, runs, cfg) for case, runs in ssh.items() if case != "cut"],
            "cut": _cut_row(ssh["cut"], cfg) if "cut" in ssh else None, "notes": notes}


def _cut_row(runs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"case": "cut", "failure": CASES["cut"].format(cut=cfg["cut_s"]),
            "attempts_made_again_s": [round(r["made_again"], 2) if r["made_again"] is not None else None
                                      for r in runs],
            "end_s": median([r["end"] for r in runs]), "restarts": [r["restarts"] for r in runs],
            "steps_redone": [r["redone"] for r in runs], "steps_missing": [r["missing"] for r in runs],
            "statuses": sorted({r["status"] for r in runs}), "left": [r["left"] for r in runs],
            "total_steps": runs[0]["total_steps"]}
