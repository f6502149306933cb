"""The interface verdicts from probe facts (pure), and the pin in plans and their rendering."""

from __future__ import annotations

from typing import Any

from harness.plan.planner import plan_hosts
from harness.plan.render import render_text
from harness.preflight.interfaces import defaults_checks, interface_checks
from harness.preflight.table import Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.targets.k8s.manifests import render_manifests
from harness.targets.slurm.batch import batch_script

HOSTS = [Host(name="a", address="10.0.0.1"), Host(name="b", address="10.0.0.2"), Host(name="c", address="10.0.0.3")]


def _job(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "nnodes": 3, "master_port": 29500, "entrypoint": {"script": "t.py"}}
                                  | fields)


def _facts(routes: dict[str, dict[str, Any]], interfaces: list[tuple[str, str, int]] | None = None,
           resolves: list[str] | str | None = None) -> dict[str, Any]:
    listed = [("lo", "127.0.0.1", 65536), *(interfaces or [("eth0", "10.0.0.1", 1500)])]
    return {
        "hostname": "a",
        "self_resolves": resolves if resolves is not None else ["10.0.0.1"],
        "network": {"interfaces": [{"name": n, "index": i, "up": True, "loopback": n == "lo", "mtu": mtu,
                                    "addresses": [a] if a else []} for i, (n, a, mtu) in enumerate(listed, 1)],
                    "routes": routes},
    }


def _via(interface: str, source: str, *peers: str) -> dict[str, dict[str, Any]]:
    return {p: {"address": f"10.0.0.{ord(p) - 96}", "source": source, "interface": interface} for p in peers}


def test_peers_routed_through_different_interfaces_fail_with_both_named():
    facts = {"a": _facts(_via("eth0", "10.0.0.1", "b") | _via("eth1", "10.1.0.1", "c"),
                         [("eth0", "10.0.0.1", 1500), ("eth1", "10.1.0.1", 1500)])}
    rows, chosen = interface_checks(facts, HOSTS, _job(), pins=True)
    assert chosen == {}
    assert (rows[0].status, rows[0].reason) == (
        Status.FAIL, "the kernel routes to b through eth0; to c through eth1: gloo and NCCL use one interface for "
                     "every peer")


def test_no_route_to_a_peer_is_named():
    routes = _via("eth0", "10.0.0.1", "b") | {"c": {"address": "10.0.0.3", "error": "Network is unreachable"}}
    rows, _ = interface_checks({"a": _facts(routes)}, HOSTS, _job(), pins=True)
    assert rows[0].reason == "no route to c 10.0.0.3 (Network is unreachable)"


def test_a_named_interface_that_is_down_fails_and_the_job_name_loses_to_the_inventory():
    facts = _facts(_via("eth0", "10.0.0.1", "b", "c"), [("eth0", "10.0.0.1", 1500), ("ib0", "10.2.0.1", 2044)])
    facts["network"]["interfaces"][2]["up"] = False
    rows, _ = interface_checks({"a": facts}, HOSTS, _job(network={"interface": "ib0"}), pins=True)
    assert (rows[0].status, rows[0].reason) == (Status.FAIL, "ib0 (from the job's network.interface) is down on a")
    hosts = [HOSTS[0].model_copy(update={"interface": "eth0"}), *HOSTS[1:]]
    rows, chosen = interface_checks({"a": facts}, hosts, _job(network={"interface": "ib0"}), pins=True)
    assert chosen["a"].label == "eth0 10.0.0.1" and rows[0].status is Status.PASS


def test_defaults_gloo_falls_back_to_loopback_and_nccl_prefers_ib_then_passes_over_docker_and_virbr():
    routes = _via("eth0", "10.0.0.1", "b", "c")
    interfaces = [("docker0", "172.17.0.1", 1500), ("virbr0", "192.168.122.1", 1500), ("eth0", "10.0.0.1", 1500)]
    facts = {"a": _facts(routes, [*interfaces, ("ib0", "10.3.0.1", 2044)], resolves=["10.9.9.9"])}
    _, chosen = interface_checks(facts, HOSTS, None, pins=False)
    reached = {"b": {"a@10.3.0.1": {"status": "timeout"}}, "c": {"a@10.3.0.1": {"status": "ok"}}}
    row = defaults_checks(facts, chosen, reached, None, None, pins=False)[0]
    assert row.status is Status.FAIL
    assert row.reason == ("torchrun's defaults fail here: gloo falls back to loopback (its hostname a resolves to no "
                          "own address): loopback, so each peer connects to itself; NCCL takes ib0 10.3.0.1: "
                          "unreachable from b (timeout)")
    assert row.fix == "set network.interface: eth0 (or GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME==eth0 in the job's env)"
    facts = {"a": _facts(routes, interfaces)}  # no ib*: NCCL takes eth0, the pinned one; the hostname is eth0's
    row = defaults_checks(facts, chosen, {}, None, None, pins=False)[0]
    assert (row.status, row.reason) == (Status.PASS, "unpinned, gloo and NCCL would also reach the peers (eth0)")


def test_the_pin_is_in_the_env_and_in_the_rendered_plan():
    spec = _job(nnodes=2, env={"NCCL_SOCKET_IFNAME": "ib"})
    hosts = [HOSTS[0], HOSTS[1].model_copy(update={"interface": "eth1"})]
    found = plan_hosts(spec, hosts, run_id="r", master_ip="10.0.0.1", interfaces={"a": "eth0", "b": "eth7"})
    a, b = found.nodes
    assert (a.interface, a.env["GLOO_SOCKET_IFNAME"], b.interface, b.env["GLOO_SOCKET_IFNAME"]) == \
        ("eth0", "eth0", "eth1", "eth1")
    assert a.env["NCCL_SOCKET_IFNAME"] == "ib"  # the job's own env wins
    assert "# node1 on b (10.0.0.2): node_rank 1, global ranks 1; gloo and NCCL on eth1" in render_text(found)
    unpinned = render_text(plan_hosts(spec, hosts[:1] + HOSTS[1:2], run_id="r", master_ip="10.0.0.1"))
    assert "global ranks 0; gloo and NCCL on the interface that routes to the peers (found by preflight at " \
           "launch)" in unpinned
    assert "GLOO_SOCKET_IFNAME" not in unpinned


def test_the_job_interface_reaches_kubernetes_pods_and_slurm_nodes():
    spec = _job(network={"interface": "eth1"}, image="registry/harness:1")
    manifests = "\n".join(str(doc) for doc in render_manifests(spec, "", "core", code={}, supervised=False))
    assert "{'name': 'GLOO_SOCKET_IFNAME', 'value': 'eth1'}" in manifests
    assert "{'name': 'NCCL_SOCKET_IFNAME', 'value': '=eth1'}" in manifests
    script = batch_script(spec, "job.yaml")
    assert "export GLOO_SOCKET_IFNAME=eth1\n" in script and "export NCCL_SOCKET_IFNAME==eth1\n" in script
    assert "SOCKET_IFNAME" not in batch_script(_job(), "job.yaml")
