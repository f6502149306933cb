"""The interface gloo and NCCL use, on hosts with several: management eth0, data eth1, extra0 (routes
nowhere, first in index order) and Debian's `127.0.1.1 <hostname>` (cluster.py, multi_nic)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from harness.preflight.runner import run_preflight
from harness.preflight.table import Check, Report, Status
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job
from testbed.cluster import Cluster

from conftest import BY_HAND_TMPDIR, SCRIPT, assert_nothing_left, ddp_job, free_port


def _ssh_args(cluster: Cluster, tmp_path: Path, **inventory: Any) -> list[str]:
    hosts = cluster.write_inventory(tmp_path / "hosts.yaml", **inventory)
    return ["--hosts", str(hosts), "--known-hosts", str(cluster.known_hosts)]


def _preflight(cluster: Cluster, job: Path | None, tmp_path: Path, **inventory: Any) -> Report:
    hosts = load_inventory(cluster.write_inventory(tmp_path / "hosts.yaml", **inventory))
    return run_preflight(hosts, load_job(job) if job else None, known_hosts=cluster.known_hosts, fast=True)


def _row(report: Report, host: str, check: str) -> Check:
    return next(c for c in report.checks if c.host == host and c.name == check)


def _with_data_network(job: Path) -> Path:
    spec = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump(spec | {"network": {"interface": "eth1"}}, sort_keys=False))
    return job


def _end_sessions(cluster: Cluster, started: list[subprocess.Popen[bytes]]) -> None:
    """Everything the test started on the hosts (torchrun puts its workers in sessions of their own)."""
    for host in cluster.hosts:
        assert host.sshd is not None
        for pid in cluster.pids(host):
            if pid != host.sshd.pid:
                os.kill(pid, signal.SIGKILL)
    for process in started:
        process.wait(timeout=10)
    cluster.assert_only_sshd_left()


def test_torchrun_by_hand_fails_on_its_defaults_and_the_harness_launch_succeeds(multi_nic_cluster2, write_yaml,
                                                                                 launch, tmp_path):
    cluster = multi_nic_cluster2
    port = str(free_port())
    started = []
    for rank, host in enumerate(cluster.hosts):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                    f"--master-addr={cluster.hosts[0].address}", f"--master-port={port}", "--nproc-per-node=1",
                    str(SCRIPT)]
        with (tmp_path / f"by-hand-{host.name}.log").open("wb") as log:
            started.append(subprocess.Popen(cluster.login(host, torchrun), stdout=log, stderr=subprocess.STDOUT,
                                            env=os.environ | {"STEPS": "5", "TMPDIR": BY_HAND_TMPDIR}, start_new_session=True))
    try:
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = [(host, p.returncode) for host, p in zip(cluster.hosts, started, strict=True) if p.returncode is not None]
    finally:
        _end_sessions(cluster, started)
    assert ended and all(code != 0 for _, code in ended), ended
    said = (tmp_path / f"by-hand-{ended[0][0].name}.log").read_text()
    # gloo advertised what the hostname resolves to; the peer connected to its own loopback.
    assert re.search(r"Gloo connectFullMesh failed .*Connection refused, remote=\[127\.0\.1\.1\]", said), said

    run = launch(ddp_job(write_yaml, STEPS="5"), *_ssh_args(cluster, tmp_path))
    assert run.finish(timeout=180) == 0, run.output
    assert re.search(r"\[node1\] \[rank1\]: rank 1/2 up on h2;", run.output), run.output
    plan = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())
    for node in plan["nodes"]:
        assert node["interface"] == "eth0"
        assert (node["env"]["GLOO_SOCKET_IFNAME"], node["env"]["NCCL_SOCKET_IFNAME"]) == ("eth0", "=eth0")
    assert_nothing_left(run.run_id)


def test_preflight_names_the_interface_and_why_the_defaults_fail(multi_nic_cluster2, tmp_path):
    """Without a job both libraries count: gloo's hostname is loopback, NCCL's first interface routes nowhere."""
    cluster = multi_nic_cluster2
    report = _preflight(cluster, None, tmp_path)
    assert report.ok, report.render_table()
    assert report.interfaces == {"h1": "eth0", "h2": "eth0"}
    for host, peer in (("h1", "h2"), ("h2", "h1")):
        row = _row(report, host, "interface")
        assert row.reason == (f"eth0 {cluster.host(host).address}, mtu 1500, same on all hosts (the kernel routes to "
                              f"{peer} through it); GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME pinned to it")
        defaults = _row(report, host, "defaults")
        assert defaults.status is Status.WARN
        extra = f"10.250.0.{11 if host == 'h1' else 12}"
        assert defaults.reason == (f"torchrun's defaults fail here: gloo advertises 127.0.1.1 (what its hostname "
                                   f"{host} resolves to): loopback, so each peer connects to itself; NCCL takes "
                                   f"extra0 {extra}: unreachable from {peer} (no route)")
        assert defaults.fix == ("none needed: the harness pins eth0; torchrun by hand needs GLOO_SOCKET_IFNAME=eth0 "
                                "NCCL_SOCKET_IFNAME==eth0")
    assert re.search(r"^h1 +interface +PASS +eth0 ", report.render_table(), re.M), report.render_table()


def test_cut_data_network_fails_preflight_and_the_launch_while_ssh_still_works(multi_nic_cluster2, write_yaml,
                                                                               launch, tmp_path):
    cluster = multi_nic_cluster2
    h1, h2 = cluster.host("h1"), cluster.host("h2")
    job = _with_data_network(ddp_job(write_yaml, STEPS="5"))
    report = _preflight(cluster, job, tmp_path)
    assert report.ok, report.render_table()
    assert _row(report, "h2", "interface").reason == (
        f"eth1 {h2.data_address}, mtu 1500, same on all hosts (from the job's network.interface); "
        f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME pinned to it")
    assert re.fullmatch(rf"ephemeral port \d+ on eth1 {h2.data_address} reached from h1, 1500-byte frames too",
                        _row(report, "h2", "data_plane").reason)

    with cluster.firewall("h2", "-s", str(h1.data_address), "-j", "DROP"):
        report = _preflight(cluster, job, tmp_path)
        run = launch(job, *_ssh_args(cluster, tmp_path))
        assert run.finish(timeout=120) == 1, run.output
    row = _row(report, "h2", "data_plane")
    assert row.status is Status.FAIL
    assert re.fullmatch(rf"h1 -> h2 eth1 {h2.data_address}:\d+ timed out after 3s \(a firewall drops the packets\)",
                        row.reason), row.reason
    assert row.fix.startswith("check the eth1 network between these hosts and allow tcp")
    assert _row(report, "h1", "data_plane").reason.startswith(f"h2 -> h1 eth1 {h1.data_address}:")
    assert _row(report, "h2", "master_port").status is Status.PASS  # the management network still works
    assert {c.name for c in report.failures} == {"data_plane"}
    assert "preflight failed, nothing was started" in run.output
    assert re.search(rf"h2 +data_plane +FAIL +h1 -> h2 eth1 {re.escape(str(h2.data_address))}:\d+ timed out",
                     run.output), run.output
    assert not run.runs_dir.exists() or not any(run.runs_dir.iterdir())  # no run was recorded
    cluster.assert_only_sshd_left()


def test_an_interface_a_host_lacks_is_named_with_what_it_has(multi_nic_cluster2, write_yaml, tmp_path):
    cluster = multi_nic_cluster2
    job = _with_data_network(ddp_job(write_yaml))
    report = _preflight(cluster, job, tmp_path, overrides={"h2": {"interface": "ib0"}})
    assert [(c.host, c.name) for c in report.failures] == [("h2", "interface")]
    row = report.failures[0]
    assert row.reason == (f"ib0 (from h2's `interface:` in the inventory) does not exist on h2; it has extra0 "
                          f"10.250.0.12, eth1 {cluster.host('h2').data_address}, eth0 {cluster.host('h2').address}")
    assert row.fix == "name an interface h2 has in h2's `interface:` in the inventory"
    assert report.interfaces == {"h1": "eth1"}


@contextlib.contextmanager
def jumbo(cluster: Cluster, *hosts: str) -> Iterator[None]:
    """These hosts' data interface at MTU 9000; the bridge ports (and the other hosts) stay at 1500."""
    try:
        for host in hosts:
            cluster.exec(host, ["ip", "link", "set", "dev", "eth1", "mtu", "9000"])
        yield
    finally:
        for host in hosts:
            cluster.exec(host, ["ip", "link", "set", "dev", "eth1", "mtu", "1500"], check=False)


FRAMES_LOST = "9000-byte frames (don't fragment) lost while small packets arrive: the path's MTU is below the interface's"


def test_mtu_mismatch_on_the_data_network_is_reported_and_its_frames_proved_lost(multi_nic_cluster2, write_yaml,
                                                                                  tmp_path):
    cluster = multi_nic_cluster2
    h1, h2 = cluster.host("h1"), cluster.host("h2")
    with jumbo(cluster, "h2"):
        report = _preflight(cluster, _with_data_network(ddp_job(write_yaml)), tmp_path)
    row = _row(report, "h2", "interface")
    assert row.status is Status.WARN
    assert row.reason == (f"eth1 {h2.data_address}, mtu 9000, but h1 uses mtu 1500: frames above 1500 bytes are "
                          f"dropped where the path is narrower (TCP gets by on its MSS; RDMA and UDP traffic hangs)")
    assert row.fix == ("one MTU on the whole data path: `ip link set dev eth1 mtu 1500` on h2 (or raise it on every "
                       "host and switch port)")
    assert _row(report, "h1", "interface").status is Status.PASS
    assert [(c.host, c.name) for c in report.failures] == [("h1", "data_plane")]
    assert report.failures[0].reason == f"h2 -> h1 eth1 {h1.data_address}: {FRAMES_LOST}"
    assert report.failures[0].fix.startswith("one MTU along the whole data path")
    assert _row(report, "h2", "data_plane").reason.endswith("reached from h1, 1500-byte frames too")


def test_jumbo_frames_the_switch_does_not_carry_fail_although_the_hosts_agree(multi_nic_cluster2, write_yaml,
                                                                             tmp_path):
    """Both hosts at 9000, the bridge between them at 1500: a black hole no MTU comparison sees."""
    cluster = multi_nic_cluster2
    with jumbo(cluster, "h1", "h2"):
        report = _preflight(cluster, _with_data_network(ddp_job(write_yaml)), tmp_path)
    assert {_row(report, h, "interface").status for h in ("h1", "h2")} == {Status.PASS}
    assert [(c.host, c.name) for c in report.failures] == [("h1", "data_plane"), ("h2", "data_plane")]
    for source, dest in (("h2", "h1"), ("h1", "h2")):
        assert _row(report, dest, "data_plane").reason == (
            f"{source} -> {dest} eth1 {cluster.host(dest).data_address}: {FRAMES_LOST}")
