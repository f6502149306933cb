"""`harness launch --detach` in every form a job takes (a spec file, a script, a module, with and without the
script's arguments after `--`): the launch returns while the job still runs, the run whose id it prints is the
one that runs and ends, the script gets exactly its own arguments, and nothing else is left in the runs
directory or the index of runs. On the stand-in torch (testbed/standin): the probe uses none, and detaching is the
harness's. (Stopping a detached run: test_runs_anywhere.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import STANDIN_ENV, assert_nothing_left, harness, leftover, listening_ports

LAUNCH_TIMEOUT = 300  # a limit for a hung launch, not a guard: four launches at once on 2 busy cores
# Each rank writes what it was given to <run id>.argv in the launch directory (HARNESS_RUN_ID names the run that
# really runs), then waits for <run id>.go: until the test writes it, the run cannot have ended.
PROBE = """\
import json, os, sys, time
run = os.environ["HARNESS_RUN_ID"]
with open(run + ".argv", "w") as out:
    json.dump(sys.argv[1:], out)
deadline = time.monotonic() + 240
while not os.path.exists(run + ".go"):
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.05)
"""
JOB = ("name: probe\nnnodes: 1\nbackend: gloo\nentrypoint:\n  script: probe.py\n  args: [--steps, '5', two words]\n"
       f"env: {{PYTHONPATH: '{STANDIN_ENV['PYTHONPATH']}'}}\n")
STANDIN = ["--env", f"PYTHONPATH={STANDIN_ENV['PYTHONPATH']}"]  # a script launch's words for the stand-in
# Each form: the words after `harness launch`, and the arguments the script must see.
FORMS = {
    "spec-file": (["job.yaml"], ["--steps", "5", "two words"]),
    "script": (["probe.py", "--nnodes", "1", "--", "--steps", "5", "--runs-dir", "x"], ["--steps", "5", "--runs-dir", "x"]),
    "module": (["-m", "probe", "--", "--lr", "0.1"], ["--lr", "0.1"]),
    "no-args": (["probe.py", "--"], []),
}


def _wait_for(path: Path, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{what}: {path} never appeared"
        time.sleep(0.1)


def test_every_launch_form_detaches_and_runs_the_run_it_names(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "job.yaml").write_text(JOB)
    base = {k: v for k, v in os.environ.items() if k != "HARNESS_RUNS_DIR"}

    def launch(form: str) -> tuple[str, object]:
        words, _ = FORMS[form]
        env = base | {"XDG_STATE_HOME": str(tmp_path / form / "state")}  # each form's own index of runs
        standin = [] if form == "spec-file" else STANDIN  # a spec file's job has it in its env
        return form, harness("launch", "--detach", "--runs-dir", str(tmp_path / form / "runs"), *standin, *words,
                             cwd=tmp_path, env=env, timeout=LAUNCH_TIMEOUT)

    with ThreadPoolExecutor(len(FORMS)) as pool:
        launched = dict(pool.map(launch, FORMS))
    run_ids = {}
    try:
        for form, done in launched.items():
            assert done.returncode == 0, (form, done.stdout, done.stderr)
            started = re.search(r"^run (\S+) started in the background \(controller pid (\d+)\)", done.stdout, re.M)
            run_ids[form] = started.group(1)
            assert f"  attach: harness attach {started.group(1)}   (should that controller be lost: its nodes run on " \
                   f"for 300 s, supervision.grace)" in done.stdout, (form, done.stdout)
            # Nothing listens unless asked to (health.metrics_port: test_metrics.py): not a metrics port, nothing.
            assert listening_ports(int(started.group(2))) == set(), form
        for form, run_id in run_ids.items():
            runs = tmp_path / form / "runs"
            # The launch returned while its job waits for the test: it is detached.
            assert harness("status", run_id, "--runs-dir", str(runs)).stdout.startswith(f"run {run_id}: running"), \
                form
            _wait_for(tmp_path / f"{run_id}.argv", f"{form}: the run it printed never ran")
            (tmp_path / f"{run_id}.go").touch()
        for form, run_id in run_ids.items():
            runs, index = tmp_path / form / "runs", tmp_path / form / "state" / "harness" / "runs"
            _wait_for(runs / run_id / "summary.json", f"{form}: the run never ended")
            status = harness("status", run_id, "--runs-dir", str(runs)).stdout
            assert status.startswith(f"run {run_id}: succeeded"), (form, status)
            assert json.loads((tmp_path / f"{run_id}.argv").read_text()) == FORMS[form][1], form
            assert [p.name for p in runs.iterdir()] == [run_id], form
            assert [(p.name, p.readlink()) for p in index.iterdir()] == [(run_id, runs / run_id)], form
            assert_nothing_left(run_id)
    finally:
        for run_id in run_ids.values():
            (tmp_path / f"{run_id}.go").touch()
            for pid in leftover(run_id):
                os.kill(pid, signal.SIGKILL)
