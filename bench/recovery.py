"""Benchmark 6: time to recover. A job with `restarts: {max: 1, backoff: 0}` loses a node mid-training;
how long from the kill to the first training step of the next attempt, and where that time goes.

Three failures: on simulated nodes, rank 1's worker is SIGKILLed (as the OOM killer would); on a
3-host namespace cluster (testbed/cluster.py, needs root), every process of h2 is SIGKILLed, sshd
included, so the spare h3 takes its place; and on a fresh such cluster a 3-node job with
`restarts.min_nnodes: 2` and no spare loses h2 the same way and goes on on h1 and h3 (world size 3 ->
2, the same global batch of 48). The phases come from the arrival times of the lines the harness and
rank 0 print (bench/procs.Proc):
  detection   kill -> `harness: node1 ... failed`
  teardown    -> `harness: attempt 0 failed ...` (every node of attempt 0 ended)
  preflight   -> `harness: run ... attempt 1, ...` (plan, and on SSH the fast preflight on the new set)
  start-up    -> rank 0's `resume: looking for the newest checkpoint` (processes, rendezvous, data, model)
  load        -> rank 0's `resume: epoch ...` (the newest checkpoint read and applied)
  first step  -> rank 0's first progress line after it
The same restart as the run's record tells it (summary.json's attempts[1].restart: from the failed attempt's
last progress line to the first step, phase by phase) is in the row as recorded_*, and the hosts that started
warm (a standby waiting, restarts.standby) as warm.
Steps redone: the last step rank 0 logged in the failed attempt minus the step the next one resumed
from, against the checkpoint interval (at most interval - 1: only the work since the newest
checkpoint is lost; 0 with a just-in-time checkpoint).

In the full run (cfg before, ssh), each failure is measured side by side with the harness before issue 48
(BASELINE, that commit's `harness` package, payload included), alternating, on the same machine: the row's
before_* fields; the quick run has the simulated nodes' row alone, today's harness alone. The node is killed
at step `kill_at`, once the standbys of the next attempt have done their imports and wait (standbys_idle), as
they do when a failure comes in a run of any length.
Every run keeps its hosts kept out (record/hosts_out.py) in a state directory of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import procs
from harness.node.proctable import environ, stat_fields
from harness.record.schema import RESTART_PHASES
from testbed.cluster import missing_support, namespace_cluster
from testbed.ranks import rank_pids

STEP = re.compile(r"\[rank0\]: epoch \d+/\d+ step (\d+)/(\d+) ")
RESUMED = re.compile(r"\[rank0\]: resume: epoch \d+/\d+ step (\d+)/")
PHASES = ("detection", "teardown", "preflight", "start-up", "load", "first step")
MARKS = (r"^harness: node\d+ on \S+ failed", r"^harness: attempt 0 failed", r"^harness: run \S+ attempt 1, ",
         r"\[rank0\]: resume: looking for", RESUMED.pattern)
JOB = """\
name: bench-recovery
nnodes: {nnodes}
nproc_per_node: 1
backend: gloo
master_port: {port}
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --subset, "16384", --model, small, --epochs, "1", --batch-size, "16", --log-every, "1",
         --global-batch, "{global_batch}", --ckpt-dir, {ckpt}, --ckpt-every, "{every}", --resume, --device, cpu]
env: {{OMP_NUM_THREADS: "1"}}
restarts: {{max: 1, on: infra, backoff: 0, min_nnodes: {fewest}{standby}}}
"""
BASELINE = "47343ce"  # the last commit before issue 48 (just-in-time checkpoints, standbys, hosts kept out)
PER_RANK = 16  # images per rank at the start: the global batch is PER_RANK x nnodes, kept when the job shrinks
Kill = Callable[[str], None]  # run id -> kill the node


def standbys_idle(run_id: str, timeout: float = 120) -> None:
    """Until the launch's standbys for its next attempt (and their warm workers) have started, done their imports and
    wait, as they do in a run of any length: none of them used CPU for a second. They carry NODE_RANK standby-HOST;
    the running attempt's nodes, started from standbys of their own, their ranks."""
    deadline = time.monotonic() + timeout
    last: dict[int, int] | None = None
    while time.monotonic() < deadline:
        used = {}
        for pid in procs.with_env(f"HARNESS_RUN_ID={run_id}"):  # on SSH hosts too (sshd drops BENCH_TAG)
            if not environ(pid).get(b"NODE_RANK", b"").startswith(b"standby-"):
                continue
            with contextlib.suppress(OSError):
                if b"standby.py" in Path(f"/proc/{pid}/cmdline").read_bytes() and (fields := stat_fields(pid)):
                    used[pid] = int(fields[11]) + int(fields[12])
        if used and used == last:
            return
        last = used
        time.sleep(1.0)
    raise RuntimeError(f"the standbys of {run_id} did not settle within {timeout:g} s")


def _worker_of_rank_1(run_id: str) -> None:
    for pid in rank_pids(run_id, 1):
        os.kill(pid, signal.SIGKILL)


def _one(tmp: Path, root: Path, kill: Kill, kill_at: int, every: int, extra: list[str], nnodes: int = 2,
         fewest: int = 2) -> dict[str, Any]:
    """One launch with root's harness, its node killed at step kill_at (today's: once its standbys wait, started
    as soon as the ranks joined; BASELINE has none)."""
    ckpt = tmp / f"ckpt-{time.monotonic_ns()}"
    job = tmp / "recovery.yaml"
    today = root == procs.REPO
    job.write_text(JOB.format(port=procs.free_port(), ckpt=ckpt, every=every, nnodes=nnodes, fewest=fewest,
                              global_batch=PER_RANK * nnodes, standby=", standby: 0" if today else ""))
    env = procs.clean_env(XDG_STATE_HOME=str(tmp / f"state-{time.monotonic_ns()}"))
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(tmp / "runs"), *extra],
                    env, cwd=root) as p:
        _, header = p.wait_for(r"^harness: run (\S+): ", timeout=120)
        p.wait_for(rf"\[rank0\]: epoch 1/\d+ step {kill_at}/", timeout=300)
        if today:
            standbys_idle(header.group(1))
        killed = time.monotonic()
        kill(header.group(1))
        marks = [killed]
        for pattern in MARKS:  # each after the one before: attempt 0 printed some of them too
            marks.append(p.wait_for(pattern, timeout=300, after=marks[-1])[0])
        code = p.wait(timeout=600)
        resume = next(i for i, (_, line) in enumerate(p.lines) if RESUMED.search(line))
        marks.append(next(when for when, line in p.lines[resume:] if STEP.search(line)))
        if code != 0:
            raise RuntimeError(f"the recovered run exited {code}:\n{p.output[-3000:]}")
        run = tmp / "runs" / header.group(1)
        reached = max(int(m.group(1)) for line in (run / "node0.log").read_text().splitlines()
                      if (m := STEP.search(line)))
        resumed = int(RESUMED.search(p.lines[resume][1]).group(1))  # type: ignore[union-attr]
        summary = json.loads((run / "summary.json").read_text())
    phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
    return {"phases": phases, "total": marks[-1] - killed, "redone": reached - resumed,
            "reached": reached, "resumed": resumed,
            "attempts": [a["status"] for a in summary["attempts"]], "kind": summary["attempts"][0]["kind"],
            "world_sizes": [a["world_size"] for a in summary["attempts"]], "goodput": summary["goodput"],
            "recorded": summary["attempts"][1].get("restart"), "warm": summary["attempts"][1].get("warm")}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _before(runs: list[dict[str, Any]], before: list[dict[str, Any]]) -> dict[str, Any]:
    """The same failure with BASELINE's harness (before_*), where it ran."""
    if not before:
        return {}
    return {"before_total_s": median([r["total"] for r in before]),
            "total_vs_before": round(median([r["total"] for r in runs]) / median([r["total"] for r in before]), 3),
            **{f"before_{phase}_s": median([r["phases"][phase] for r in before]) for phase in PHASES},
            "before_steps_redone": [r["redone"] for r in before], "before_attempts_total_s":
                [round(r["total"], 2) for r in before]}


def _row(name: str, runs: list[dict[str, Any]], before: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Today's medians, the phases recorded, and the same failure with BASELINE's harness (before_*)."""
    return {"failure": name, "total_s": median([r["total"] for r in runs]), **_before(runs, before),
            "warm": runs[0]["warm"],
            **{f"{phase}_s": median([r["phases"][phase] for r in runs]) for phase in PHASES},
            "steps_redone": [r["redone"] for r in runs], "ckpt_every": every,
            "attempts_total_s": [round(r["total"], 2) for r in runs],
            "classified": sorted({r["kind"] for r in runs}), "attempts": runs[0]["attempts"],
            "world_sizes": runs[0]["world_sizes"], "goodput": median([r["goodput"]["goodput"] for r in runs]),
            "recorded_total_s": median([r["recorded"]["total_s"] for r in runs]),
            **{f"recorded_{phase}_s": median([r["recorded"]["phases"].get(phase, 0.0) for r in runs])
               for phase in RESTART_PHASES},
            **{f"time_{bucket}_s": median([r["goodput"]["seconds"][bucket] for r in runs])
               for bucket in runs[0]["goodput"]["seconds"]}}


@contextmanager
def _cluster(workdir: Path) -> Iterator[Any]:
    """3 hosts whose nodes run in workdir (root's harness: the job's `-m harness.payload.train` is its own)."""
    with namespace_cluster(3, workdir=workdir) as cluster:
        yield cluster


def _kill_host(cluster: Any, name: str) -> Kill:
    def kill(_run_id: str) -> None:
        for pid in cluster.pids(name):
            os.kill(pid, signal.SIGKILL)
    return kill


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    every, kill_at, repeats = cfg["ckpt_every"], cfg["kill_at"], cfg["repeats"]
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        roots = {"": procs.REPO}
        if cfg["before"]:  # the full run: side by side with the harness before issue 48
            roots["before"] = procs.harness_at(BASELINE, Path(tmp) / "before")
        runs: dict[str, list[dict[str, Any]]] = {version: [] for version in ("", "before")}
        for _ in range(repeats):
            for version, root in roots.items():
                runs[version].append(_one(Path(tmp), root, _worker_of_rank_1, kill_at, every, []))
        rows.append(_row("simulated nodes: rank 1's worker SIGKILLed", runs[""], runs["before"], every))
        reason = missing_support() if cfg["ssh"] else "not in this profile (the full run has them)"
        if reason:
            notes.append(f"SSH rows left out: {reason}")
        else:
            for name, nnodes in (("3 SSH hosts: every process of h2 SIGKILLed, spare h3 takes over", 2),
                                 ("3 SSH hosts, 3 nodes, min_nnodes 2, no spare: every process of h2 SIGKILLed, "
                                  "h1 and h3 go on", 3)):
                runs = {version: [] for version in ("", "before")}
                for _ in range(repeats):
                    for version, root in roots.items():  # a fresh cluster each time: the killed host stays dead
                        with _cluster(root) as cluster:
                            hosts = cluster.write_inventory(Path(tmp) / "hosts.yaml")
                            extra = ["--hosts", str(hosts), "--known-hosts", str(cluster.known_hosts)]
                            runs[version].append(_one(Path(tmp), root, _kill_host(cluster, "h2"), kill_at, every,
                                                      extra, nnodes=nnodes))
                rows.append(_row(name, runs[""], runs["before"], every))
    return {"job": f"payload: synthetic data, small model, batch {PER_RANK} x the job's nodes (the 3-node job's 48 "
                   f"kept on 2 nodes as 2 x 12 per rank), 1 rank per node, gloo on CPU; restarts max 1, backoff 0",
            "kill_at_step": kill_at, **({"before": BASELINE} if cfg["before"] else {}),
            "repeats": repeats, "statistic": "median", "rows": rows, "notes": notes}
