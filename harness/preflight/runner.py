"""run_preflight: connect to every host at once, probe, compare, test the network, optionally all_reduce.

One SSH connection per host serves every check on it. Phases run on all hosts in parallel and
each has a deadline: connect and network steps `timeout`, the probe `timeout` but at least 10 s (fast)
or 6 x `timeout` (full: it imports torch), the collective 6 x `timeout`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from harness.plan.planner import TORCHRUN_PORT, job_hosts
from harness.preflight.batch_job import batch_job_checks
from harness.preflight.checks import (
    data_checks,
    fingerprint_checks,
    job_backend,
    resolve_checks,
    resource_checks,
    stacks_check,
)
from harness.preflight.collective import collective_checks
from harness.preflight.image import InImage, image_checks
from harness.preflight.interfaces import default_targets, defaults_checks, interface_checks
from harness.preflight.local import probe_host
from harness.preflight.ports import network_checks
from harness.preflight.remote import Link, on_hosts
from harness.preflight.subprocess_link import srun_link
from harness.preflight.table import Check, Report, Status
from harness.spec.inventory import Host, Inventory
from harness.spec.job import JobSpec
from harness.targets.address import is_loopback
from harness.targets.host_command import NoFreePort, RemoteTimeout, free_port_on
from harness.targets.slurm.srun import Allocation
from harness.targets.ssh.transport import Connection, SSHConnectError, connect


def hosts_for(inventory: Inventory, spec: JobSpec | None) -> list[Host]:
    """The hosts the job runs on (master first), or every host when there is no job."""
    return inventory.ordered_hosts() if spec is None else job_hosts(spec, inventory)


def _master_port(spec: JobSpec | None, master: Link | None, timeout: float) -> int | Check:
    """The port to test: the job's; for master_port auto one that the master picks as a launch does (a
    row when it cannot); torchrun's default without a job."""
    if spec is not None and spec.master_port != "auto":
        return spec.master_port
    if spec is None or master is None:
        return TORCHRUN_PORT
    try:
        return free_port_on(master, timeout)
    except (NoFreePort, RemoteTimeout) as exc:
        return Check(master.host.name, "master_port", Status.FAIL, str(exc), "see the fingerprint row: the host's "
                                                                            "python must run")


def _ssh_row(host: Host, result: Connection | Exception) -> Check:
    if isinstance(result, SSHConnectError):
        return Check(host.name, "ssh", Status.FAIL, result.reason, result.fix, {"kind": result.kind})
    if isinstance(result, Exception):
        return Check(host.name, "ssh", Status.FAIL, f"{type(result).__name__}: {result}", None, {"kind": "error"})
    key = (f"new host key {result.new_host_key} added to known_hosts" if result.new_host_key
           else "host key verified")
    user = host.user or result.transport.get_username()
    return Check(host.name, "ssh", Status.PASS, f"{user}@{host.address}:{host.port} in {result.seconds:.2f}s, {key}")


def run_preflight(inventory: Inventory, spec: JobSpec | None = None, *, known_hosts: Path | str | None = None,
                  accept_new_host_keys: bool = False, collective: bool = False, fast: bool = False,
                  timeout: float = 10.0, connections: dict[str, Connection] | None = None) -> Report:
    """Check that the hosts can run the job. fast: only what is cheap before every launch (no torch
    import, no collective). The Report says per host and check: pass, warn, fail or skip, and why.
    connections: a launch's own, open (its gate): reused where a host has one, each connection opened
    here added to it and left open for the nodes; without it, every connection is closed at the end."""
    started = time.monotonic()
    hosts = hosts_for(inventory, spec)
    unused = [h.name for h in inventory.hosts if h not in hosts]
    by_name = {h.name: h for h in hosts}
    master = inventory.master_host()
    report = Report(
        hosts=[{"name": h.name, "address": h.address, "master": h.name == master.name} for h in hosts],
        job=({"name": spec.name, "backend": spec.backend, "nnodes": spec.nnodes, "master_port": spec.master_port}
             if spec else None),
    )

    def attempt(name: str) -> Connection | Exception:
        if connections is not None and name in connections:
            return connections[name]
        try:
            return connect(by_name[name], known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys,
                           timeout=timeout)
        except SSHConnectError as exc:
            return exc

    if unused:
        report.notes.append(f"not checked: {', '.join(unused)} (the job runs on {len(hosts)} hosts)")
    if collective and fast:
        report.notes.append("collective not run: fast mode")
    attempts = on_hosts(attempt, by_name)
    opened = {name: result for name, result in attempts.items() if isinstance(result, Connection)}
    try:
        for name, result in attempts.items():
            report.checks.append(_ssh_row(by_name[name], result))
        run_collective = (lambda: collective_checks(opened, inventory, spec, timeout=timeout,
                                                    interfaces=report.interfaces)) \
            if collective and not fast else None
        _checks(report, opened, inventory, master, spec, collective=run_collective, fast=fast, timeout=timeout,
                pins=True)
    finally:
        if connections is None:
            for connection in opened.values():
                connection.close()
        else:
            connections.update(opened)
    _by_host(report, hosts)
    report.seconds = time.monotonic() - started
    return report


def _by_host(report: Report, hosts: list[Host]) -> None:
    order = {h.name: i for i, h in enumerate(hosts)}
    report.checks.sort(key=lambda c: order[c.host])  # stable: checks keep their phase order per host


def run_preflight_srun(allocation: Allocation, spec: JobSpec | None = None, *, timeout: float = 10.0,
                       runs: Path | None = None) -> Report:
    """The same checks between the nodes of the Slurm allocation this runs in, each command an srun step
    (no SSH, no inventory): the job's nodes, or every node without a job. No collective yet. runs: the
    runs directory a batch job of `harness launch --target slurm` would use, checked on every node."""
    started = time.monotonic()
    if spec is not None and (error := allocation.too_small(spec.nnodes)) is not None:
        raise error
    names = allocation.nodes[: spec.nnodes] if spec is not None else allocation.nodes
    hosts = allocation.hosts(names, spec)
    inventory = Inventory(path=f"Slurm allocation {allocation.job_id}", hosts=hosts, master=hosts[0].name)
    report = Report(
        hosts=[{"name": h.name, "address": h.address, "master": i == 0} for i, h in enumerate(hosts)],
        job=({"name": spec.name, "backend": spec.backend, "nnodes": spec.nnodes, "master_port": spec.master_port}
             if spec else None),
    )
    if unused := allocation.nodes[len(names):]:
        report.notes.append(f"not checked: {', '.join(unused)} (the job runs on {len(names)} nodes)")
    report.notes.append(f"inside Slurm allocation {allocation.job_id}: every check ran as an srun step")
    links = {h.name: srun_link(allocation, h) for h in hosts}
    _checks(report, links, inventory, hosts[0], spec, collective=None, fast=False, timeout=timeout, pins=False)
    if runs is not None:
        report.checks += batch_job_checks(links, runs, timeout)
    _by_host(report, hosts)
    report.seconds = time.monotonic() - started
    return report


def _checks(report: Report, connections: Mapping[str, Link], inventory: Inventory, master: Host,
            spec: JobSpec | None, *, collective: Callable[[], list[Check]] | None, fast: bool,
            timeout: float, pins: bool) -> None:
    """Every check on the linked hosts (master first). pins: whether the launch pins the interface found
    (SSH) or only reports it (inside a Slurm allocation)."""
    probe_links: Mapping[str, Link] = connections
    in_image = spec is not None and spec.container is not None
    fix = "set `python:` in the inventory to an interpreter that runs on the host"
    if spec is not None and spec.container is not None:
        rows, ready = image_checks(connections, spec, master.name, timeout)
        report.checks += rows
        probe_links = {name: InImage(connections[name], spec, i) for i, name in enumerate(ready)}
        fix = f"`{spec.container.engine} run --rm --entrypoint python {spec.image} --version` on the host says why"
    addresses = {name: connection.peer_ip for name, connection in connections.items()}
    # A container job's probe runs in the image, but its stack check on the host: the node agent runs there.
    probed = on_hosts(lambda name: probe_host(probe_links[name], master, spec, fast, timeout, addresses,
                                              host_link=connections[name] if in_image else None), probe_links)
    facts = {name: answer for name, answer in probed.items() if isinstance(answer, dict)}
    for name, answer in probed.items():
        if not isinstance(answer, dict):
            report.checks.append(Check(name, "fingerprint", Status.FAIL, f"probe failed: {answer}", fix))
    report.facts = facts
    rows, report.fingerprint, report.mismatched = fingerprint_checks(facts, master.name)
    report.checks += rows
    backend = job_backend(spec, facts)
    hosts = {h.name: h for h in inventory.hosts}
    for name, found in facts.items():
        report.checks += [*resource_checks(hosts[name], found, spec, backend), stacks_check(name, found)]
    report.checks += resolve_checks(facts, master, one_machine=all(is_loopback(h.address) for h in inventory.hosts))
    rows, chosen = interface_checks(facts, [hosts[name] for name in connections], spec, pins)
    report.checks += rows
    report.interfaces = {name: pin.interface for name, pin in chosen.items()}
    if spec is None:
        report.notes.append("no job given: payload, GPU needs and the backend are not checked")
    if spec is not None:
        report.checks += data_checks(facts, spec.data_paths, master.name, bool(spec.setup))
    reachable = {name: connections[name] for name in facts}
    master_port = _master_port(spec, reachable.get(master.name), timeout)
    if isinstance(master_port, Check):
        report.checks.append(master_port)
    elif master.name in reachable:
        rows, reached = network_checks(reachable, master.name, master_port, timeout=timeout, pins=chosen,
                                       also=default_targets(facts, chosen, backend, spec))
        report.checks += rows + defaults_checks(facts, chosen, reached, backend, spec, pins)
    else:
        report.checks += [Check(name, "master_port", Status.SKIP, f"not tested: no probe of the master {master.name}")
                          for name in reachable]
    if collective is not None:
        if report.failures or len(reachable) < len(report.hosts):
            report.checks += [Check(h["name"], "collective", Status.SKIP, "not run: fix the failures above first")
                              for h in report.hosts]
        else:
            report.checks += collective()
