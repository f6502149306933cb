"""What the Kubernetes controller writes on the job's volume, which every pod of the job can write too: nothing
planted there is followed or believed."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.commands import share_tools
from harness.node.ranks import py_spy_path
from harness.record.index import create_run_dir
from harness.record.liveness import left_by_a_lost_controller
from harness.record.rundir import RunDir
from harness.record.schema import ControllerId, LiveHealth, RunState, RunStatus, record_text


def test_py_spy_is_shared_on_the_volume_without_following_a_planted_link(tmp_path: Path) -> None:
    """A pod plants links where the copy goes and where its partial file used to go (`.py-spy.PID`): the copy
    writes through neither, and the pods' py-spy is the controller's, a file of its own."""
    victim = tmp_path / "victim"
    victim.write_text("the controller's own file\n")
    tools = tmp_path / "volume" / ".harness" / "bin"
    tools.mkdir(parents=True)
    (tools / "py-spy").symlink_to(victim)
    (tools / f".py-spy.{os.getpid()}").symlink_to(victim)
    found = py_spy_path()
    assert found is not None, "py-spy is in the test environment (pyproject's test extra)"

    share_tools(tools)

    assert victim.read_text() == "the controller's own file\n"
    shared = (tools / "py-spy").lstat()
    assert stat.S_ISREG(shared.st_mode) and stat.S_IMODE(shared.st_mode) == 0o755
    assert (tools / "py-spy").read_bytes() == Path(found).read_bytes()
    assert sorted(p.name for p in tools.iterdir()) == [f".py-spy.{os.getpid()}", "py-spy"]  # no partial left


GRACE = 300.0  # the new controller's own supervision.grace (its spec's)


def controller_record(run: RunDir, started_at: float, seen: float, grace: float = GRACE) -> None:
    """A running k8s record as its controller pod writes it: its state, and health.json's time of its last watch."""
    run.write_state(RunState(run_id=run.run_id, name="job", mode="k8s", status=RunStatus.RUNNING,
                             started_at=started_at, nnodes=2, world_size=2,
                             controller=ControllerId(1, None, "job-abcde"), hosts=["job-node-0-x", "job-node-1-y"],
                             grace=grace))
    run.write_health(LiveHealth(attempt=0, t=seen))


@pytest.fixture
def volume_runs() -> Iterator[Path]:
    """The runs directory on the job's volume, where another user may add entries (sticky, as a shared one is): in
    the machine's /tmp, which another user can reach (pytest's own temporary folders are the test user's alone)."""
    volume = Path(tempfile.mkdtemp(prefix="harness-volume-"))
    volume.chmod(0o755)
    root = volume / "runs"
    root.mkdir()
    root.chmod(0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(volume)


def test_the_next_controller_takes_back_its_predecessors_run_and_no_run_a_pod_planted(volume_runs: Path) -> None:
    """The lost controller's run, seen 5 s ago, beside newer runs planted on the volume: one whose controller was
    last seen an hour from now (held for good, were it believed; said), one whose record gives itself a grace of
    30 years and was last seen an hour ago (the new controller's own grace decides), and one another user wrote
    into the volume's runs directory (sticky, as a shared one is): only the lost controller's is taken back."""
    root = volume_runs
    now = time.time()
    controller_record(create_run_dir(root, "job-lost"), now - 100, now - 5)
    controller_record(create_run_dir(root, "job-future"), now - 50, now + 3600)
    controller_record(create_run_dir(root, "job-forever"), now - 40, now - 3600, grace=1e9)
    planted = RunState(run_id="job-other", name="job", mode="k8s", status=RunStatus.RUNNING, started_at=now - 30,
                       nnodes=2, world_size=2, controller=ControllerId(1, None, "job-abcde"), hosts=["job-node-0-x"],
                       grace=GRACE)
    plant = (f"import os, pathlib; run = pathlib.Path({str(root / 'job-other')!r}); run.mkdir(); "
             f"(run / 'state.json').write_text({record_text(planted)!r}); "
             f"(run / 'health.json').write_text({record_text(LiveHealth(attempt=0, t=now))!r})")
    other = subprocess.run(["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", sys.executable, "-c",
                            plant], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert (root / "job-other" / "state.json").stat().st_uid == 12345
    said: list[str] = []

    taken = left_by_a_lost_controller(root, "job", "k8s", GRACE, said.append)

    assert taken is not None and taken.run_id == "job-lost"
    # seconds from the moment it is said: less than 3600 by what a busy machine took since the record was written
    assert len(said) == 1 and re.fullmatch(r"run job-future is not taken back: its record says its controller was "
                                           r"last seen 3(5[0-9]{2}|600) s from now, a time no controller wrote",
                                           said[0]), said
    assert taken.read_state().hosts == ["job-node-0-x", "job-node-1-y"]
