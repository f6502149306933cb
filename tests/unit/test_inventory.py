"""Host inventory validation: defaults, uniqueness, master, enough hosts."""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.plan.planner import job_hosts
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job

from conftest import REPO, harness

HOSTS = """
defaults:
  user: root
  python: /opt/venv/bin/python
  gpus: 8
master: b
hosts:
  - {name: a, address: 10.1.0.1}
  - {name: b, address: 10.1.0.2, port: 2222}
  - {name: c, address: 10.1.0.3, gpus: 4}
"""


def problems(path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_inventory(path)
    return [str(p) for p in info.value.problems]


def test_defaults_merge_and_master_goes_first(write_yaml):
    inventory = load_inventory(write_yaml(HOSTS, "hosts.yaml"))
    a, b, c = inventory.hosts
    assert (a.user, a.port, a.python, a.gpus) == ("root", 22, "/opt/venv/bin/python", 8)
    assert (b.port, c.gpus) == (2222, 4)
    assert [h.name for h in inventory.ordered_hosts()] == ["b", "a", "c"]


def test_example_inventory_is_valid():
    assert len(load_inventory(REPO / "hosts.example.yaml").hosts) == 3


@pytest.mark.parametrize(
    "text, expected",
    [
        ("hosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: a, address: 10.0.0.2}\n",
         "hosts.yaml:3:6: hosts[1].name: duplicate name 'a' (also hosts[0])"),
        ("hosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.1}\n",
         "hosts.yaml:3:15: hosts[1].address: duplicate address '10.0.0.1' (also hosts[0])"),
        ("master: z\nhosts:\n  - {name: a, address: 10.0.0.1}\n",
         "hosts.yaml:1:1: master: master 'z' is not a host in this inventory; expected one of: a"),
        ("hosts:\n  - {name: a}\n", "hosts.yaml:2:5: hosts[0].address: required key is missing"),
        ("hosts:\n  - {name: a, address: 10.0.0.1, prot: 22}\n",
         "hosts.yaml:2:34: hosts[0].prot: unknown key 'prot' (did you mean 'port'?)"),
        ("defaults: {port: 0}\nhosts:\n  - {name: a, address: 10.0.0.1}\n",
         "hosts.yaml:1:12: defaults.port: Input should be greater than or equal to 1"),
        ("hosts: []\n", "hosts.yaml:1:1: hosts: List should have at least 1 item"),
        ("hosts:\n  - {name: GPU_1, address: 10.0.0.1}\n", "hosts.yaml:2:5: hosts[0]: host name must be a DNS-1123 label"),
        ("defaults: {interface: a-very-long-interface}\nhosts:\n  - {name: a, address: 10.0.0.1}\n",
         "hosts.yaml:1:12: defaults.interface: expected a network interface name such as eth1 or ib0"),
        ("hosts:\n  - {name: a, address: 10.0.0.1, interface: eth0/1}\n",
         "hosts.yaml:2:34: hosts[0].interface: expected a network interface name"),
    ],
)
def test_bad_inventory_is_located(write_yaml, text, expected):
    found = problems(write_yaml(text, "hosts.yaml"))
    assert any(expected in p for p in found), found


def test_fewer_hosts_than_nnodes(write_yaml):
    spec = load_job(write_yaml("name: big\nnnodes: 4\nentrypoint: {module: m}\n"))
    inventory = load_inventory(write_yaml(HOSTS, "hosts.yaml"))
    with pytest.raises(SpecError, match=r"hosts.yaml:\d+:1: hosts: the job needs nnodes=4 hosts but the inventory lists 3"):
        job_hosts(spec, inventory)


def test_cli_reports_inventory_errors_with_exit_2(write_yaml):
    job = write_yaml("name: big\nnnodes: 2\nentrypoint: {module: m}\n")
    hosts = write_yaml("hosts:\n  - {name: a, address: 10.0.0.1}\n", "hosts.yaml")
    result = harness("render", str(job), "--hosts", str(hosts))
    assert result.returncode == 2
    assert "needs nnodes=2 hosts but the inventory lists 1" in result.stderr
