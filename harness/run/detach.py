"""`harness launch --detach`: the run's controller in a session of its own, outliving the terminal."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from harness.record.atomic import file_mode
from harness.record.index import index_dir, prune_index, register_run
from harness.record.rundir import RunDir, make_run_folder
from harness.record.schema import RecordError

DETACH_STARTUP_TIMEOUT = 300.0


def start_detached(argv: Sequence[str], run: RunDir, timeout: float = DETACH_STARTUP_TIMEOUT) -> int:
    """Start `harness launch` (argv) in a session of its own, so the run outlives this terminal, and
    return once its run record exists; if it fails before that, show its output and its exit status."""
    make_run_folder(run.path)
    register_run(run, index_dir())  # the controller registers it too; here a read-only home's warning reaches the user
    with open(os.open(run.controller_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode(run.path)), "w") as log:
        controller = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    deadline = time.monotonic() + timeout
    while not run.state_file.exists() and controller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not run.state_file.exists():
        sys.stderr.write(run.controller_log.read_text())
        if controller.poll() is None:
            controller.kill()
        code = controller.wait()
        # No run started: leave no directory `status` cannot list, and no index entry pointing at it.
        shutil.rmtree(run.path, ignore_errors=True)
        with contextlib.suppress(OSError):  # a home that cannot be written has no entry of it either
            prune_index(index_dir())
        return code
    grace = 0.0
    with contextlib.suppress(RecordError):
        grace = run.read_state().grace
    print(f"run {run.run_id} started in the background (controller pid {controller.pid})\n"
          f"  follow: harness logs {run.run_id} --follow\n  status: harness status {run.run_id}\n"
          f"  stop:   harness stop {run.run_id}"
          + (f"\n  attach: harness attach {run.run_id}   (should that controller be lost: its nodes run on for "
             f"{grace:g} s, supervision.grace)" if grace > 0 else ""))
    return 0
