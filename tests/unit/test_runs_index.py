"""The user's index of runs: where it lives (XDG), how a run registers, and how runs are found and listed
once each from ./runs and the index (the CLI end to end: integration/test_runs_anywhere.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.record.index import RunsLookup, create_run_dir, index_dir, register_run
from harness.record.rundir import RunDir
from harness.record.schema import ControllerId, RunState, RunStatus
from harness.view.status import runs_table

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


def test_a_run_is_named_by_its_id_a_unique_prefix_of_one_or_latest(tmp_path: Path) -> None:
    """One lookup for every verb: an exact id first (even when longer ids start with it), then `latest`, the
    newest start among the runs listed (the index's included), then a prefix that only one id starts with."""
    root, index = tmp_path / "runs", tmp_path / "index"
    smoke = _recorded(root, "smoke-20261121-101500-abcdef", 3.0)
    _recorded(root, "smoke-20261121-101500-aa0000", 1.0)
    train = _recorded(root, "train-20261121-090000-cccccc", 2.0)
    job, longer = _recorded(root, "job-1", 0.5), _recorded(root, "job-1-2", 0.7)
    elsewhere = _recorded(tmp_path / "there" / "runs", "other-20261121-120000-dddddd", 4.0)
    register_run(elsewhere, index)
    lookup = RunsLookup(root, index, None)
    assert lookup.find("train") == train
    assert lookup.find("smoke-20261121-101500-ab") == smoke
    assert lookup.find("o") == elsewhere
    assert (lookup.find("job-1"), lookup.find("job-1-")) == (job, longer)
    assert lookup.find("latest") == elsewhere
    assert RunsLookup(root, None, "--runs-dir").find("latest") == smoke, "newest by start, not by name"
    _recorded(root, "latest", 0.1)
    assert lookup.find("latest").run_id == "latest", "an exact id wins over the word too"


def test_a_prefix_of_several_runs_names_them_and_a_miss_says_where_it_looked(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    lookup = RunsLookup(root, None, "--runs-dir")
    with pytest.raises(UsageError) as none:
        lookup.find("latest")
    assert str(none.value) == (f"no run latest in {root}/ (named by --runs-dir); recent runs: none; leave out "
                               f"--runs-dir to look in ./runs and the index of your runs, or pass another directory")
    for number in range(12):
        _recorded(root, f"sweep-{number:02d}", float(number))
    with pytest.raises(UsageError) as several:
        lookup.find("sweep-0")
    assert str(several.value) == ("sweep-0 is the start of 10 run ids: sweep-09, sweep-08, sweep-07, sweep-06, "
                                  "sweep-05, sweep-04, sweep-03, sweep-02, sweep-01, sweep-00; type more of the one "
                                  "you mean")
    with pytest.raises(UsageError, match=r"^sweep is the start of 12 run ids: sweep-11, sweep-10, .*, sweep-02 and 2 "
                                         r"more; type more of the one you mean$"):
        lookup.find("sweep")
    with pytest.raises(UsageError, match=r"^no run sweep-2 in .*; recent runs: sweep-07, sweep-08, sweep-09, sweep-10, "
                                         r"sweep-11; leave out --runs-dir"):
        lookup.find("sweep-2")
    with pytest.raises(UsageError, match=r"^run id 'Sweep' is not a run id: expected lower-case letters"):
        lookup.find("Sweep")
    for verb in ("status", "stop", "stacks"):  # every verb that takes a run finds it through the lookup
        result = harness(verb, "sweep-1", "--runs-dir", str(root))
        assert (result.returncode, result.stderr) == (2, "harness: error: sweep-1 is the start of 2 run ids: "
                                                         "sweep-11, sweep-10; type more of the one you mean\n"), result
    shown = harness("status", "latest", "--runs-dir", str(root))
    assert shown.stdout.startswith("run sweep-11: succeeded"), shown
