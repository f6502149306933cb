"""The Slurm test cluster is real: jobs run on every node, nodes reach each other, scancel and teardown leave nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.slurm_cluster import SlurmCluster, missing_support, process_name

# Each task resolves both nodes by name and opens a TCP connection to the other node's slurmd.
PROBE = """
import socket
me = socket.gethostname()
other = {"n1": "n2", "n2": "n1"}[me]
socket.create_connection((other, 6818), timeout=10).close()
print(me, "reached", other)
"""


def _alive(pid: int) -> bool:
    """A process exists and is not a zombie (an unreaped corpse runs nothing and holds no namespace)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return re.search(r"^State:\s+Z", status, re.MULTILINE) is None


def _wait_for_sleeps(cluster: SlurmCluster, count: int, timeout: float = 60) -> dict[str, list[int]]:
    """The `sleep` processes of the running job on every node, once each node runs `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        sleeps = {n.name: [p for p in cluster.job_pids(n.name) if process_name(p) == "sleep"] for n in cluster.nodes}
        if all(len(pids) >= count for pids in sleeps.values()):
            return sleeps
        assert time.monotonic() < deadline, f"not {count} sleep(s) on every node within {timeout:g}s: {sleeps}"
        time.sleep(0.1)


@pytest.mark.parametrize("fixture", ["slurm_cluster", "slurm_cluster3"])
def test_batch_job_runs_one_task_on_every_node(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    cluster: SlurmCluster = request.getfixturevalue(fixture)
    names = [n.name for n in cluster.nodes]
    out = tmp_path / "out"
    # --mem as rendered jobs ask for it: every node declares the machine's memory (RealMemory).
    job = cluster.sbatch(f"--nodes={len(names)}", "--mem=1G", f"--output={out}",
                         f"--wrap=srun --nodes={len(names)} --ntasks-per-node=1 hostname")
    assert cluster.wait_job(job) == "COMPLETED", out.read_text()
    assert sorted(out.read_text().split()) == names
    assert re.search(rf"^JobId={job} .*JobState=COMPLETED .*ExitCode=0:0", cluster.jobcomp_log.read_text(), re.M)
    cluster.assert_no_job_processes()


def test_tasks_resolve_and_reach_the_other_node(slurm_cluster: SlurmCluster) -> None:
    addresses = {n.name: n.address for n in slurm_cluster.nodes}
    resolved = slurm_cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
                                  "hostname; getent hosts n1 n2"]).stdout
    per_task: dict[str, list[str]] = {}
    for line in resolved.splitlines():
        task, text = line.split(":", 1)
        per_task.setdefault(task, []).append(" ".join(text.split()))
    expected = [f"{addresses['n1']} n1", f"{addresses['n2']} n2"]
    assert sorted((lines[0], lines[1:]) for lines in per_task.values()) == [("n1", expected), ("n2", expected)]
    reached = slurm_cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-c", PROBE]).stdout
    assert sorted(reached.splitlines()) == ["n1 reached n2", "n2 reached n1"]


def test_scancel_leaves_no_task_process(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # Tasks that ignore SIGTERM and one in a session of its own (as torchrun's workers are) end too.
    task = "trap '' TERM; setsid sleep 600 & exec sleep 601"
    job = slurm_cluster.sbatch("--nodes=2", f"--output={tmp_path / 'out'}",
                               f"--wrap=srun --nodes=2 --ntasks-per-node=1 sh -c \"{task}\"")
    try:
        _wait_for_sleeps(slurm_cluster, 2)
        slurm_cluster.run(["scancel", str(job)])
        assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"
        slurm_cluster.assert_no_job_processes(within=30)
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)


def test_teardown_leaves_nothing(tmp_path: Path) -> None:
    reason = missing_support()
    if reason:
        pytest.fail(reason, pytrace=False)
    with SlurmCluster(1) as cluster:
        job = cluster.sbatch("--nodes=1", f"--output={tmp_path / 'out'}", "--wrap=srun sleep 600")
        sleeps = _wait_for_sleeps(cluster, 1)["n1"]
        namespaces = [n.netns for n in cluster.namespaces()]
        daemons = [p.pid for p in (cluster.munged, *(n.daemon for n in cluster.namespaces())) if p is not None]
        pids = daemons + [pid for n in cluster.nodes for pid in cluster.node_pids(n.name)]
        assert cluster.job_state(job) == "RUNNING"
    # Closing stops the job's processes too, although no one cancelled it: slurmd alone would leave them.
    assert set(sleeps) <= set(pids) and len(daemons) == 3
    assert [pid for pid in pids if _alive(pid)] == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    assert not any((Path("/etc/netns") / ns).exists() for ns in namespaces)
    assert subprocess.run(["ip", "link", "show", cluster.bridge], capture_output=True).returncode != 0
    assert cluster.bridge not in subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True,
                                                check=True).stdout
    assert not cluster.dir.exists()
