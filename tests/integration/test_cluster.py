"""The namespace cluster itself: isolated (no way out), connected (hosts reach each other), torn down."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from testbed.cluster import Cluster, missing_support, namespace_cluster

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 22), timeout=3).close(); print('ok')"


def test_hosts_have_no_default_route_and_reach_each_other(cluster3: Cluster) -> None:
    for host in cluster3.hosts:
        routes = cluster3.exec(host, ["ip", "-4", "route", "show"]).stdout
        assert "default" not in routes, routes
        assert routes.strip() == f"{cluster3.prefix}.0/24 dev eth0 proto kernel scope link src {host.address}"
    for source in cluster3.hosts:
        for dest in cluster3.hosts:
            if dest is not source:
                assert cluster3.exec(source, ["python3", "-c", CONNECT, dest.address]).stdout == "ok\n"
    outside = cluster3.exec("h1", ["python3", "-c", CONNECT, "192.0.2.1"], check=False)
    assert "Network is unreachable" in outside.stderr


def test_each_host_has_its_own_hostname_and_hosts_file(cluster3: Cluster) -> None:
    key = ["-i", str(cluster3.client_key), "-o", f"UserKnownHostsFile={cluster3.known_hosts}",
           "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    out = subprocess.run(["ssh", *key, f"root@{cluster3.host('h2').address}", "hostname; getent hosts h3"],
                         capture_output=True, text=True, timeout=20, check=True).stdout.split()
    assert out == ["h2", cluster3.host("h3").address, "h3"]


def test_teardown_removes_everything_also_on_failure() -> None:
    reason = missing_support()
    if reason:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="boom"), namespace_cluster(1) as cluster:
        host = cluster.host("h1")
        sshd_pid = host.sshd.pid if host.sshd else 0
        sleeper = cluster.spawn(host, ["sleep", "300"])
        raise RuntimeError("boom")
    assert host.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert cluster.bridge not in links and host.veth not in links
    assert not Path("/etc/netns", host.netns).exists() and not cluster.dir.exists()
    assert sleeper.poll() is not None
    for pid in (sshd_pid, sleeper.pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    assert cluster.bridge not in rules
