"""The verb `harness preflight HOSTS [--job JOB] [--json] ...` once cli.py has parsed it: load, run, print,
exit status. What keeps preflight from running is raised to cli.main, which says why and exits with its status."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.errors import HarnessError, UsageError
from harness.preflight.runner import run_preflight
from harness.preflight.table import Report
from harness.record.rundir import runs_root
from harness.spec.inventory import load_inventory
from harness.spec.job import JobSpec, load_job


def preflight_command(hosts_path: str | Path | None, job_path: str | Path | None = None, *, json_out: bool = False,
                      collective: bool = False, accept_new_host_keys: bool = False,
                      known_hosts: str | Path | None = None, timeout: float = 10.0, slurm: bool = False,
                      runs_dir: str | None = None) -> int:
    """0 when every check passes, 1 when one fails; a bad inventory, job or request raises its HarnessError
    (exit 2). slurm: the hosts are the nodes of the Slurm allocation this runs in (no inventory)."""
    try:
        spec = load_job(job_path) if job_path is not None else None
        if runs_dir is not None and not slurm:
            raise UsageError("--runs-dir is for --target slurm: the runs directory its nodes must see")
        if slurm:
            report = _in_allocation(hosts_path, spec, collective, timeout, runs_root(runs_dir))
        elif hosts_path is None:
            raise UsageError("give the host inventory (harness preflight hosts.yaml), or --target slurm inside a "
                             "Slurm allocation")
        else:
            report = run_preflight(load_inventory(hosts_path), spec, known_hosts=known_hosts,
                                   accept_new_host_keys=accept_new_host_keys, collective=collective, timeout=timeout)
    except HarnessError as exc:
        if json_out:  # whoever reads the JSON gets an answer on stdout too
            print(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        raise
    print(json.dumps(report.to_json(), indent=2) if json_out else report.render_table())
    return 0 if report.ok else 1


def _in_allocation(hosts_path: str | Path | None, spec: JobSpec | None, collective: bool, timeout: float,
                   runs: Path) -> Report:
    from harness.preflight.runner import run_preflight_srun
    from harness.targets.slurm.srun import Allocation, in_allocation

    if hosts_path is not None:
        raise UsageError("--target slurm checks the nodes of the Slurm allocation it runs in; give no inventory")
    if collective:
        raise UsageError("--collective runs over SSH hosts only; inside a Slurm allocation, run a short job instead")
    if not in_allocation(os.environ):
        raise UsageError("--target slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set): "
                         "salloc --nodes=N harness preflight --target slurm --job JOB")
    return run_preflight_srun(Allocation.from_env(os.environ), spec, timeout=timeout, runs=runs)
