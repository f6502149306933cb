"""The probe on one host, and preflight's fast checks for simulated nodes on this machine: the job's
files seen from each node's working directory, with the rows an SSH host would get. Kept apart from
the SSH runner so that a local launch loads neither paramiko nor the supervisor."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from harness.node import probe
from harness.node.probe import Facts, StacksOnly
from harness.plan.planner import LOCAL_MASTER
from harness.preflight.checks import data_checks, fingerprint_checks, stacks_check
from harness.preflight.remote import TORCH_TIMEOUT_FACTOR, Link, ScriptError, run_script
from harness.preflight.subprocess_link import CommandLink
from harness.preflight.table import Check, Report, Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.targets.base import CheckFailed, WorkdirCheck

STACKS_ONLY = json.dumps({"stacks_only": True})  # the probe's config on a container job's host
OWN_PYTHON_FIX = ("point simulated.python at the python of an environment that has torch and the job's packages "
                  "(e.g. ~/envs/train/bin/python), or create that environment")


def _probe_config(workdir: str | None, master_address: str, spec: JobSpec | None, fast: bool,
                  peers: Mapping[str, str], stacks: bool = True) -> str:
    entry = spec.entrypoint if spec else None
    return json.dumps({
        "import_torch": not fast,
        "workdir": workdir,
        "entrypoint": ({"module": entry.module} if entry.module else {"script": entry.script}) if entry else None,
        "master_address": master_address,
        "data_paths": spec.data_paths if spec else [],
        "peers": dict(peers),
        "stacks": stacks,
    })


# The least a fast probe is given: a Python started on the host, its answer read. A launch's gate runs it with the
# job's timeouts.connect, a network's round trip, which a busy host's Python start can outlast (3 s, under load).
FAST_PROBE_SECONDS = 10.0


def probe_host(connection: Link, master: Host, spec: JobSpec | None, fast: bool, timeout: float,
               peers: Mapping[str, str], *, host_link: Link | None = None) -> Facts:
    """The probe's facts of one host. host_link: the host itself when connection runs the probe inside the
    job's image; the stack check runs there, since the node agent that reads the ranks' stacks runs there."""
    limit = max(timeout, FAST_PROBE_SECONDS) if fast else timeout * TORCH_TIMEOUT_FACTOR
    config = _probe_config(connection.host.workdir, master.address, spec, fast, peers, stacks=host_link is None)
    facts = cast(Facts, run_script(connection, probe, [config], timeout=limit))
    if host_link is not None:
        try:
            facts["stacks"] = cast(StacksOnly, run_script(host_link, probe, [STACKS_ONLY], timeout=timeout))["stacks"]
        except (ScriptError, OSError) as exc:
            facts["stacks"] = {"python": host_link.host.python, "failed": f"the probe on the host failed: {exc}"}
    return facts


def _unrunnable(python: str) -> str | None:
    """Why the nodes' interpreter cannot be run at all, said before the probe tries (its shell's
    `not found` would say less)."""
    if "/" not in python:
        return "not found on PATH"
    if os.path.islink(python) and not os.path.exists(python):
        return f"{python} is a link to {os.readlink(python)}, which does not exist (was the environment's base " \
               f"Python removed?)"
    if not os.path.exists(python):
        return f"{python} does not exist"
    if os.path.isdir(python):
        return f"{python} is a directory"
    if not os.access(python, os.X_OK):
        return f"{python} is not executable"
    return None


def run_preflight_local(spec: JobSpec, python: str, workdir: Path, *, timeout: float = 10.0) -> Report:
    """The fast checks of the job's files for simulated nodes: the same probe, run here with the nodes'
    Python in their working directory, and the same rows (entrypoint, torch, data_paths) as over SSH,
    with fixes that name this machine's directories. python: the harness's own, which runs the node
    agents (so py-spy is looked for beside it) and, unless spec.simulated.python names another (taken
    from the launch directory, the cwd), the nodes."""
    started = time.monotonic()
    report = Report(hosts=[{"name": "localhost", "address": LOCAL_MASTER, "master": True}],
                    job={"name": spec.name, "backend": spec.backend, "nnodes": spec.nnodes,
                         "master_port": spec.master_port})
    nodes_python = spec.simulated.interpreter(os.getcwd(), python)
    here = Host(name="localhost", address=LOCAL_MASTER, python=nodes_python, workdir=str(workdir))
    # The node agents run with the harness's own Python: the stack check (py-spy beside it) runs there.
    agents = None if nodes_python == python else CommandLink(here.model_copy(update={"python": python}))
    facts: Facts | None = None
    if (problem := _unrunnable(nodes_python)) is None:
        try:
            facts = probe_host(CommandLink(here), here, spec, True, timeout, {}, host_link=agents)
        except ScriptError as exc:
            problem = f"probe failed: {exc}"
    if facts is None:
        where, fix = ((f"simulated.python {spec.simulated.python}: ", OWN_PYTHON_FIX) if spec.simulated.python
                      else ("", "run harness with a Python that has torch"))
        report.checks.append(Check("localhost", "fingerprint", Status.FAIL, f"{where}{problem}", fix))
    else:
        report.facts = {"localhost": facts}
        rows, report.fingerprint, report.mismatched = fingerprint_checks(report.facts, "localhost",
                                                                         local=spec.entrypoint)
        report.checks += rows + data_checks(report.facts, spec.data_paths, "localhost", bool(spec.setup), local=True)
        report.checks.append(stacks_check("localhost", facts, local=True))
    report.seconds = time.monotonic() - started
    return report


def workdir_gate(python: str) -> WorkdirCheck:
    """The probe's checks of the job's files (entrypoint, torch, data_paths) with the nodes' Python
    (spec.simulated.python, else python: the harness's own, which runs the node agents), as the gate a
    local launch passes before its nodes start."""

    def check(spec: JobSpec, workdir: Path) -> None:
        report = run_preflight_local(spec, python, workdir, timeout=spec.timeouts.connect)
        if not report.ok:
            raise CheckFailed("preflight failed, nothing was started:\n" + report.render_table())

    return check
