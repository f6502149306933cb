"""Benchmark 4: preflight fan-out. `harness preflight HOSTS --job JOB` over 1, 4, 16 real sshd hosts
(tests/cluster.py: network namespaces on a private bridge), and the fast checks that every
`harness launch --hosts` runs first (run_preflight(fast=True), no torch import on the hosts).

Preflight talks to all hosts at once, so its time should grow far slower than the host count:
`vs_linear` = t(k) / (k * t(1)), 1.0 being a sequential tool. The full probe imports torch on
every host; the simulated hosts share this machine's cores, so that part is CPU-bound here and
grows with k, which real hosts (each with its own CPUs) do not.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import machine, procs

GIB_PER_HOST = 0.7  # a full probe imports torch on every host at once (about 0.55 GiB each)


def cluster_module() -> ModuleType:
    """tests/cluster.py, the namespace-cluster library the tests use (it needs root, iproute2, sshd)."""
    return procs.tests_module("cluster")


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used (/proc/stat), whoever they belong to."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the harness CLI): the controller."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def write_job(path: Path, nnodes: int) -> Path:
    path.write_text(f"name: bench-preflight\nnnodes: {nnodes}\nnproc_per_node: 1\nbackend: gloo\n"
                    f"master_port: {procs.free_port()}\nentrypoint:\n  module: harness.payload.train\n")
    return path


def full(hosts: Path, job: Path, known_hosts: Path) -> tuple[float, dict[str, Any]]:
    """The command as a user types it: wall time and its JSON report."""
    begun = time.monotonic()
    lines = procs.run_lines([procs.PY, "-m", "harness.cli", "preflight", str(hosts), "--job", str(job),
                             "--known-hosts", str(known_hosts), "--json"], timeout=300)
    return time.monotonic() - begun, json.loads("\n".join(lines))


def fast(hosts: Path, job: Path, known_hosts: Path) -> tuple[float, dict[str, Any]]:
    """The checks `harness launch --hosts` runs before starting anything, in this process."""
    from harness.inventory import load_inventory
    from harness.preflight import run_preflight
    from harness.spec import load_job

    begun = time.monotonic()
    report = run_preflight(load_inventory(hosts), load_job(job), known_hosts=known_hosts, fast=True)
    return time.monotonic() - begun, report.to_json()


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    cluster = cluster_module()
    reason = cluster.missing_support()
    if reason:
        return {"skipped": reason}
    sizes = list(cfg["hosts"])
    notes = []
    room = int((machine.memory_available_gib() - 2) / GIB_PER_HOST)
    if max(sizes) > room:
        notes.append(f"{[k for k in sizes if k > room]} hosts left out: {machine.memory_available_gib():.1f} GiB "
                     f"available, a full probe needs about {GIB_PER_HOST} GiB per host")
        sizes = [k for k in sizes if k <= room]
    rows = []
    begun = time.monotonic()
    with cluster.namespace_cluster(max(sizes)) as c, tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        built = time.monotonic() - begun
        for k in sizes:
            hosts = c.write_inventory(Path(tmp) / f"hosts{k}.yaml", hosts=[f"h{i}" for i in range(1, k + 1)])
            job = write_job(Path(tmp) / f"job{k}.yaml", k)
            row: dict[str, Any] = {"hosts": k}
            for mode, check in (("full", full), ("fast", fast)):
                times, controller, machine_cpu = [], [], []
                for _ in range(cfg["repeats"]):
                    own, everyone = own_cpu_s(), machine_cpu_s()
                    seconds, report = check(hosts, job, c.known_hosts)
                    controller.append(own_cpu_s() - own)
                    machine_cpu.append(machine_cpu_s() - everyone)
                    if not report.get("ok"):
                        failed = [ch for ch in report.get("checks", []) if ch.get("status") == "fail"]
                        raise RuntimeError(f"preflight ({mode}) over {k} hosts failed: {failed or report}")
                    times.append(seconds)
                row[f"{mode}_s"] = round(statistics.median(times), 2)
                row[f"{mode}_attempts_s"] = [round(t, 2) for t in times]
                row[f"{mode}_controller_cpu_s"] = round(statistics.median(controller), 2)
                row[f"{mode}_machine_cpu_s"] = round(statistics.median(machine_cpu), 2)
            rows.append(row)
    for row in rows:
        for mode in ("full", "fast"):
            row[f"{mode}_vs_linear"] = round(row[f"{mode}_s"] / (row["hosts"] * rows[0][f"{mode}_s"]), 3)
    return {"cluster_build_s": round(built, 1), "repeats": cfg["repeats"], "statistic": "median",
            "cores": procs.cpu_count(),
            "rows": rows, "notes": notes}
