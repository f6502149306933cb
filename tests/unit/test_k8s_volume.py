"""What the Kubernetes controller writes on the job's volume, which every pod of the job can write too: nothing
planted there is followed or believed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from harness.commands import share_tools
from harness.node.ranks import py_spy_path


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
