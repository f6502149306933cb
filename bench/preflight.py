"""Benchmark 4: preflight fan-out. `harness preflight HOSTS --job JOB` over 1, 4, 16 real sshd hosts
(testbed/cluster.py: network namespaces, each host with a management and a data network, an interface
that routes nowhere and Debian's 127.0.1.1 hostname line), and the fast checks that every
`harness launch --hosts` runs first (run_preflight(fast=True), no torch import on the hosts).

In the full run (cfg baseline) each is measured side by side with the preflight before the interface
checks (BASELINE, the same commands from that commit's tree), alternating, on the same hosts; cfg modes
picks `full` (the command) and `fast` (the checks before a launch). That preflight fails these
hosts (`resolve`: the hostname is loopback), which the new one turns into a pinned interface.

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
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import machine, procs
from testbed import cluster

GIB_PER_HOST = 0.7  # a full probe imports torch on every host at once (about 0.55 GiB each)
BASELINE = "5829465"  # the last commit before the interface checks (issue 15)
BASELINE_FAILS = {"resolve"}  # what today's preflight fails on these hosts: own hostname -> 127.0.1.1
# The fast checks, timed inside a fresh interpreter whose `harness` is argv[1]'s.
FAST = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from harness.preflight.runner import run_preflight
try:
    from harness.spec.inventory import load_inventory
    from harness.spec.job import load_job
except ImportError:  # a tree from before the layout of issue 27 (BASELINE)
    from harness.inventory import load_inventory
    from harness.spec import load_job
begun = time.monotonic()
report = run_preflight(load_inventory(sys.argv[2]), load_job(sys.argv[3]), known_hosts=sys.argv[4], fast=True)
print(json.dumps({"seconds": time.monotonic() - begun, "report": report.to_json()}))
"""


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


def full(root: Path, hosts: Path, job: Path, known_hosts: Path) -> tuple[float, dict[str, Any]]:
    """The command as a user types it, with root's harness: wall time and its JSON report."""
    begun = time.monotonic()
    done = subprocess.run([procs.PY, "-m", "harness.cli", "preflight", str(hosts), "--job", str(job), "--known-hosts",
                           str(known_hosts), "--json"], cwd=root, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - begun
    if done.returncode not in (0, 1):
        raise RuntimeError(f"harness preflight ({root}) exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)


def fast(root: Path, hosts: Path, job: Path, known_hosts: Path) -> tuple[float, dict[str, Any]]:
    """The checks `harness launch --hosts` runs before starting anything, timed around the call."""
    done = subprocess.run([procs.PY, "-c", FAST, str(root), str(hosts), str(job), str(known_hosts)], cwd=root,
                          capture_output=True, text=True, timeout=300, check=True)
    answer = json.loads(done.stdout)
    return answer["seconds"], answer["report"]


MODES = {"full": full, "fast": fast}


def _failed(report: dict[str, Any]) -> set[str]:
    return {c["check"] for c in report.get("checks", []) if c.get("status") == "fail"}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
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
    with cluster.namespace_cluster(max(sizes), multi_nic=True) as c, \
            tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        built = time.monotonic() - begun
        roots = {"": procs.REPO}
        if cfg["baseline"]:  # the full run: side by side with the preflight before the interface checks
            roots["baseline_"] = procs.harness_at(BASELINE, Path(tmp) / "baseline")
        for k in sizes:
            hosts = c.write_inventory(Path(tmp) / f"hosts{k}.yaml", hosts=[f"h{i}" for i in range(1, k + 1)])
            job = write_job(Path(tmp) / f"job{k}.yaml", k)
            row: dict[str, Any] = {"hosts": k}
            interfaces: set[str] = set()
            for mode, check in ((mode, MODES[mode]) for mode in cfg["modes"]):
                times: dict[str, list[float]] = {version: [] for version in roots}
                controller, machine_cpu = [], []
                for _ in range(cfg["repeats"]):
                    for version, root in roots.items():
                        own, everyone = own_cpu_s(), machine_cpu_s()
                        seconds, report = check(root, hosts, job, c.known_hosts)
                        allowed = BASELINE_FAILS if version else set()
                        if not _failed(report) <= allowed or (not version and not report.get("ok")):
                            raise RuntimeError(f"preflight ({version or 'current'}, {mode}) over {k} hosts failed: "
                                               f"{_failed(report) - allowed or report}")
                        times[version].append(seconds)
                        if not version:
                            controller.append(own_cpu_s() - own)
                            machine_cpu.append(machine_cpu_s() - everyone)
                            interfaces |= set(report["interfaces"].values())
                for version, found in times.items():
                    row[f"{version}{mode}_s"] = round(statistics.median(found), 2)
                    row[f"{version}{mode}_attempts_s"] = [round(t, 2) for t in found]
                if cfg["baseline"]:
                    row[f"{mode}_vs_baseline"] = round(row[f"{mode}_s"] / row[f"baseline_{mode}_s"], 3)
                row[f"{mode}_controller_cpu_s"] = round(statistics.median(controller), 2)
                row[f"{mode}_machine_cpu_s"] = round(statistics.median(machine_cpu), 2)
            row["pinned"] = sorted(interfaces)
            rows.append(row)
    for row in rows:
        for mode in cfg["modes"]:
            row[f"{mode}_vs_linear"] = round(row[f"{mode}_s"] / (row["hosts"] * rows[0][f"{mode}_s"]), 3)
    return {"cluster_build_s": round(built, 1), "repeats": cfg["repeats"], "statistic": "median",
            "cores": procs.cpu_count(), "modes": list(cfg["modes"]), "rows": rows, "notes": notes,
            **({"baseline": BASELINE, "baseline_fails": sorted(BASELINE_FAILS)} if cfg["baseline"] else {})}
