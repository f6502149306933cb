"""What a batch job of `harness launch --target slurm` needs of every node beyond what the job needs: the
runs directory the user's machine writes, seen there (a file written here is read there: the controller
in the batch step writes the record that `harness launch`, status and logs read here), and this
harness, importable with this Python (the batch script runs the one that submitted it)."""

from __future__ import annotations

import secrets
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from harness import __version__
from harness.preflight.remote import Link, on_hosts
from harness.preflight.table import Check, Status
from harness.record.atomic import make_folders

SHARE_FIX = "give --runs-dir on a file system that this machine and the nodes share (a Slurm submit directory is)"


def batch_job_checks(links: Mapping[str, Link], runs: Path, timeout: float) -> list[Check]:
    runs = runs.resolve()
    make_folders(runs, 0o700)  # the runs directory a launch makes: as private
    token = runs / f".preflight-{secrets.token_hex(4)}"
    token.write_text(f"{token.name}\n")
    version = "import harness; print(harness.__version__)"
    command = (f"cat {shlex.quote(str(token))} 2>/dev/null || echo unseen; "
               f"{shlex.quote(sys.executable)} -c {shlex.quote(version)} 2>&1 | tail -n 1")
    try:
        answers = on_hosts(lambda name: links[name].run(command, timeout=timeout), links)
    finally:
        token.unlink(missing_ok=True)
    checks = []
    for name, answer in answers.items():
        if isinstance(answer, Exception):
            checks.append(Check(name, "batch_job", Status.FAIL, f"could not check: {answer}", None))
            continue
        seen, _, imported = answer.stdout.strip().partition("\n")
        if seen != token.name:
            checks.append(Check(name, "batch_job", Status.FAIL, f"{runs} (the runs directory) is not seen there",
                                SHARE_FIX))
        elif imported.strip() != __version__:
            checks.append(Check(name, "batch_job", Status.FAIL, f"{sys.executable} does not import harness "
                                f"{__version__} there: {imported.strip() or 'no answer'}",
                                "install the harness on a file system the nodes share (a shared virtual environment)"))
        else:
            checks.append(Check(name, "batch_job", Status.PASS, f"sees {runs} and imports harness {__version__} with "
                                f"{sys.executable}, as the batch step of `harness launch --target slurm` will"))
    return checks
