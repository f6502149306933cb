"""Whose a run's record is (record/trust.py), on real folders and files that another uid owns or may write (the
attacks as that user, through the CLI: integration/test_planted_runs.py): a record is believed only when its folder
and every file in it are the caller's, in a runs directory no one else can change unless it is shared with a group
on purpose; `latest` and prefixes pick the caller's runs only; records are private whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.record.disk import RecordDisk
from harness.record.index import RunsLookup, create_run_dir, register_run
from harness.record.rundir import RunDir, make_run_folder
from harness.record.schema import ControllerId, RunState, RunStatus
from harness.record.stream import StreamRecord
from harness.record.timeline import Sample
from harness.record.trust import SHARED_GROUP, check_run_folder, check_runs_dir
from harness.view.status import runs_table

OTHER = 12345  # another local user, as the attacks run it (setpriv --reuid=12345)


def _recorded(root: Path, run_id: str, started_at: float) -> RunDir:
    run = RunDir(root / run_id)
    make_run_folder(run.path)
    run.write_state(RunState(run_id=run_id, name="job", mode="local", status=RunStatus.SUCCEEDED,
                             started_at=started_at, nnodes=1, world_size=1, controller=ControllerId(1, 1), hosts=["x"]))
    return run


def _refused(run: RunDir) -> str:
    with pytest.raises(UsageError) as refused:
        check_run_folder(run.path, run.run_id)
    return str(refused.value)


def _all_modes(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): oct(stat.S_IMODE(path.lstat().st_mode))
            for path in [folder, *folder.rglob("*")]}


def test_a_record_is_believed_only_when_its_folder_and_every_file_in_it_are_the_callers(tmp_path: Path) -> None:
    run = _recorded(tmp_path / "runs", "job-1", 1.0)
    run.write_text(run.stream / "attempt0" / "node0.log", "x\n", "a log")
    check_run_folder(run.path, run.run_id)
    os.chown(run.stream / "attempt0" / "node0.log", OTHER, OTHER)
    assert _refused(run) == (
        f"run job-1 is not yours: {run.stream}/attempt0/node0.log is owned by uid {OTHER}, not by you (root (uid 0)); "
        f"harness acts only on runs of your own (their owner may act on it, e.g. `sudo -u #{OTHER} harness ...`)")
    os.chown(run.stream / "attempt0" / "node0.log", 0, 0)
    os.chown(run.path, OTHER, OTHER)
    assert _refused(run).startswith(f"run job-1 is not yours: {run.path} is owned by uid {OTHER}, not by you")
    os.chown(run.path, 0, 0)
    run.path.chmod(0o770)
    os.chown(run.path, 0, OTHER)
    assert _refused(run) == (f"run job-1: its folder {run.path} (mode 0770) may be written by group {OTHER}, who could "
                             f"have changed its record; `chmod go-w {run.path}` if nobody did")
    run.path.chmod(0o755)  # others may reach its files now: none of them may be theirs to write
    run.state_file.chmod(0o666)
    assert _refused(run).startswith(f"run job-1: {run.state_file} (mode 0666) may be written by every user,")


def test_a_runs_directory_others_can_change_is_refused_unless_it_is_shared_with_its_group_on_purpose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    run = _recorded(runs, "job-1", 1.0)
    assert stat.S_IMODE(runs.stat().st_mode) == 0o700
    runs.chmod(0o775)  # root's own group (no other member) may write it: nobody else
    check_run_folder(run.path, run.run_id)
    os.chown(runs, 0, OTHER)
    assert _refused(run) == (
        f"the runs directory {runs} (mode 0775) may be written by group {OTHER}, who could put a run of theirs there "
        f"or replace yours: `chmod g-w {runs}`, or set {SHARED_GROUP} to its group if it is shared with that group on "
        f"purpose (docs/cli.md)")
    with pytest.raises(UsageError, match="may be written by group 12345,"):
        make_run_folder(runs / "job-2")  # a launch is refused too, before anything of it is made
    assert not (runs / "job-2").exists()
    monkeypatch.setenv(SHARED_GROUP, str(OTHER))  # shared with it on purpose: the group may read a run, never write
    check_run_folder(run.path, run.run_id)
    shared = _recorded(runs, "job-2", 2.0)
    assert (stat.S_IMODE(shared.path.stat().st_mode), shared.path.stat().st_gid) == (0o750, OTHER)
    assert stat.S_IMODE(shared.state_file.stat().st_mode) == 0o640
    check_run_folder(shared.path, shared.run_id)
    os.chown(runs, OTHER, OTHER)  # a member's directory
    check_run_folder(shared.path, shared.run_id)
    runs.chmod(0o777)
    assert "(mode 0777) may be written by every user," in _refused(run)
    monkeypatch.delenv(SHARED_GROUP)
    assert _refused(run).startswith(f"the runs directory {runs} is owned by uid {OTHER}, not by you")
    os.chown(runs, 0, 0)
    runs.chmod(0o1777)  # as /tmp: others may add runs, not replace or remove the caller's
    check_run_folder(run.path, run.run_id)
    os.chown(tmp_path, OTHER, OTHER)
    assert check_runs_dir_refusal(runs) == (
        f"{tmp_path} is owned by uid {OTHER}, who could replace the runs directory {runs} under it with runs of their "
        f"own; keep your runs under a directory of yours (--runs-dir or HARNESS_RUNS_DIR)")
    os.chown(tmp_path, 0, 0)
    monkeypatch.setenv(SHARED_GROUP, "no-such-group-here")
    with pytest.raises(UsageError, match=f"^{SHARED_GROUP}='no-such-group-here' names no group of this machine"):
        make_run_folder(runs / "job-3")


def check_runs_dir_refusal(runs: Path) -> str:
    with pytest.raises(UsageError) as refused:
        check_runs_dir(runs)
    return str(refused.value)


def test_latest_and_prefixes_pick_the_callers_runs_only_and_say_whose_the_others_are(tmp_path: Path) -> None:
    root, index = tmp_path / "runs", tmp_path / "index"
    mine = _recorded(root, "job-20260101-000000-aaaaaa", 1.0)
    register_run(mine, index)
    theirs = _recorded(tmp_path / "there", "job-20260101-000001-bbbbbb", 9.0)  # newer, as its writer chose
    register_run(theirs, index)
    os.chown(theirs.path, OTHER, OTHER)
    lookup = RunsLookup(root, index, None)
    assert [entry.run for entry in lookup.runs()] == [mine]
    assert lookup.others() == [theirs]
    assert (lookup.find("latest"), lookup.find("job")) == (mine, mine)
    with pytest.raises(UsageError, match=f"^run {theirs.run_id} is not yours: {theirs.path} is owned by uid {OTHER}"):
        lookup.find(theirs.run_id)
    with pytest.raises(UsageError) as refused:
        lookup.find("job-20260101-000001")
    assert str(refused.value) == (
        f"no run of yours matches job-20260101-000001 in {root}/ nor in the index of your runs ({index}); the one there "
        f"is another user's ({theirs.path} of uid {OTHER}), and harness acts only on runs of your own")
    assert runs_table(lookup).endswith(
        "\n(1 run(s) of other users there are not listed: harness shows and acts on runs of your own only)\n")
    alone = RunsLookup(tmp_path / "there", None, "--runs-dir")
    with pytest.raises(UsageError, match=r"^no run of yours is in .*; the one there is another user's"):
        alone.find("latest")


@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_records_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """Every folder and file the record's writers make: the runs directory and the folders above it that the
    harness makes, the run's folder, its files whole (write_text), appended (the disk, the stream, the timeline),
    their sub-folders, and the index of runs."""
    old = os.umask(umask)
    try:
        runs = tmp_path / "made" / "by" / "harness" / "runs"
        run = create_run_dir(runs, "job-1")
        register_run(run, tmp_path / "state" / "harness" / "runs")
        run.write_text(run.hang_stacks(0) / "stacks.json", "{}", "stacks")
        disk = RecordDisk(run.path)
        disk.keep_reserve()
        stream = StreamRecord(run.stream, disk=disk)
        stream.harness("a line")
        node = stream.open_node(1, 0)
        node.write("a node's line\n")
        node.close()
        disk.close()
        run.append_timeline(Sample(1.0, 0, {}))
    finally:
        os.umask(old)
    made = [tmp_path / "made", tmp_path / "made" / "by", tmp_path / "made" / "by" / "harness", runs,
            tmp_path / "state", tmp_path / "state" / "harness", tmp_path / "state" / "harness" / "runs"]
    assert {str(path): oct(stat.S_IMODE(path.stat().st_mode)) for path in made} == {str(p): "0o700" for p in made}
    modes = _all_modes(run.path)
    assert {"logs/attempt1/node0.log", "logs/harness.log", "stacks/attempt-0/stacks.json", "timeline.jsonl"} <= set(modes)
    assert {name: mode for name, mode in modes.items()
            if mode != ("0o700" if (run.path / name).is_dir() else "0o600")} == {}
