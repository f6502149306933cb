"""The user's index of runs: where it lives (XDG), how a run registers, and how runs are found and listed
once each from ./runs and the index (the CLI end to end: integration/test_runs_anywhere.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.run.index import RunsLookup, create_run_dir, index_dir, register_run
from harness.run.records import ControllerId, RunState, RunStatus
from harness.run.rundir import RunDir
from harness.run.status import runs_table

from conftest import STATE_HOME, harness

HOME_STATE = Path.home() / ".local" / "state" / "harness" / "runs"


@pytest.mark.parametrize(("environ", "expected"), [
    ({"XDG_STATE_HOME": "/srv/state"}, Path("/srv/state/harness/runs")),
    ({}, HOME_STATE),
    ({"XDG_STATE_HOME": ""}, HOME_STATE),
    ({"XDG_STATE_HOME": "relative/state"}, HOME_STATE),  # the XDG spec: a relative path is invalid, ignored
])
def test_the_index_follows_the_xdg_spec(environ: dict[str, str], expected: Path) -> None:
    assert index_dir(environ) == expected


def test_the_test_session_never_writes_into_the_real_home() -> None:
    assert index_dir() == Path(STATE_HOME) / "harness" / "runs"


def _recorded(root: Path, run_id: str, started_at: float) -> RunDir:
    """A run with a state record, registered in the session's index as a launch registers it."""
    run = create_run_dir(root, run_id)
    run.write_state(RunState(run_id=run_id, name="job", mode="local", status=RunStatus.SUCCEEDED,
                             started_at=started_at, nnodes=2, world_size=2, controller=ControllerId(1, 1),
                             hosts=["localhost", "localhost"]))
    return run


def test_a_run_registers_as_a_link_to_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative runs directory, as ./runs is
    run = _recorded(Path("runs"), "job-rel", 1.0)
    entry = index_dir() / "job-rel"
    assert entry.is_symlink() and entry.readlink() == tmp_path / "runs" / "job-rel"
    register_run(run, index_dir())  # the detached launcher and its controller both register: the same entry
    assert entry.readlink() == tmp_path / "runs" / "job-rel"
    assert not [p for p in index_dir().iterdir() if p.name.startswith(".")], "a temporary name was left"


def test_registering_prunes_entries_whose_run_is_gone(tmp_path: Path) -> None:
    index = tmp_path / "index"
    gone = create_run_dir(tmp_path / "runs", "job-gone")
    register_run(gone, index)
    gone.path.rmdir()
    assert (index / "job-gone").is_symlink()
    register_run(create_run_dir(tmp_path / "runs", "job-new"), index)
    assert sorted(p.name for p in index.iterdir()) == ["job-new"]


def test_an_index_that_cannot_be_made_warns_and_fails_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = RunDir(tmp_path / "runs" / "job-x")
    register_run(run, afile / "harness" / "runs")
    assert capsys.readouterr().err == (
        f"harness: warning: cannot register run job-x in the index of your runs {afile}/harness/runs (Not a "
        f"directory); from other directories, `harness status` finds it only with --runs-dir {tmp_path}/runs\n")


def test_runs_are_listed_once_whether_found_here_or_through_the_index(tmp_path: Path) -> None:
    """A run under ./runs is in the index too, and a runs directory may be reached through a symlink: each
    run is listed once, by its real path, and only runs outside root say where they live."""
    here = _recorded(tmp_path / "here" / "runs", "job-here", 2.0)
    there = _recorded(tmp_path / "there" / "runs", "job-there", 1.0)
    (tmp_path / "alias").symlink_to(tmp_path / "here")
    shutil.rmtree(_recorded(tmp_path / "gone" / "runs", "job-gone", 3.0).path)
    index = index_dir()
    lookup = RunsLookup(tmp_path / "alias" / "runs", index, None)
    runs = [entry.run for entry in lookup.runs() if entry.run.run_id in ("job-here", "job-there", "job-gone")]
    assert [(run.run_id, lookup.elsewhere(run)) for run in runs] == [
        ("job-there", tmp_path / "there" / "runs"), ("job-here", None)]
    assert (index / "job-gone").is_symlink(), "listing is read-only: a dangling entry stays until a launch prunes it"
    table = runs_table(lookup)
    assert table.splitlines()[0].endswith("DURATION  WHERE"), table
    assert f"{tmp_path}/there/runs/" in next(line for line in table.splitlines() if "job-there" in line)
    assert next(line for line in table.splitlines() if "job-here" in line).endswith(f"  {tmp_path}/alias/runs/")
    assert lookup.find("job-there") == there
    assert lookup.find("job-here").path == tmp_path / "alias" / "runs" / "job-here"
    assert RunsLookup(tmp_path / "here" / "runs", None, "--runs-dir").runs()[0].run == here  # given: root alone


def test_a_given_runs_directory_wins_and_every_miss_says_where_it_looked(tmp_path: Path) -> None:
    _recorded(tmp_path / "there" / "runs", "job-indexed", 1.0)
    env = {k: v for k, v in os.environ.items() if k != "HARNESS_RUNS_DIR"}
    here = tmp_path / "here"
    here.mkdir()
    found = harness("status", "job-indexed", cwd=here, env=env)
    assert found.stdout.startswith("run job-indexed: succeeded"), found.stderr
    index = index_dir()
    for verb in ("status", "stop", "stacks"):
        missed = harness(verb, "no-such-run", cwd=here, env=env)
        assert (missed.returncode, missed.stdout) == (2, ""), missed
        assert missed.stderr.startswith(f"harness: error: no run no-such-run in runs/ nor in the index of your runs "
                                        f"({index}); recent runs: "), missed.stderr
        assert missed.stderr.endswith("; pass --runs-dir DIR or set HARNESS_RUNS_DIR to look in another directory\n")
    given = harness("status", "job-indexed", "--runs-dir", "elsewhere", cwd=here, env=env)
    assert (given.returncode, given.stderr) == (2, (
        "harness: error: no run job-indexed in elsewhere/ (named by --runs-dir); recent runs: none; leave out "
        "--runs-dir to look in ./runs and the index of your runs, or pass another directory\n"))
    listing = harness("status", cwd=here, env={**env, "HARNESS_RUNS_DIR": "elsewhere"})
    assert (listing.returncode, listing.stdout) == (0, (
        "no runs in elsewhere/ (named by HARNESS_RUNS_DIR); unset HARNESS_RUNS_DIR to look in ./runs and the "
        "index of your runs, or set it to another directory\n"))
