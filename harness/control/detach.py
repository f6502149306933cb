"""`harness launch --detach`: the run's controller in a session of its own, outliving the terminal. Its command line,
which /proc shows every user for the whole run, is the launch's but for the `--env` pairs: those come on its stdin,
read once at its start (--detached-controller)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from harness.errors import UsageError
from harness.record.atomic import file_mode
from harness.record.index import index_dir, prune_index, register_run
from harness.record.rundir import RunDir, make_run_folder
from harness.record.schema import RecordError

DETACH_STARTUP_TIMEOUT = 300.0
ENV_WORD = "--env="  # how the launch's command line (cli.command_line) writes each --env pair
MAX_ENV_BYTES = 1 << 20  # what a controller reads of its stdin at most: far more than any job's --env pairs


def controller_argv(rerun: Sequence[str], root: Path, run_id: str) -> list[str]:
    """The detached controller's command line: the launch's words (rerun: the verb, then its arguments as
    cli.command_line writes them) with its run's id and runs directory, less its `--env` pairs (start_detached
    passes those on its stdin). Its own options right after the verb: rerun may end with `-- SCRIPT ARGS`, all the
    script's."""
    verb, *words = rerun
    cut = words.index("--") if "--" in words else len(words)
    kept = [word for word in words[:cut] if not word.startswith(ENV_WORD)] + words[cut:]
    return [sys.executable, "-m", "harness.cli", verb, f"--runs-dir={root}", f"--run-id={run_id}",
            "--detached-controller", *kept]


def env_pairs_from(stdin: TextIO) -> list[str]:
    """The launch's `--env` pairs, as start_detached wrote them on the detached controller's stdin (a JSON list)."""
    text = stdin.read(MAX_ENV_BYTES + 1)
    try:
        pairs = json.loads(text)
    except ValueError:
        pairs = None
    if len(text) > MAX_ENV_BYTES or not isinstance(pairs, list) or not all(isinstance(p, str) for p in pairs):
        # what came is not shown: it would be --env values
        raise UsageError(f"--detached-controller: expected the launch's --env pairs on stdin as a JSON list of "
                         f"strings (at most {MAX_ENV_BYTES} bytes)")
    return pairs


def start_detached(argv: Sequence[str], run: RunDir, env_pairs: Sequence[str] = (),
                   timeout: float = DETACH_STARTUP_TIMEOUT) -> int:
    """Start `harness launch` (argv, from controller_argv) in a session of its own, so the run outlives this
    terminal, with env_pairs (its --env) on its stdin; and return once its run record exists; if it fails before
    that, show its output and its exit status."""
    make_run_folder(run.path)
    register_run(run, index_dir())  # the controller registers it too; here a read-only home's warning reaches the user
    with open(os.open(run.controller_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode(run.path)), "w") as log:
        controller = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, text=True)
    assert controller.stdin is not None
    with contextlib.suppress(BrokenPipeError), controller.stdin:  # it ended before reading them: its log says why
        controller.stdin.write(json.dumps(list(env_pairs)))
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
