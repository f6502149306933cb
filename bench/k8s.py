"""Benchmark 13: Kubernetes pods, supervised by the harness against bare torchrun pods. The rendered pods run
as processes on this machine exactly as their containers say (testbed/kubelet.py plays the kubelet: command,
args, env, the ConfigMap's files, the downward API; every pod on loopback), the same payload job in both:

- pod start to first step: every pod of the job started at once (supervised: the controller's pod and the two
  worker pods; bare: the two torchrun pods) to rank 0's first progress line, alternating;
- a rank's failure to the next step: rank 1's worker SIGKILLed at step `kill_at` (supervised: once the next
  attempt's standbys wait, restarts.standby 0), to rank 0's first progress line after its resume. Supervised,
  the ranks restart inside the running pods. Bare, as a JobSet (restartStrategy Recreate) restarts: its
  torchrun fails, every pod is deleted (SIGTERM; the failed one has ended) and created anew with the next
  HARNESS_ATTEMPT, played here at once: the figure is Recreate's floor, without the API calls, scheduling,
  volume attach and container start a cluster adds (docs/kubernetes.md puts those on paper).

Lines are timed as they reach each pod's log file, polled every POLL seconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import procs
from bench.recovery import standbys_idle
from harness.spec.job import load_job
from harness.targets.k8s.manifests import RESTART_ATTEMPT, Flavor, render_manifests
from harness.targets.k8s.objects import COMPLETION_INDEX
from testbed.kubelet import SupervisedPods, job_spec, materialize, pod_dns, pod_process
from testbed.ranks import rank_pids

POLL = 0.02
BIN = Path(procs.PY).parent  # the images' `python` and `harness`: this environment's
STEP = r"\[rank0\]: epoch \d+/\d+ step \d+/"
RESUMED = r"\[rank0\]: resume: epoch \d+/\d+ step \d+/"
JOB = """\
name: bench-k8s
nnodes: 2
backend: gloo
master_port: {port}
image: registry.example/harness:0.1.0
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --subset, "16384", --model, small, --epochs, "1", --batch-size, "16", --log-every, "1",
         --ckpt-dir, {ckpt}, --ckpt-every, "10", --resume, --device, cpu]
env: {{OMP_NUM_THREADS: "1"}}
restarts: {{max: 1, on: any, backoff: 0, standby: 0}}
k8s: {{port: {link}}}
"""


class _Log:
    """A pod's log file, read as it grows: when a line matching a pattern first arrived."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # where the last match ended: the next wait looks after it

    def wait_for(self, pattern: str, timeout: float) -> float:
        regex, deadline = re.compile(pattern, re.M), time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.path.read_text(errors="replace") if self.path.exists() else ""
            if found := regex.search(text, self.offset):
                self.offset = found.end()
                return time.monotonic()
            time.sleep(POLL)
        raise RuntimeError(f"{pattern!r} not in {self.path} within {timeout:g} s:\n{self.path.read_text()[-3000:]}")


def _objects(tmp: Path, supervised: bool, flavor: Flavor = "core") -> list[dict]:
    job = tmp / "job.yaml"
    job.write_text(JOB.format(port=procs.free_port(), ckpt=tmp / f"ckpt-{time.monotonic_ns()}",
                              link=procs.free_port()))
    return render_manifests(load_job(job), job.read_text(), flavor, code={}, supervised=supervised)


def _kill_rank_1(run_id: str) -> None:
    for pid in rank_pids(run_id, 1):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _supervised(tmp: Path) -> Iterator[tuple[SupervisedPods, _Log, float]]:
    """The supervised job's pods started at once; its controller's log, and when they were started."""
    workspace = tmp / f"workspace-{time.monotonic_ns()}"
    workspace.mkdir()
    with SupervisedPods(_objects(tmp, True), tmp / "root", workspace, BIN, BIN) as pods:
        started = time.monotonic()
        pods.controller()
        for index in range(2):
            pods.worker(index)
        yield pods, _Log(pods.logs["controller"]), started


class _BarePods:
    """The bare pods of an unsupervised render, started at once, as the JobSet controller starts them."""

    def __init__(self, objects: list[dict], tmp: Path) -> None:
        self.objects, self.tmp = objects, tmp
        self.workspace = tmp / f"workspace-{time.monotonic_ns()}"
        self.workspace.mkdir()
        self.mounts = materialize(objects, tmp / f"root-{time.monotonic_ns()}")
        self.pods: list[subprocess.Popen[bytes]] = []

    def start(self, attempt: int) -> _Log:
        """Every pod of `attempt`; rank 0's pod's log."""
        container = job_spec(self.objects)["template"]["spec"]["containers"][0]
        logs = []
        for index in range(2):
            argv, env = pod_process(container, {COMPLETION_INDEX: str(index), RESTART_ATTEMPT: str(attempt)},
                                    pod_dns(self.objects, 0), self.mounts)
            log = self.tmp / f"bare-{attempt}-{index}-{time.monotonic_ns()}.log"
            with log.open("wb") as out:
                self.pods.append(subprocess.Popen(argv, env=env | {"PATH": f"{BIN}:{os.environ['PATH']}"},
                                                  cwd=self.workspace, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            logs.append(_Log(log))
        return logs[0]

    def recreate(self, timeout: float) -> None:
        """JobSet's Recreate, once a pod failed: every pod deleted (SIGTERM, then SIGKILL after the grace
        period the pods have), then created anew."""
        grace = job_spec(self.objects)["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = time.monotonic() + timeout
        while all(pod.poll() is None for pod in self.pods):
            if time.monotonic() > deadline:
                raise RuntimeError("no bare pod ended after rank 1's worker was killed")
            time.sleep(POLL)
        for pod in self.pods:
            if pod.poll() is None:
                pod.terminate()
        for pod in self.pods:
            try:
                pod.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(pod.pid, signal.SIGKILL)
                pod.wait()
        self.pods = []

    def end(self) -> None:
        for pod in self.pods:
            if pod.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.pid, signal.SIGKILL)
                pod.wait()


def _first_step_supervised(tmp: Path) -> float:
    with _supervised(tmp) as (_, log, started):
        return log.wait_for(STEP, timeout=300) - started


def _first_step_bare(tmp: Path) -> float:
    pods = _BarePods(_objects(tmp, False), tmp)
    try:
        started = time.monotonic()
        return pods.start(0).wait_for(STEP, timeout=300) - started
    finally:
        pods.end()


def _restart_supervised(tmp: Path, kill_at: int) -> float:
    with _supervised(tmp) as (pods, log, _):
        log.wait_for(rf"\[rank0\]: epoch 1/\d+ step {kill_at}/", timeout=300)
        run_id = re.search(r"^harness: run (\S+): ", pods.output("controller"), re.M)
        assert run_id is not None
        standbys_idle(run_id.group(1))
        killed = time.monotonic()
        _kill_rank_1(run_id.group(1))
        log.wait_for(r"^harness: run \S+ attempt 1, ", timeout=120)
        log.wait_for(RESUMED, timeout=300)
        return log.wait_for(STEP, timeout=300) - killed


def _restart_bare(tmp: Path, kill_at: int) -> float:
    objects = _objects(tmp, False, "jobset")
    pods = _BarePods(objects, tmp)
    try:
        log = pods.start(0)
        log.wait_for(rf"\[rank0\]: epoch 1/\d+ step {kill_at}/", timeout=300)
        killed = time.monotonic()
        _kill_rank_1(object_run_id(objects))
        pods.recreate(timeout=120)
        again = pods.start(1)
        again.wait_for(RESUMED, timeout=300)
        return again.wait_for(STEP, timeout=300) - killed
    finally:
        pods.end()


def object_run_id(objects: list[dict]) -> str:
    """The run id bare pods carry (HARNESS_RUN_ID: the job's name, as rendered)."""
    env = job_spec(objects)["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "HARNESS_RUN_ID")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    repeats, kill_at = cfg["repeats"], cfg["kill_at"]
    first: dict[str, list[float]] = {"supervised": [], "bare": []}
    restart: dict[str, list[float]] = {"supervised": [], "bare": []}
    with tempfile.TemporaryDirectory(prefix="bench-k8s-") as name:
        tmp = Path(name)
        for _ in range(repeats):
            first["supervised"].append(_first_step_supervised(tmp))
            first["bare"].append(_first_step_bare(tmp))
            restart["supervised"].append(_restart_supervised(tmp, kill_at))
            restart["bare"].append(_restart_bare(tmp, kill_at))

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    return {"job": "payload: synthetic data, small model, batch 16 per rank, 2 pods x 1 rank, gloo on CPU; "
                   f"restarts max 1, backoff 0; rank 1's worker killed at step {kill_at}",
            "repeats": repeats, "kill_at_step": kill_at,
            "rows": [{"what": what, **{f"{way}_s": median(values[way]) for way in values},
                      **{f"{way}_attempts_s": [round(v, 2) for v in values[way]] for way in values},
                      "ratio": round(statistics.median(values["supervised"]) / statistics.median(values["bare"]), 3)}
                     for what, values in (("pod start to first step", first),
                                          ("rank 1's worker killed to the next first step", restart))]}
