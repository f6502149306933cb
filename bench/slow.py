"""Benchmark 15: a slow node, found, weighed against a restart and taken out (docs/health.md, "A slow node").

A 3-node job (the payload on synthetic data, 1 rank per node, gloo on CPU) trains healthy; once its standbys wait
(bench/recovery.standbys_idle: as in a run of any length) and it has trained `healthy_s` more (the minute the harness
measures its pace before a slowness over), node1's ranks are put in a CPU cgroup with a quota of a quarter of one CPU
(testbed/throttle.py) and kept there to their end. Two targets: 3 simulated
nodes with `restarts.min_nnodes: 2` (no spare: the action is the next attempt on 2 nodes, the same global batch)
and 4 sshd hosts in network namespaces (testbed/cluster.py, root) for nnodes 3 (h4 the spare). On each, the job
with `slow` in `restarts.on` and the same job without it (left slow to its end), side by side in one run.

From the arrival times of the lines the harness and rank 0 print (bench/procs.Proc):
  healthy      the job's step rate over the `healthy_s` s before the throttle
  slowed       from the throttle to the action (left slow: to the job's end)
  after        from the next attempt's first step to the job's end
  named        throttle -> `harness: slow: rank 1 ...` (the judge names it)
  action       throttle -> the weighing's `... stopping the job to restart without ...` line
  first step   throttle -> rank 0's first step line of the next attempt
  back         throttle -> the first step line from which the job's rate over the next `window` s is at least
               BACK_SHARE of the healthy one (the goal: within health.slow_for + GOAL_MARGIN s, 0 steps redone)
and from the run's record (summary.json): the attempts, world sizes, the restart's phases and steps_redone
(attempts[1].restart), the goodput buckets (`slowed` among them), and from attempt 0's weighing event (its health)
the onset the judge dated the slowness from, against the throttle's own time.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.recovery import standbys_idle
from testbed.cluster import missing_support, namespace_cluster
from testbed.ranks import rank_pids
from testbed.throttle import throttled

STEP = re.compile(r"\[rank0\]: epoch (\d+)/\d+ step (\d+)/(\d+) ")
BACK_SHARE = 0.9  # of the healthy step rate: the job is back once it trains at least this fast again
GOAL_MARGIN = 15.0  # seconds after health.slow_for by which it must be back (issue 68)
SHARE = 0.25  # of one CPU, for the slow node's ranks
JOB = """\
name: bench-slow
nnodes: 3
nproc_per_node: 1
backend: gloo
master_port: {port}
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --subset, "{subset}", --model, small, --epochs, "{epochs}", --batch-size, "{batch}",
         --global-batch, "{global_batch}", --log-every, "1", --ckpt-dir, {ckpt}, --ckpt-every, "{every}", --resume,
         --device, cpu]
env: {{OMP_NUM_THREADS: "1"}}
restarts: {{max: 1, on: [{on}], backoff: 0{fewest}}}
health: {{slow_for: {slow_for}}}
"""
NAMED = r"^harness: slow: rank 1 \([^)]*\): its peers wait"
WEIGHED = r"^harness: slow: rank 1 \(.*\) for \d+ s: "
ACTED = WEIGHED + r".*stopping the job to restart without"


def pace(points: list[tuple[float, int]], since: float, until: float) -> float | None:
    """Steps per second between the step lines that arrived from since to until (None: fewer than 3)."""
    inside = [p for p in points if since <= p[0] <= until]
    if len(inside) < 3 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def back_at(points: list[tuple[float, int]], since: float, healthy: float, window: float) -> float | None:
    """The first step line after since from which the job's rate over the next window seconds is at least BACK_SHARE
    of healthy (None: never, within the run)."""
    end = points[-1][0] if points else since
    for at, _ in points:
        if at >= since and at + window <= end and (rate := pace(points, at, at + window)) is not None \
                and rate >= BACK_SHARE * healthy:
            return at
    return None


def _steps(lines: list[tuple[float, str]]) -> list[tuple[float, int]]:
    """(arrival, global step) of rank 0's step lines: epochs of equal length."""
    points = []
    for when, line in lines:
        if m := STEP.search(line):
            epoch, step, per_epoch = (int(g) for g in m.groups())
            points.append((when, (epoch - 1) * per_epoch + step))
    return points


def _one(tmp: Path, cfg: dict[str, Any], acts: bool, extra: list[str], fewest: int | None) -> dict[str, Any]:
    """One launch, node1's ranks throttled healthy_s seconds after the standbys wait, and left so to their end."""
    ckpt = tmp / f"ckpt-{time.monotonic_ns()}"
    job = tmp / "slow.yaml"
    job.write_text(JOB.format(port=procs.free_port(), ckpt=ckpt, every=cfg["ckpt_every"], subset=cfg["subset"],
                              epochs=cfg["epochs"], batch=cfg["batch"], global_batch=3 * cfg["batch"],
                              on="infra, slow" if acts else "infra", slow_for=cfg["slow_for"],
                              fewest=f", min_nnodes: {fewest}" if fewest else ""))
    env = procs.clean_env(XDG_STATE_HOME=str(tmp / f"state-{time.monotonic_ns()}"))
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(tmp / "runs"), *extra],
                    env) as p:
        launched = time.monotonic()
        _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
        run_id = header.group(1)
        p.wait_for(STEP.pattern, timeout=300)
        standbys_idle(run_id)
        time.sleep(cfg["healthy_s"])  # the job trains healthy for as long as the harness measures its pace before
        ranks = rank_pids(run_id, 1, attempt=0)
        if not ranks:
            raise RuntimeError(f"no rank 1 of run {run_id}'s attempt 0 to throttle")
        with throttled(ranks, SHARE, name=f"bench-slow-{run_id}"):
            slowed_at, slowed_wall = time.monotonic(), time.time()
            code = p.wait(timeout=cfg["timeout"])
        ended = p.ended or time.monotonic()
        if code != 0:
            raise RuntimeError(f"run {run_id} exited {code}:\n{p.output[-3000:]}")
        run = tmp / "runs" / run_id
        summary = json.loads((run / "summary.json").read_text())
    lines = p.lines
    named = next((when for when, line in lines if when > slowed_at and re.search(NAMED, line)), None)
    weighed = next(((when, line) for when, line in lines if when > slowed_at and re.search(WEIGHED, line)), None)
    acted = weighed[0] if weighed and re.search(ACTED, weighed[1]) else None
    attempt1 = next((when for when, line in lines if re.search(r"^harness: run \S+ attempt 1, ", line)), None)
    points = _steps(lines)
    before = [pt for pt in points if attempt1 is None or pt[0] < attempt1]
    after = [pt for pt in points if attempt1 is not None and pt[0] > attempt1]
    healthy = pace(before, slowed_at - cfg["healthy_s"], slowed_at)
    first_step = after[0][0] if after else None
    back = back_at(after, first_step, healthy, cfg["window"]) if first_step and healthy else None
    onset = next((e["since"] for e in summary["attempts"][0].get("health") or [] if e["kind"] == "weighed"), None)
    restart = summary["attempts"][1].get("restart") if len(summary["attempts"]) > 1 else None

    def since(at: float | None) -> float | None:
        return None if at is None else round(at - slowed_at, 2)

    return {
        "acts": acts, "run_id": run_id, "end_to_end_s": round(ended - launched, 1),
        "slowed_at_step": max((s for t, s in before if t <= slowed_at), default=None),
        "throttled_pids": len(ranks),
        "healthy_steps_per_s": _round(healthy),
        "slowed_steps_per_s": _round(pace(before, slowed_at, acted or ended)),
        "after_steps_per_s": _round(pace(after, first_step, ended) if first_step else None),
        "named_s": since(named), "weighed_s": since(weighed[0] if weighed else None), "action_s": since(acted),
        "first_step_s": since(first_step), "back_s": since(back),
        "weighed": weighed[1].removeprefix("harness: ") if weighed else None,
        "onset_vs_throttle_s": None if onset is None else round(onset - slowed_wall, 2),
        "attempts": [{"status": a["status"], "kind": a.get("kind"), "hosts": a["hosts"], "world_size": a["world_size"]}
                     for a in summary["attempts"]],
        "restart": restart, "steps_redone": restart.get("steps_redone") if restart else None,
        "goodput": summary["goodput"],
        "timeline": _timeline(points, slowed_at),
    }


def _timeline(points: list[tuple[float, int]], origin: float) -> list[tuple[float, int]]:
    """(seconds from origin, step) of the step lines, one a second at most: the job's course, kept with its figures."""
    kept: list[tuple[float, int]] = []
    for at, step in points:
        if not kept or at - origin >= kept[-1][0] + 1.0:
            kept.append((round(at - origin, 1), step))
    return kept


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _row(target: str, acting: dict[str, Any], left: dict[str, Any], slow_for: float) -> dict[str, Any]:
    """The two runs side by side, and the goal judged on the acting one."""
    healthy, after = acting["healthy_steps_per_s"], acting["after_steps_per_s"]
    goal_s = slow_for + GOAL_MARGIN
    return {"target": target, "acting": acting, "left_slow": left, "slow_for_s": slow_for, "goal_s": goal_s,
            "after_vs_healthy": round(after / healthy, 3) if healthy and after else None,
            "slowed_vs_healthy": round(acting["slowed_steps_per_s"] / healthy, 3)
            if healthy and acting["slowed_steps_per_s"] else None,
            "left_slowed_vs_healthy": round(left["slowed_steps_per_s"] / left["healthy_steps_per_s"], 3)
            if left["healthy_steps_per_s"] and left["slowed_steps_per_s"] else None,
            "saved_s": round(left["end_to_end_s"] - acting["end_to_end_s"], 1),
            "met": acting["back_s"] is not None and acting["back_s"] <= goal_s and acting["steps_redone"] == 0}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-slow-") as tmp:
        acting = _one(Path(tmp), cfg, True, [], fewest=2)
        left = _one(Path(tmp), cfg, False, [], fewest=2)
        rows.append(_row("3 simulated nodes, min_nnodes 2 (no spare): on 2 nodes", acting, left, cfg["slow_for"]))
        reason = missing_support() if cfg["ssh"] else "not in this run's settings"
        if reason:
            notes.append(f"SSH rows left out: {reason}")
        else:
            with namespace_cluster(4) as cluster:
                hosts = cluster.write_inventory(Path(tmp) / "hosts.yaml")
                extra = ["--hosts", str(hosts), "--known-hosts", str(cluster.known_hosts)]
                acting = _one(Path(tmp), cfg, True, extra, fewest=None)
                left = _one(Path(tmp), cfg, False, extra, fewest=None)
            rows.append(_row("4 SSH hosts, nnodes 3: the spare h4 takes over", acting, left, cfg["slow_for"]))
    batch = cfg["batch"]
    return {"job": f"payload: synthetic data, small model, global batch {3 * batch} ({batch} per rank on 3 nodes, "
                   f"{3 * batch // 2} on 2), 1 rank per node, gloo on CPU, {cfg['epochs']} epochs of "
                   f"{cfg['subset'] // (3 * batch)} steps, a checkpoint every "
                   f"{cfg['ckpt_every']} steps, `--resume`; restarts max 1, backoff 0; health.slow_for "
                   f"{cfg['slow_for']:g} s", "share": SHARE, "healthy_s": cfg["healthy_s"], "window_s": cfg["window"],
            "slow_for_s": cfg["slow_for"], "back_share": BACK_SHARE, "rows": rows, "notes": notes}
