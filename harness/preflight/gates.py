"""Preflight's fast checks as the gate SSH hosts pass before any node starts on them: built here and
handed to the target (targets never import preflight), which calls it on every attempt's plan. The
gate of simulated nodes is preflight.local.workdir_gate."""

from __future__ import annotations

from collections.abc import Mapping

from harness.preflight.runner import run_preflight
from harness.spec.inventory import Host, Inventory
from harness.spec.job import JobSpec
from harness.targets.base import CheckFailed
from harness.targets.ssh.backend import HostsCheck, SSHOptions
from harness.targets.ssh.transport import Connection

# The checks whose failure is the machine's own, not the job's set-up on it: such a host is kept out of later runs
# for a cool-down (record/hosts_out.py); so is one that SSH cannot reach (not one it cannot resolve or log in to).
MACHINE_CHECKS = frozenset({"gpu_health", "gpu_memory"})
UNREACHABLE = frozenset({"timeout", "refused", "no_route", "network"})


def hosts_gate(inventory: Inventory, options: SSHOptions) -> HostsCheck:
    """The fast checks (no torch import, no collective) on the hosts an attempt is about to use, over the
    launch's own connections (opened here where missing, and kept open for the nodes)."""

    def check(hosts: list[Host], spec: JobSpec, connections: dict[str, Connection]) -> Mapping[str, str]:
        report = run_preflight(inventory.model_copy(update={"hosts": hosts, "master": hosts[0].name}), spec,
                               known_hosts=options.known_hosts, accept_new_host_keys=options.accept_new_host_keys,
                               fast=True, timeout=spec.timeouts.connect, connections=connections)
        if not report.ok:
            unfit = {c.host: f"{c.name}: {c.reason}" for c in report.failures if c.name in MACHINE_CHECKS
                     or (c.name == "ssh" and (c.details or {}).get("kind") in UNREACHABLE)}
            raise CheckFailed("preflight failed, nothing was started (use --skip-preflight to launch anyway):\n"
                              + report.render_table(), hosts=frozenset(c.host for c in report.failures), unfit=unfit)
        return report.interfaces

    return check
