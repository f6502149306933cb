"""Hostile and careless input that gets as far as `harness launch` (the rest: tests/unit/test_hostile.py):
nothing outlives the run, the program's own exit code is reported, refusals are one line."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from harness.node.proctable import is_alive, start_ticks
from harness.record.index import index_dir

from conftest import DEMO_JOB as JOB
from conftest import REPO, SCRIPT, assert_nothing_left, assert_only_the_jobs_lines, ddp_job, harness


def test_a_daemon_that_drops_the_run_id_does_not_outlive_the_run(write_yaml, launch, tmp_path):
    """On the stand-in torch: the daemon is the script's, its sweep the harness's."""
    pid_file = tmp_path / "daemon.pid"
    text = ddp_job(write_yaml, standin=True, DAEMON_PID_FILE=str(pid_file)).read_text()
    text = text.replace(str(SCRIPT), str(REPO / "tests" / "scripts" / "escape.py")).replace("nnodes: 2", "nnodes: 1")
    run = launch(write_yaml(text))
    assert run.finish() == 0, run.output
    pid = int(pid_file.read_text())
    ticks = start_ticks(pid)
    assert b"HARNESS_RUN_ID" not in Path(f"/proc/{pid}/environ").read_bytes() if ticks else True
    deadline = time.monotonic() + 10
    while is_alive(pid, ticks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(pid, ticks), f"daemon {pid} outlived its run"


def test_a_programs_own_exit_code_is_the_reported_one_and_its_record_is_its_owners_alone(write_yaml, launch):
    """On real torch: rank 1's code, 3, read from torchrun's own report of its failure, while rank 0 waits for it in
    the step's all_reduce; rank 1 fails once the rank hook's server (torch's own) is up in it and ends with it, and the
    stream holds the job's lines and the harness's, none of torchrun's or torch's. The record, in a folder everyone
    may enter, under umask 000 (what 002 leaves open, and more): the runs directory the harness makes and the run's
    folder 0700, their folders 0700 and files 0600, the index of runs 0700; another local user reads none of it, nor
    which runs there are (its spec and plan hold the job's env)."""
    shared = Path(tempfile.mkdtemp(prefix="harness-perm-"))
    shared.chmod(0o755)
    umask = os.umask(0o000)
    try:
        run = launch(ddp_job(write_yaml, FAIL_RANK="1", FAIL_AT_STEP="2", FAIL_CODE="3", AWAIT_RANK_HOOK="1"),
                     runs_dir=shared / "runs")
    finally:
        os.umask(umask)
    try:
        assert run.finish() == 1, run.output
        assert_only_the_jobs_lines(run.output)
        assert "[c10d] Server exited" in (shared / "runs" / run.run_id / "node1.log").read_text(), "the server was up"
        failure = run.summary()["first_failure"]
        assert (failure["rank"], failure["rank_exit_code"], failure["description"]) == (1, 3, "exit code 3")
        assert "FAILED: first failure on node 1 (sim1, global rank 1): exit code 3" in run.output
        assert_nothing_left(run.run_id)
        folder = shared / "runs" / run.run_id
        folders = [shared / "runs", folder, *(p for p in folder.rglob("*") if p.is_dir()), index_dir()]
        assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in folders} == {str(p): "0o700" for p in folders}
        written = [p for p in folder.rglob("*") if p.is_file()]
        assert {p.name for p in written} >= {"spec.yaml", "plan.txt", "state.json", "summary.json", "node1.log",
                                              "harness.log"}
        modes = {str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
        assert set(modes.values()) == {"0o600"}, modes
        other = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        assert subprocess.run([*other, "cat", str(folder / "spec.yaml")], capture_output=True).returncode != 0
        assert subprocess.run([*other, "ls", str(folder)], capture_output=True).returncode != 0
        assert subprocess.run([*other, "ls", str(shared / "runs")], capture_output=True).returncode != 0
        assert subprocess.run([*other, "ls", str(shared)], capture_output=True).returncode == 0  # where it may look
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_argument_list_too_long_for_the_os_is_one_line_exit_1(write_yaml, tmp_path):
    job = write_yaml(JOB.replace("args: [--x]", "args: [" + "a" * 300_000 + "]"))
    result = harness("launch", str(job), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith("harness: error: could not start the nodes: Argument list too long")
    assert "Traceback" not in result.stderr


def test_detach_with_a_missing_script_leaves_no_run_directory_nor_index_entry(write_yaml, tmp_path):
    job = write_yaml(JOB.replace("module: harness.payload.train", "script: missing.py"))
    state = tmp_path / "state"
    result = harness("launch", str(job), "--detach", "--runs-dir", str(tmp_path / "runs"),
                     env=os.environ | {"XDG_STATE_HOME": str(state)})
    assert result.returncode == 1 and "entrypoint missing.py: " in result.stderr and "does not exist" in result.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    assert list((state / "harness" / "runs").iterdir()) == []
