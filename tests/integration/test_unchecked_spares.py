"""When no spare is left, the launch names the hosts that are down and the ones left, and calls none of
them healthy: a spare is only checked once it is planned, so one never planned was never checked."""

from __future__ import annotations

from pathlib import Path

from testbed.cluster import Cluster

from conftest import free_port, harness

CLOSED_PORT = 2223  # no sshd listens there on any namespace host: each connection is refused at once


def test_a_spare_never_checked_is_left_not_healthy(cluster3: Cluster, write_yaml, tmp_path: Path) -> None:
    hosts = cluster3.write_inventory(tmp_path / "hosts.yaml",
                                     overrides={h.name: {"port": CLOSED_PORT} for h in cluster3.hosts})
    job = write_yaml(f"""
        name: spares
        nnodes: 2
        nproc_per_node: 1
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: train.py}}
    """)
    launched = harness("launch", str(job), "--hosts", str(hosts), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert launched.returncode == 1, launched.stderr
    assert ("host(s) down: h1, h2, and no spare left: the job needs nnodes=2 hosts, 1 of the inventory's 3 is left, "
            f"not known to be down (h3); add hosts to {hosts} or lower nnodes") in launched.stderr, launched.stderr
    assert "healthy" not in launched.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, no run directory
    checked = harness("preflight", str(hosts), "--job", str(job), cwd=tmp_path)
    assert checked.returncode == 1 and "not checked: h3" in checked.stdout, checked.stdout
