"""`harness launch --detach` in every form a job takes (a spec file, a script, a module, with and without the
script's arguments after `--`): the launch returns while the job still runs, the run whose id it prints is the
one that runs and ends, the script gets exactly its own arguments, and nothing else is left in the runs
directory or the index of runs. Values that look secret given by --env reach the ranks, and the controller's command
line, which any user reads in /proc for the whole run, holds none. On the stand-in torch (testbed/standin): the probe
uses none, and detaching is the harness's. (Stopping a detached run: test_runs_anywhere.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import (
    SECRET_LOOKING,
    STANDIN_ENV,
    assert_nothing_left,
    harness,
    leftover,
    listening_ports,
    secret_looking_env,
)

LAUNCH_TIMEOUT = 300  # a limit for a hung launch, not a guard: four launches at once on 2 busy cores
# Each rank writes what it was given to <run id>.argv in the launch directory (HARNESS_RUN_ID names the run that
# really runs), and the sha256 of each SECRET_LOOKING variable it has to <run id>.env; then waits for <run id>.go:
# until the test writes it, the run cannot have ended.
PROBE = """\
import hashlib, json, os, sys, time
run = os.environ["HARNESS_RUN_ID"]
with open(run + ".argv", "w") as out:
    json.dump(sys.argv[1:], out)
with open(run + ".env", "w") as out:
    json.dump({name: hashlib.sha256(os.environ[name].encode()).hexdigest() for name in NAMES if name in os.environ}, out)
deadline = time.monotonic() + 240
while not os.path.exists(run + ".go"):
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.05)
""".replace("NAMES", repr(SECRET_LOOKING))
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
    secret = secret_looking_env()  # given by --env to every form but the spec file's
    given = [*STANDIN, *(f"--env={name}={value}" for name, value in secret.items())]

    def launch(form: str) -> tuple[str, object]:
        words, _ = FORMS[form]
        env = base | {"XDG_STATE_HOME": str(tmp_path / form / "state")}  # each form's own index of runs
        flags = [] if form == "spec-file" else given  # a spec file's job has PYTHONPATH in its env
        return form, harness("launch", "--detach", "--runs-dir", str(tmp_path / form / "runs"), *flags, *words,
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
            _no_value_shown(form, done, int(started.group(2)), started.group(1), secret)
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
            assert json.loads((tmp_path / f"{run_id}.env").read_text()) == \
                ({} if form == "spec-file" else {k: hashlib.sha256(v.encode()).hexdigest() for k, v in secret.items()})
            assert not [p for p in runs.rglob("*") if p.is_file() and any(v.encode() in p.read_bytes()
                                                                          for v in secret.values())], form
            assert [p.name for p in runs.iterdir()] == [run_id], form
            assert [(p.name, p.readlink()) for p in index.iterdir()] == [(run_id, runs / run_id)], form
            assert_nothing_left(run_id)
    finally:
        for run_id in run_ids.values():
            (tmp_path / f"{run_id}.go").touch()
            for pid in leftover(run_id):
                os.kill(pid, signal.SIGKILL)


def _no_value_shown(form: str, done: subprocess.CompletedProcess[str], controller: int, run_id: str,
                    secret: dict[str, str]) -> None:
    """The launch said once of each --env name that it looks like a secret, and showed no value; while the run runs,
    its controller's command line, read as another user, holds none, nor does any of its processes'."""
    said = done.stdout + done.stderr
    assert not [name for name, value in secret.items() if value in said], form
    if form != "spec-file":
        assert all(done.stderr.count(f"harness: env.{name} looks like a secret: ") == 1 for name in secret), done.stderr
    seen = subprocess.run(["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", "cat",
                           f"/proc/{controller}/cmdline"], capture_output=True, timeout=30)
    assert seen.returncode == 0 and b"\0launch\0" in seen.stdout and b"--detached-controller" in seen.stdout, seen
    assert not [name for name, value in secret.items() if value.encode() in seen.stdout], (form, seen.stdout)
    for pid in [controller, *leftover(run_id)]:
        with contextlib.suppress(OSError):
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert not [name for name, value in secret.items() if value.encode() in line], (form, pid, line)
