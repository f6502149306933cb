"""Benchmark 8: what a container costs a node at start-up. The same 2-node job over SSH on 2 sshd hosts
in network namespaces (testbed/cluster.py), each host with podman and the image tests/image/build.sh
makes (testbed/podman_config.py; needs root and `make test-packages`), launched bare (the hosts' Python)
and with `container: {engine: podman}`, interleaved.

- Launch to first step: from the command's start to rank 0's first progress line; both include the
  fast preflight, which for the container job also asks the engine for the image and runs its probe
  inside the image.
- `podman run --rm IMAGE true` on one host: the engine's own floor, for scale.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs
from bench.launch import FIRST_STEP, PAYLOAD_ARGS, write_job
from testbed import cluster as cluster_module
from testbed import podman_config as podman


def _launch(job: Path, hosts: Path, known_hosts: Path, runs: Path) -> float:
    with procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--hosts", str(hosts), "--known-hosts",
                     str(known_hosts), "--runs-dir", str(runs)]) as launch:
        when, _ = launch.wait_for(FIRST_STEP, timeout=300)
        if launch.wait(timeout=300) != 0:
            raise RuntimeError(f"harness launch failed:\n{launch.output[-2000:]}")
        return when - launch.started


def _engine_floor(cluster: Any, image: str) -> float:
    begun = time.monotonic()
    cluster.podman(cluster.hosts[0], "run", "--rm", "--network=host", "--entrypoint", "true", image, timeout=120)
    return time.monotonic() - begun


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    reason = cluster_module.missing_support()
    if reason:
        raise RuntimeError(f"no namespace cluster on this machine: {reason}")
    store = podman.image_store()
    with tempfile.TemporaryDirectory(prefix="bench-containers-") as scratch:
        tmp = Path(scratch)
        workdir = tmp / "workdir"
        workdir.mkdir(mode=0o777)
        workdir.chmod(0o777)  # the image runs as uid 10001
        with cluster_module.Cluster(2, workdir=workdir, image_store=store) as cluster:
            hosts = cluster.write_inventory(tmp / "hosts.yaml")
            bare = write_job(tmp / "bare.yaml", "module", "harness.payload.train", PAYLOAD_ARGS, {})
            contained = write_job(tmp / "container.yaml", "module", "harness.payload.train", PAYLOAD_ARGS, {})
            with contained.open("a") as spec:
                spec.write(f"image: {podman.IMAGE}\ncontainer: {{engine: podman}}\n")
            _engine_floor(cluster, podman.IMAGE)  # the first run of a fresh host's engine sets up its storage
            variants = {"bare host (the host's Python)": bare, "container (podman, the image)": contained}
            times: dict[str, list[float]] = {name: [] for name in variants}
            floor = []
            for attempt in range(cfg["repeats"]):  # interleaved: a burst of load hits one attempt, not one variant
                for name, job in variants.items():
                    times[name].append(_launch(job, hosts, cluster.known_hosts, tmp / f"runs-{attempt}"))
                floor.append(_engine_floor(cluster, podman.IMAGE))
    medians = {name: round(statistics.median(t), 2) for name, t in times.items()}
    rows = [{"name": name, "first_step_s": medians[name], "attempts_s": [round(a, 2) for a in t]}
            for name, t in times.items()]
    bare_s, container_s = medians.values()
    return {"cluster": "2 sshd hosts in network namespaces, podman 4.3 on each (runc, overlay)",
            "job": "payload: synthetic data, small model, batch 32, gloo on CPU, world size 2 (1 per host)",
            "repeats": cfg["repeats"], "statistic": "median", "rows": rows,
            "container_extra_s": round(container_s - bare_s, 2), "ratio": round(container_s / bare_s, 2),
            "podman_run_true_s": round(statistics.median(floor), 2)}
