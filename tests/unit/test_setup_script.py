"""The job's `setup:` script as /bin/sh runs it before torchrun: once per working directory, again when
it failed or changed (the same through `harness launch`: tests/integration/test_setup.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.plan.setup_script import setup_id, setup_script, with_setup


def started(script: str | None, workdir: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(with_setup(argv or ["echo", "torchrun"], script), cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_nodes_sharing_a_workdir_run_the_setup_once_and_every_one_then_starts(tmp_path):
    script = setup_script(["echo run >> count; sleep 1", "mkdir -p data/x"], ["data/x"])
    nodes = [started(script, tmp_path, "echo", f"torchrun {n}") for n in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0, 0], outputs
    assert (tmp_path / "count").read_text() == "run\n"
    assert [f"torchrun {n}" in out for n, out in enumerate(outputs)] == [True] * 3
    assert sum("harness setup: running 2 command(s)" in out for out in outputs) == 1, outputs
    assert sum("harness setup: done before" in out for out in outputs) == 2, outputs
    again = started(script, tmp_path).communicate(timeout=60)[0]
    assert "done before" in again and (tmp_path / "count").read_text() == "run\n"
    edited = setup_script(["echo edited >> count"])
    assert started(edited, tmp_path).wait(timeout=60) == 0
    assert (tmp_path / "count").read_text() == "run\nedited\n", "edited commands run again"


def test_a_failed_setup_starts_nothing_and_runs_again_next_time(tmp_path):
    script = setup_script(["echo fetching; test -e ready || exit 4", "echo second >> count"])
    node = started(script, tmp_path)
    out = node.communicate(timeout=60)[0]
    log = tmp_path / ".harness" / f"setup-{setup_id(['echo fetching; test -e ready || exit 4', 'echo second >> count'])}.log"
    assert node.returncode == 4, out
    assert f"harness setup failed: exit 4; torchrun was not started here. Its log: {log}" in out
    assert "torchrun\n" not in out and not (tmp_path / "count").exists(), "a failed command stops the rest"
    assert log.read_text() == "fetching\n"
    (tmp_path / "ready").touch()
    assert started(script, tmp_path).communicate(timeout=60)[0].endswith("torchrun\n")
    assert (tmp_path / "count").read_text() == "second\n"


def test_setup_must_leave_the_data_paths_it_was_meant_to_create(tmp_path):
    node = started(setup_script(["mkdir -p data"], ["data", "data/cifar 10"]), tmp_path)
    out = node.communicate(timeout=60)[0]
    assert node.returncode == 1
    assert f"the commands succeeded but data path data/cifar 10 is still missing in {tmp_path}" in out
    assert not list((tmp_path / ".harness").glob("*.done")), "not done: the next launch tries again"


def test_commands_find_the_jobs_python_first_on_path(tmp_path):
    script = setup_script(['python -c "import sys; print(sys.executable)"'])
    out = started(script, tmp_path, sys.executable, "-c", "print('the node')").communicate(timeout=60)[0]
    assert f"{sys.executable}\nthe node\n" in out or f"{Path(sys.executable).parent}/python\nthe node\n" in out, out
