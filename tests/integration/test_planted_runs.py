"""Run records that are not the caller's, planted by another local user (uid 12345 via setpriv, as the attacks run
it) and naming a process of root's (a `sleep` this test starts: its pid and start ticks are public in /proc), with a
start newer than any: root's `stop`, `attach`, `stacks`, `logs`, `status`, `top` and `report` refuse them in one
line, nothing is signalled, nothing of the planted run is loaded or changed, and `latest` picks root's own run (the
rules on real files: unit/test_record_trust.py). No launch: the verbs refuse before anything would run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node.proctable import is_alive, start_ticks
from harness.record.index import register_run
from harness.record.rundir import RunDir, make_run_folder
from harness.record.schema import ControllerId, Origin, RunState, RunStatus, record_text

OTHER = 12345
AS_OTHER = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"]
PLANTED = "train-20990101-000000-abcdef"
# What the planted run's spec would have a restart ship, were it loaded: root's key.
PLANTED_SPEC = ("name: train\nnnodes: 1\nentrypoint: {module: harness.payload.train}\n"
                "secrets:\n  STOLEN: {file: ~/.ssh/id_ed25519}\n")
# The planter's own process writes the record: only the standard library, as that user.
PLANT = """
import os, sys
folder, state, spec = sys.argv[1], sys.stdin.read(), sys.argv[2]
os.makedirs(folder)
with open(os.path.join(folder, "state.json"), "w") as f: f.write(state)
with open(os.path.join(folder, "spec.yaml"), "w") as f: f.write(spec)
"""


@pytest.fixture
def roots_sleep() -> Iterator[tuple[int, int]]:
    """A process of root's: its pid and start ticks, as anyone reads them in /proc."""
    sleep = subprocess.Popen(["sleep", "600"])
    ticks = start_ticks(sleep.pid)
    assert ticks is not None
    try:
        yield sleep.pid, ticks
    finally:
        sleep.kill()
        sleep.wait()


@pytest.fixture
def planters_dir() -> Iterator[Path]:
    """A directory the other user owns, as its home or a project of its would be."""
    folder = Path(tempfile.mkdtemp(prefix="harness-planter-"))
    os.chown(folder, OTHER, OTHER)
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _state(run_id: str, pid: int, ticks: int, cwd: Path, started_at: float, status: RunStatus) -> str:
    return record_text(RunState(run_id=run_id, name="train", mode="local", status=status, started_at=started_at,
                                nnodes=1, world_size=1, controller=ControllerId(pid, ticks, socket.gethostname()),
                                hosts=["sim0"], grace=300.0,
                                origin=Origin(cwd=str(cwd), spec_file=str(cwd / "job.yaml"))))


def _plant(folder: Path, state: str) -> None:
    """The other user writes the record, in a process of its own."""
    subprocess.run([*AS_OTHER, sys.executable, "-I", "-c", PLANT, str(folder), PLANTED_SPEC], input=state,
                   text=True, check=True)


def _tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under folder with its owner, size and time: what a verb would change."""
    return {str(path.relative_to(folder)): (path.lstat().st_uid, path.lstat().st_size, path.lstat().st_mtime_ns)
            for path in [folder, *folder.rglob("*")]}


def _roots(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Root's environment with an index of runs of its own (empty until a run of root's registers)."""
    return {k: v for k, v in os.environ.items() if k != "HARNESS_RUNS_DIR"} | {
        "XDG_STATE_HOME": str(tmp_path / "state")} | extra


VERBS = [["stop", "--timeout", "1"], ["attach"], ["stacks", "--timeout", "1"], ["logs"], ["status"], ["top", "--once"],
         ["report"]]


def test_a_run_planted_where_root_runs_the_verbs_is_refused_and_latest_picks_roots_own(
        tmp_path: Path, roots_sleep: tuple[int, int], planters_dir: Path) -> None:
    """The planter's directory is root's working directory (its ./runs), or the runs directory root names."""
    pid, ticks = roots_sleep
    planted = planters_dir / "runs" / PLANTED
    _plant(planted, _state(PLANTED, pid, ticks, planters_dir, time.time() + 3600, RunStatus.RUNNING))
    before = _tree(planters_dir)
    env = _env(tmp_path)
    index = tmp_path / "state" / "harness" / "runs"
    not_yours = (f"harness: error: run {PLANTED} is not yours: {planted} is owned by uid {OTHER}, not by you (root "
                 f"(uid 0)); harness acts only on runs of your own (their owner may act on it, e.g. `sudo -u #{OTHER} "
                 f"harness ...`)\n")
    for verb, *options in VERBS:
        for name in ("latest", PLANTED, "train"):
            refused = _roots(verb, name, *options, cwd=planters_dir, env=env)
            theirs = f"is another user's (runs/{PLANTED} of uid {OTHER}), and harness acts only on runs of your own\n"
            expected = not_yours if name == PLANTED else (
                f"harness: error: no run of yours {'is' if name == 'latest' else 'matches train'} in runs/ nor in the "
                f"index of your runs ({index}); the one there {theirs}")
            assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", expected), (verb, name)
        named = _roots(verb, "latest", *options, "--runs-dir", str(planted.parent), cwd=tmp_path, env=env)
        assert named.returncode == 2 and "no run of yours is in" in named.stderr and named.stdout == "", named
        from_env = _roots(verb, PLANTED, *options, cwd=tmp_path, env=_env(tmp_path, HARNESS_RUNS_DIR=str(planted.parent)))
        assert (from_env.returncode, from_env.stderr) == (2, not_yours), from_env
    assert is_alive(pid, ticks), "root's process was signalled"
    assert _tree(planters_dir) == before, "the planted run was changed"
    listed = _roots("status", cwd=planters_dir, env=env)
    assert listed.stdout == (f"no runs in runs/ nor in the index of your runs ({index}); pass --runs-dir DIR or set "
                             f"HARNESS_RUNS_DIR to look in another directory\n(1 run(s) of other users there are not "
                             f"listed: harness shows and acts on runs of your own only)\n"), listed

    # A run of root's own, older than the planted one's claimed start: `latest` is root's.
    own = RunDir(tmp_path / "runs" / "train-20260101-000000-000000")
    make_run_folder(own.path)
    own.path.joinpath("state.json").write_text(_state(own.run_id, 1, 1, tmp_path, time.time() - 60,
                                                      RunStatus.SUCCEEDED))
    own.state_file.chmod(0o600)
    register_run(own, index)
    stopped = _roots("stop", "latest", cwd=planters_dir, env=env)
    assert (stopped.returncode, stopped.stdout) == (0, f"run {own.run_id} already ended: succeeded\n"), stopped
    shown = _roots("status", "latest", cwd=planters_dir, env=env)
    assert shown.stdout.startswith(f"run {own.run_id}: succeeded"), shown
    assert is_alive(pid, ticks) and _tree(planters_dir) == before


def test_a_run_swapped_in_through_a_runs_directory_others_may_write_is_refused(
        tmp_path: Path, roots_sleep: tuple[int, int]) -> None:
    """A runs directory of root's that the other user's group may write (as `mkdir runs` under umask 002 with a
    shared group once made it): the other user moves root's run aside and puts its own under the same id. Root's
    verbs refuse the swapped run for its owner, and any run there for the directory, until it is closed or shared
    on purpose."""
    pid, ticks = roots_sleep
    reachable = Path(tempfile.mkdtemp(prefix="harness-roots-"))  # root's, as a project of root's outside its home
    reachable.chmod(0o755)
    try:
        _swap_and_refuse(tmp_path, reachable / "runs", pid, ticks)
    finally:
        shutil.rmtree(reachable, ignore_errors=True)


def _swap_and_refuse(tmp_path: Path, runs: Path, pid: int, ticks: int) -> None:
    own = RunDir(runs / "train-20260101-000000-000000")
    make_run_folder(own.path)
    own.path.joinpath("state.json").write_text(_state(own.run_id, 1, 1, tmp_path, time.time(), RunStatus.SUCCEEDED))
    os.chown(runs, 0, OTHER)
    runs.chmod(0o775)
    subprocess.run([*AS_OTHER, "mv", str(own.path), str(runs / "aside")], check=True)
    _plant(own.path, _state(own.run_id, pid, ticks, tmp_path, time.time() + 3600, RunStatus.RUNNING))
    env = _env(tmp_path)
    for verb, *options in VERBS:
        refused = _roots(verb, own.run_id, *options, "--runs-dir", str(runs), cwd=tmp_path, env=env)
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert refused.stderr.startswith(f"harness: error: run {own.run_id} is not yours: {own.path} is owned by uid "
                                         f"{OTHER}"), refused
    shutil.rmtree(own.path)
    os.rename(runs / "aside", own.path)  # root's own again, in a directory the group may still write
    shown = _roots("status", own.run_id, "--runs-dir", str(runs), cwd=tmp_path, env=env)
    assert (shown.returncode, shown.stderr) == (2, (
        f"harness: error: the runs directory {runs} (mode 0775) may be written by group {OTHER}, who could put a run "
        f"of theirs there or replace yours: `chmod g-w {runs}`, or set HARNESS_RUNS_GROUP to its group if it is "
        f"shared with that group on purpose (docs/cli.md)\n")), shown
    shared = _roots("status", own.run_id, "--runs-dir", str(runs), cwd=tmp_path,
                    env=_env(tmp_path, HARNESS_RUNS_GROUP=str(OTHER)))
    assert shared.stdout.startswith(f"run {own.run_id}: succeeded"), shared
    assert is_alive(pid, ticks)
    json.loads(own.state_file.read_text())  # root's record as it was
