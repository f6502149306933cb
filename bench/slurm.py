"""Benchmark 7: Slurm. `harness launch --target slurm` against the same job submitted with plain
sbatch (the rendered script: what a careful hand-written one does), on a 2-node Slurm cluster of
network namespaces on this machine (testbed/slurm_cluster.py; needs root and `make test-packages`).

- Submit to first step: from the command's start to rank 0's first progress line (the harness's
  controller runs in the batch step and starts each node as an srun step; `harness launch` prints the
  line from the run's record, which it reads every 0.1 s; for sbatch, this benchmark polls the output
  file every 10 ms).
- Rank death to job end: bench/ddp_fail.py, rank 1 dies at step 3 while rank 0 is in a long step
  (BLOCK=sleep: a stuck read, a long compute); seconds from the death to the job's end in Slurm (and
  to the harness's exit). The same script without `--kill-on-bad-exit` (Slurm's default) shows what
  the flag saves: rank 0 runs on for its hour, so that row gets a bounded wait and is then cancelled.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.launch import FIRST_STEP, PAYLOAD_ARGS, died_at, write_job
from harness.spec.job import load_job
from harness.targets.slurm.batch import batch_script
from testbed.slurm_cluster import FINISHED, SlurmCluster, missing_support


def _job(path: Path, kind: str, target: str, args: list[str], env: dict[str, str]) -> Path:
    write_job(path, kind, target, args, env)
    with path.open("a") as spec:
        spec.write(f"slurm: {{python: {procs.PY}, workdir: {procs.REPO}}}\n")
    return path


def _submit(cluster: Any, script: str, tmp: Path, name: str) -> tuple[int, Path]:
    path = tmp / f"{name}.sbatch"
    path.write_text(script)
    job_id = cluster.sbatch(f"--output={tmp}/{name}-%j.out", str(path))
    return job_id, tmp / f"{name}-{job_id}.out"


def _first_line(path: Path, pattern: str, timeout: float = 180) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and pattern in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.01)
    raise RuntimeError(f"{pattern!r} not in {path} within {timeout:g}s")


def _first_step_sbatch(cluster: Any, job: Path, tmp: Path, attempt: int) -> float:
    begun = time.monotonic()
    job_id, out = _submit(cluster, batch_script(load_job(job), job.name), tmp, f"first-{attempt}")
    seen = _first_line(out, FIRST_STEP.replace("\\", ""))
    if cluster.wait_job(job_id, timeout=180) != "COMPLETED":
        raise RuntimeError(f"sbatch job {job_id} did not complete:\n{out.read_text()[-2000:]}")
    return seen - begun


def _first_step_harness(env: dict[str, str], job: Path, tmp: Path) -> float:
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--target", "slurm", "--runs-dir",
                     str(tmp / "runs")], env) as launch:
        when, _ = launch.wait_for(FIRST_STEP, timeout=180)
        if launch.wait(timeout=180) != 0:
            raise RuntimeError(f"harness launch failed:\n{launch.output[-2000:]}")
        return when - launch.started


def _job_end(cluster: Any, job_id: int, until: float) -> float | None:
    while time.monotonic() < until:
        if cluster.job_state(job_id) in FINISHED:
            return time.monotonic()
        time.sleep(0.02)
    return None


def _failing_job(tmp: Path, name: str) -> tuple[Path, Path]:
    """bench/ddp_fail.py as a job whose rank 1 writes its time of death to the returned path."""
    death = tmp / f"death-{name}"
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "BLOCK": "sleep", "DEATH_FILE": str(death)}
    return _job(tmp / f"{name}.yaml", "script", "bench/ddp_fail.py", [], env), death


def _failure_sbatch(cluster: Any, tmp: Path, name: str, kill_on_bad_exit: bool, wait: float) -> dict[str, Any]:
    job, death = _failing_job(tmp, name)
    script = batch_script(load_job(job), job.name)
    if not kill_on_bad_exit:
        script = script.replace(" --kill-on-bad-exit=1", "")
    job_id, _ = _submit(cluster, script, tmp, name)
    try:
        died = died_at(death)
        ended = _job_end(cluster, job_id, died + wait)
    finally:
        cluster.run(["scancel", str(job_id)], check=False)
        cluster.wait_job(job_id, timeout=120)
    return {"job_end_s": None if ended is None else ended - died}


def _failure_harness(cluster: Any, env: dict[str, str], tmp: Path, name: str) -> dict[str, Any]:
    job, death = _failing_job(tmp, name)
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--target", "slurm", "--runs-dir",
                     str(tmp / "runs")], env) as launch:
        job_id = int(launch.wait_for(r"submitted Slurm job (\d+)", timeout=60)[1].group(1))
        died = died_at(death, launch)
        code = launch.wait(timeout=120)
        ended = _job_end(cluster, job_id, time.monotonic() + 60)
        assert launch.ended is not None
        return {"exit_code": code, "job_end_s": None if ended is None else ended - died,
                "launcher_exit_s": launch.ended - died}


def _median(values: list[float | None]) -> float | None:
    finite = [float("inf") if v is None else v for v in values]
    value = statistics.median(finite)
    return None if value == float("inf") else round(value, 2)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    reason = missing_support()
    if reason:
        raise RuntimeError(f"no Slurm cluster on this machine: {reason}")
    with SlurmCluster(2) as cluster, tempfile.TemporaryDirectory(prefix="bench-slurm-") as scratch:
        tmp = Path(scratch)
        env = procs.clean_env(SLURM_CONF=cluster.env["SLURM_CONF"], PATH=cluster.env["PATH"])
        cluster.run(["srun", "--nodes=2", "true"])  # a fresh slurmctld schedules its first job seconds late
        first = _job(tmp / "first.yaml", "module", "harness.payload.train", PAYLOAD_ARGS, {})
        starts: dict[str, list[float]] = {"harness launch --target slurm": [], "sbatch (the rendered script)": []}
        ends: dict[str, list[dict[str, Any]]] = {"harness launch --target slurm": [],
                                                 "sbatch (the rendered script)": []}
        for attempt in range(cfg["repeats"]):  # interleaved: a burst of load hits one attempt, not one variant
            starts["harness launch --target slurm"].append(_first_step_harness(env, first, tmp))
            starts["sbatch (the rendered script)"].append(_first_step_sbatch(cluster, first, tmp, attempt))
            ends["harness launch --target slurm"].append(_failure_harness(cluster, env, tmp, f"harness-{attempt}"))
            ends["sbatch (the rendered script)"].append(
                _failure_sbatch(cluster, tmp, f"sbatch-{attempt}", True, cfg["wait"]))
        default = _failure_sbatch(cluster, tmp, "default", False, cfg["wait"])
    first_rows = [{"name": name, "first_step_s": _median(list(times)), "attempts_s": [round(t, 2) for t in times]}
                  for name, times in starts.items()]
    end_rows = [{"name": name, "job_end_s": _median([r["job_end_s"] for r in runs]),
                 "launcher_exit_s": _median([r.get("launcher_exit_s") for r in runs]) if "harness" in name else None,
                 "attempts_job_end_s": [None if r["job_end_s"] is None else round(r["job_end_s"], 2) for r in runs]}
                for name, runs in ends.items()]
    end_rows.append({"name": "sbatch, srun without --kill-on-bad-exit (Slurm's default)",
                     "job_end_s": None if default["job_end_s"] is None else round(default["job_end_s"], 2),
                     "launcher_exit_s": None, "attempts_job_end_s": [], "bounded_wait_s": cfg["wait"]})
    return {"cluster": "2 Slurm 22.05 nodes (network namespaces on this machine)", "repeats": cfg["repeats"],
            "statistic": "median", "first_step": first_rows, "failure": end_rows,
            "first_step_job": "payload: synthetic data, small model, batch 32, gloo on CPU, world size 2",
            "failure_job": "bench/ddp_fail.py: rank 1 dies at step 3 while rank 0 is in a long step"}
