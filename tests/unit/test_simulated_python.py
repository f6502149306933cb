"""`simulated.python`: validated where it is written, and resolved on this machine as a shell would run it
(`~`, the launch directory, PATH), without resolving a virtual environment's link to its base interpreter."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness.errors import SpecError
from harness.spec.job import Simulated, load_job

from conftest import harness

JOB = "name: demo\nnnodes: 2\nbackend: gloo\nentrypoint: {script: train.py}\n"


@pytest.mark.parametrize("written, expected", [
    ("''", "job.yaml:5:13: simulated.python: expected the path of a Python interpreter without blanks, such as "
           "~/envs/train/bin/python, got ''"),
    ("'my env/bin/python'", "job.yaml:5:13: simulated.python: expected the path of a Python interpreter without "
                            "blanks, such as ~/envs/train/bin/python, got 'my env/bin/python'"),
    ('"env/bin/python\\0"', "job.yaml:5:13: simulated.python: expected the path of a Python interpreter"),
    ("3", "job.yaml:5:13: simulated.python: expected the path of a Python interpreter without blanks, such as "
          "~/envs/train/bin/python, got 3"),
    ("[python3]", "job.yaml:5:13: simulated.python: expected the path of a Python interpreter"),
    ("-python", "job.yaml:5:13: simulated.python: '-python' starts with '-', which would be read as an option; "
                "write ./-python"),
    ("envs/train/", "job.yaml:5:13: simulated.python: 'envs/train/' is a directory; name the interpreter in it, "
                    "e.g. envs/train/bin/python"),
])
def test_a_bad_interpreter_is_refused_where_it_is_written(write_yaml, written, expected):
    path = write_yaml(JOB + f"simulated: {{python: {written}}}\n")
    with pytest.raises(SpecError) as info:
        load_job(path)
    found = [str(p) for p in info.value.problems]
    assert len(found) == 1 and expected in found[0], found


def test_a_bad_interpreter_ends_the_cli_with_exit_2(write_yaml):
    path = write_yaml(JOB + "simulated: {python: 'a b'}\n")
    result = harness("render", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert f"{path}:5:13: simulated.python: expected the path of a Python interpreter" in result.stderr


def test_unset_is_the_default_and_written_paths_are_taken_from_the_launch_directory():
    assert Simulated().interpreter("/launch", "/harness/bin/python") == "/harness/bin/python"
    resolved = {written: Simulated(python=written).interpreter("/launch", "/harness/bin/python")
                for written in ("/opt/env/bin/python", "env/bin/python", "../envs/a/bin/python", "~/env/bin/python")}
    assert resolved == {"/opt/env/bin/python": "/opt/env/bin/python", "env/bin/python": "/launch/env/bin/python",
                        "../envs/a/bin/python": "/envs/a/bin/python",
                        "~/env/bin/python": os.path.join(os.path.expanduser("~"), "env/bin/python")}


def test_a_venvs_link_to_its_base_interpreter_is_not_followed(tmp_path: Path):
    """A venv is its bin/python's own path: the base interpreter it links to would run without the venv."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(os.path.realpath(sys.executable))
    assert Simulated(python="venv/bin/python").interpreter(str(tmp_path), sys.executable) == str(python)


def _argv0(result) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [node["argv"][0] for node in json.loads(result.stdout)["nodes"]]


def test_render_plans_every_node_with_the_resolved_interpreter(write_yaml, tmp_path: Path):
    """The plan is what runs: the interpreter as an absolute path (a bare name from PATH); unset, the harness's."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "python-own").symlink_to(os.path.realpath(sys.executable))
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}

    def render(simulated: str) -> list[str]:
        job = write_yaml(JOB + simulated)
        return _argv0(harness("render", str(job), "--format", "json", cwd=tmp_path, env=env))

    assert render("") == [sys.executable] * 2
    assert render("simulated: {python: envs/train/bin/python}\n") == [str(tmp_path / "envs/train/bin/python")] * 2
    assert render("simulated: {python: python-own}\n") == [str(tools / "python-own")] * 2
    assert render("simulated: {python: python-nowhere}\n") == ["python-nowhere"] * 2  # preflight says so
