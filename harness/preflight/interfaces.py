"""The network interface gloo and NCCL use on every host: the pin, its MTU, and what their defaults would do.

Pure: verdicts from the probes' facts (probe._network: every interface in index order, the kernel's
route to every host) and from the data plane's real connections (ports.py). Unpinned, gloo advertises
the address its hostname resolves to (Debian maps it to 127.0.1.1, so peers connect to themselves:
pytorch#15592) and NCCL takes an ib* interface, else the first that is not lo, docker* or virbr*,
whether or not it reaches the peers. The harness pins one interface per host instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.node.probe import Facts, Interface, Network
from harness.plan.planner import pinned_interface
from harness.preflight.checks import majority
from harness.preflight.table import Check, Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.targets.address import is_loopback

NCCL_PASSED_OVER = ("docker", "lo", "virbr")
ROUTE = "route"

# source -> target id -> netcheck's result for it (ports.network_checks)
Reached = Mapping[str, Mapping[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class Pin:
    """The interface a host's collectives use, and the address peers reach it at."""

    host: str
    interface: str
    address: str
    mtu: int
    why: str

    @property
    def label(self) -> str:
        return f"{self.interface} {self.address}"


def extra_target(dest: str, address: str) -> str:
    """The data plane's target id for one more address of dest (a default's), next to its pinned one."""
    return f"{dest}@{address}"


def _listing(interfaces: list[Interface]) -> str:
    return ", ".join(f"{i['name']} {i['addresses'][0]}" for i in interfaces if i["addresses"] and not i["loopback"]) \
        or "no addressed interface but lo"


def _explicit(host: Host, spec: JobSpec | None) -> tuple[str, str] | None:
    """The interface the inventory or the job names for host (plan.pinned_interface decides), and where."""
    name = host.interface if spec is None else pinned_interface(spec, host, {})
    if name is None:
        return None
    return name, f"{host.name}'s `interface:` in the inventory" if host.interface else "the job's network.interface"


def _choose(host: Host, network: Network, spec: JobSpec | None, peers: list[str]) -> Pin | Check:
    """The pinned interface (inventory, job) or the one the kernel routes every peer through."""
    interfaces = network["interfaces"]
    by_name = {i["name"]: i for i in interfaces}
    explicit = _explicit(host, spec)
    if explicit is not None:
        name, where = explicit
        found = by_name.get(name)
        fix = (f"name an interface {host.name} has in {where}" + ("" if host.interface else
               f", or give {host.name} its own with `interface:` in the inventory"))
        if found is None:
            return Check(host.name, "interface", Status.FAIL, f"{name} (from {where}) does not exist on {host.name}; "
                         f"it has {_listing(interfaces)}", fix)
        if not found["up"] or not found["addresses"]:
            state = "is down" if not found["up"] else "has no address"
            return Check(host.name, "interface", Status.FAIL, f"{name} (from {where}) {state} on {host.name}",
                         f"`ip link set {name} up` and give it an address on the data network, or {fix}")
        return Pin(host.name, name, found["addresses"][0], found["mtu"], f"from {where}")
    routes = network["routes"]
    problems = [f"no route to {peer} {routes[peer]['address']} ({routes[peer]['error']})"
                for peer in peers if "error" in routes[peer]]
    if problems:
        return Check(host.name, "interface", Status.FAIL, "; ".join(problems),
                     f"give {host.name} a route to every host of the job, or set network.interface")
    through: dict[str | None, list[str]] = {}
    for peer in peers:
        through.setdefault(routes[peer]["interface"], []).append(peer)
    if len(through) > 1 or None in through:
        ways = "; ".join(f"to {', '.join(names)} through {name or 'an interface without that source address'}"
                         for name, names in through.items())
        return Check(host.name, "interface", Status.FAIL,
                     f"the kernel routes {ways}: gloo and NCCL use one interface for every peer",
                     "set network.interface (or `interface:` per host) to the interface of the network all hosts "
                     "share")
    routed = next(iter(through))
    assert routed is not None
    found = by_name[routed]
    return Pin(host.name, routed, found["addresses"][0], found["mtu"], f"the kernel routes to {', '.join(peers)} "
               f"through it")


def interface_checks(facts: dict[str, Facts], hosts: list[Host], spec: JobSpec | None,
                     pins: bool) -> tuple[list[Check], dict[str, Pin]]:
    """One `interface` row per host: the interface chosen (or why none can be), and its MTU against
    the others'. pins: whether the launch pins what is chosen (SSH) or only reports it (srun)."""
    names = [h.name for h in hosts]
    if len(names) < 2:
        return [Check(h.name, "interface", Status.SKIP, "one host: no peer to reach") for h in hosts
                if h.name in facts], {}
    rows: list[Check] = []
    chosen: dict[str, Pin] = {}
    for host in hosts:
        if host.name not in facts:
            continue
        network = facts[host.name]["network"]
        if "error" in network:
            rows.append(Check(host.name, "interface", Status.FAIL, network["error"], "see the probe's error"))
            continue
        result = _choose(host, network, spec, [n for n in names if n != host.name])
        if isinstance(result, Check):
            rows.append(result)
        else:
            chosen[host.name] = result
    reference = majority([str(p.mtu) for p in chosen.values()], str(chosen[names[0]].mtu) if names[0] in chosen
                         else None) if chosen else ""
    action = "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME pinned to it" if pins else \
        "set network.interface to pin it"
    for pin in chosen.values():
        if str(pin.mtu) == reference:
            same = ", same on all hosts" if len({p.mtu for p in chosen.values()}) == 1 else ""
            rows.append(Check(pin.host, "interface", Status.PASS, f"{pin.label}, mtu {pin.mtu}{same} ({pin.why}); "
                              f"{action}", None, {"interface": pin.interface, "address": pin.address, "mtu": pin.mtu}))
            continue
        others = sorted(p.host for p in chosen.values() if str(p.mtu) == reference)
        smaller = min(pin.mtu, int(reference))
        rows.append(Check(pin.host, "interface", Status.WARN,
                          f"{pin.label}, mtu {pin.mtu}, but {', '.join(others)} {'use' if len(others) > 1 else 'uses'} "
                          f"mtu {reference}: frames above "
                          f"{smaller} bytes are dropped where the path is narrower (TCP gets by on its MSS; RDMA "
                          f"and UDP traffic hangs)",
                          f"one MTU on the whole data path: `ip link set dev {pin.interface} mtu {reference}` on "
                          f"{pin.host} (or raise it on every host and switch port)",
                          {"interface": pin.interface, "address": pin.address, "mtu": pin.mtu}))
    return rows, chosen


def _pinned_host_interfaces(facts: Facts) -> list[Interface]:
    """The interfaces of a host with a pin: one is chosen only where the probe could list them."""
    network = facts["network"]
    assert "interfaces" in network
    return network["interfaces"]


def _gloo_default(facts: Facts) -> tuple[str, str]:
    """The address gloo binds without GLOO_SOCKET_IFNAME: the first the hostname resolves to that is this
    host's own (or any loopback one), else loopback."""
    local = {a for i in _pinned_host_interfaces(facts) for a in i["addresses"]}
    resolved = facts["self_resolves"]
    for address in resolved if isinstance(resolved, list) else []:
        if address in local or is_loopback(address):
            return address, f"gloo advertises {address} (what its hostname {facts['hostname']} resolves to)"
    return "127.0.0.1", f"gloo falls back to loopback (its hostname {facts['hostname']} resolves to no own address)"


def _nccl_default(facts: Facts) -> tuple[str, str] | None:
    """The address NCCL takes without NCCL_SOCKET_IFNAME: ib*, else the first interface not passed over."""
    addressed = [i for i in _pinned_host_interfaces(facts) if i["addresses"]]
    for test in (lambda n: n.startswith("ib"), lambda n: not n.startswith(NCCL_PASSED_OVER),
                 lambda n: n.startswith("docker"), lambda n: n.startswith("lo")):
        found = next((i for i in addressed if test(i["name"])), None)
        if found is not None:
            return found["addresses"][0], f"NCCL takes {found['name']} {found['addresses'][0]}"
    return None


def _defaults(facts: Facts, backend: str | None, env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(address, what takes it) for each library this job's collectives use, unless the job's env pins it."""
    found = []
    if "GLOO_SOCKET_IFNAME" not in env:
        found.append(_gloo_default(facts))
    if backend != "gloo" and "NCCL_SOCKET_IFNAME" not in env and (nccl := _nccl_default(facts)) is not None:
        found.append(nccl)
    return found


def default_targets(facts: dict[str, Facts], chosen: Mapping[str, Pin], backend: str | None,
                    spec: JobSpec | None) -> dict[str, list[str]]:
    """Per host, the addresses its peers should also try to reach: the defaults' that differ from the pin."""
    env = spec.env if spec is not None else {}
    return {host: sorted({address for address, _ in _defaults(facts[host], backend, env)
                          if not is_loopback(address) and address != chosen[host].address})
            for host in chosen}


def defaults_checks(facts: dict[str, Facts], chosen: Mapping[str, Pin], reached: Reached, backend: str | None,
                    spec: JobSpec | None, pins: bool) -> list[Check]:
    """Per host: would torchrun's defaults (hostname for gloo, interface order for NCCL) reach the peers?
    A warning where the harness pins the interface anyway, a failure where it does not."""
    env = spec.env if spec is not None else {}
    rows = []
    for host, pin in chosen.items():
        problems = []
        for address, what in _defaults(facts[host], backend, env):
            if is_loopback(address):
                problems.append(f"{what}: loopback, so each peer connects to itself")
            elif address != pin.address:
                failed = [f"{source} ({results[extra_target(host, address)]['status'].replace('_', ' ')})"
                          for source, results in reached.items()
                          if source != host and results.get(extra_target(host, address), {}).get("status") != "ok"]
                if failed:
                    problems.append(f"{what}: unreachable from {', '.join(failed)}")
        if not problems:
            rows.append(Check(host, "defaults", Status.PASS, f"unpinned, gloo and NCCL would also reach the peers "
                              f"({pin.interface})"))
            continue
        by_hand = f"GLOO_SOCKET_IFNAME={pin.interface} NCCL_SOCKET_IFNAME=={pin.interface}"
        rows.append(Check(host, "defaults", Status.WARN if pins else Status.FAIL,
                          "torchrun's defaults fail here: " + "; ".join(problems),
                          (f"none needed: the harness pins {pin.interface}; torchrun by hand needs {by_hand}" if pins
                           else f"set network.interface: {pin.interface} (or {by_hand} in the job's env)")))
    return rows
