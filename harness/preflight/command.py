"""`harness preflight HOSTS [--job JOB] [--json] ...` without argparse: load, run, print, exit status."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.errors import HarnessError
from harness.inventory import load_inventory
from harness.preflight.runner import run_preflight
from harness.spec import load_job


def preflight_command(hosts_path: str | Path, job_path: str | Path | None = None, *, json_out: bool = False,
                      collective: bool = False, accept_new_host_keys: bool = False,
                      known_hosts: str | Path | None = None, timeout: float = 10.0) -> int:
    """0 when every check passes, 1 when one fails, 2 for a bad inventory, job or request."""
    try:
        inventory = load_inventory(hosts_path)
        spec = load_job(job_path) if job_path is not None else None
        report = run_preflight(inventory, spec, known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys,
                               collective=collective, timeout=timeout)
    except HarnessError as exc:
        if json_out:
            print(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        print(f"harness preflight: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(report.to_json(), indent=2) if json_out else report.render_table())
    return 0 if report.ok else 1
