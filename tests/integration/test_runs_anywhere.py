"""Runs are found from any directory: launched under one directory's ./runs, listed, shown and stopped
from another through the user's index of runs; --runs-dir and HARNESS_RUNS_DIR still name the one
directory to use. The jobs run on the stand-in torch (testbed/standin): where a run is found is the harness's."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from conftest import STATE_HOME, assert_nothing_left, harness, leftover
from conftest import ddp_job as job

LAUNCH_TIMEOUT = 300  # a limit for a hung launch, not a guard: seconds each, longer on a busy machine


def _env(**extra: str) -> dict[str, str]:
    """This environment without HARNESS_RUNS_DIR, as a user who never set it has it."""
    return {k: v for k, v in os.environ.items() if k != "HARNESS_RUNS_DIR"} | extra


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    """The directory a run is launched in, and another terminal's."""
    (tmp_path / "launched-here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "launched-here", tmp_path / "elsewhere"


def test_a_run_is_listed_and_shown_from_another_directory(write_yaml, tmp_path):
    here, elsewhere = _dirs(tmp_path)
    done = harness("launch", str(job(write_yaml, standin=True, STEPS="6")), cwd=here, env=_env(),
                   timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning" not in done.stderr, done.stderr
    run_id = re.search(r"harness: run (\S+): ", done.stdout).group(1)
    runs = here / "runs"

    listing = harness("status", cwd=elsewhere, env=_env()).stdout
    assert listing.splitlines()[0].endswith("DURATION  WHERE"), listing
    assert re.search(rf"^{run_id}\s+succeeded\s+2 .*  {runs}/$", listing, re.MULTILINE), listing
    detail = harness("status", run_id, cwd=elsewhere, env=_env()).stdout
    assert detail.startswith(f"run {run_id}: succeeded (local, 2 node(s), world size 2)"), detail
    assert "  node1 on sim1: succeeded (exit 0) after " in detail, detail
    assert f"; log {runs / run_id / 'node1.log'}\n" in detail, "the log as found from here"

    # --runs-dir and HARNESS_RUNS_DIR win: only the directory they name is looked in.
    assert run_id in harness("status", "--runs-dir", str(runs), cwd=elsewhere, env=_env()).stdout
    given = harness("status", "--runs-dir", "runs", cwd=elsewhere, env=_env())
    assert run_id not in given.stdout and given.stdout.startswith("no runs in runs/ (named by --runs-dir)"), given
    from_env = harness("status", run_id, cwd=elsewhere, env=_env(HARNESS_RUNS_DIR=str(elsewhere)))
    assert from_env.returncode == 2 and "(named by HARNESS_RUNS_DIR)" in from_env.stderr, from_env


def test_a_detached_run_is_stopped_from_another_directory(write_yaml, tmp_path):
    here, elsewhere = _dirs(tmp_path)
    spec = job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05")
    started = harness("launch", str(spec), "--detach", cwd=here, env=_env(), timeout=LAUNCH_TIMEOUT)
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = re.search(r"run (\S+) started in the background", started.stdout).group(1)
    try:
        log = here / "runs" / run_id / "node1.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "rank 1/2 up" in log.read_text()):  # every node's worker runs
            assert time.monotonic() < deadline, f"rank 1 never came up: {log}"
            time.sleep(0.2)
        assert re.search(rf"^{run_id}\s+running\s+2 ", harness("status", cwd=elsewhere, env=_env()).stdout,
                         re.MULTILINE)
        stopped = harness("stop", run_id, "--timeout", "60", cwd=elsewhere, env=_env())
        assert (stopped.returncode, stopped.stdout) == (0, f"run {run_id} stopped\n"), stopped
        assert_nothing_left(run_id, within=30)
        detail = harness("status", run_id, cwd=elsewhere, env=_env()).stdout
        assert detail.startswith(f"run {run_id}: stopped"), detail
    finally:
        for pid in leftover(run_id):
            os.kill(pid, signal.SIGKILL)


def test_an_unknown_run_names_the_index_and_how_to_look_elsewhere(tmp_path):
    index = Path(STATE_HOME) / "harness" / "runs"
    for verb in ("status", "stop", "stacks"):
        result = harness(verb, "no-such-run", cwd=tmp_path, env=_env())
        assert result.returncode == 2, result
        assert re.fullmatch(rf"harness: error: no run no-such-run in runs/ nor in the index of your runs \({index}\); "
                            rf"recent runs: .*; pass --runs-dir DIR or set HARNESS_RUNS_DIR to look in another "
                            rf"directory\n", result.stderr), result.stderr


def test_a_launch_goes_on_when_the_index_cannot_be_written(write_yaml, tmp_path):
    """A read-only home (here: XDG_STATE_HOME under a file, which even root cannot write into): one warning,
    and the run is found through its runs directory as before."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    here, _ = _dirs(tmp_path)
    done = harness("launch", str(job(write_yaml, standin=True, STEPS="6")), cwd=here,
                   env=_env(XDG_STATE_HOME=str(afile)), timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = re.search(r"harness: run (\S+): ", done.stdout).group(1)
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert warnings == [f"harness: warning: cannot register run {run_id} "
                        f"in the index of your runs {afile}/harness/runs (Not a directory); from other directories, "
                        f"`harness status` finds it only with --runs-dir {here}/runs"], done.stderr
    assert afile.read_text() == "x"
