"""Preflight's engine check against the real engine CLIs on this machine: a docker without its daemon,
an engine that is not installed (no container runs; podman on every host: tests/integration/test_containers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from harness.preflight.image import ImageFacts, engine_row, image_facts, inspect_command
from harness.preflight.table import Status
from harness.targets.ssh.transport import CommandResult
from testbed.podman_config import IMAGE


def _engine_answer(engine: str, env: dict[str, str]) -> tuple[ImageFacts, int]:
    """What preflight's one command per host gets from a real engine CLI on this machine."""
    result = subprocess.run(["/bin/sh", "-c", inspect_command(engine, IMAGE)], capture_output=True, text=True,
                            env=env, timeout=60)
    return image_facts(CommandResult(result.returncode, result.stdout, result.stderr)), result.returncode


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
def test_a_docker_without_its_daemon_fails_the_engine_check(tmp_path):
    """The docker CLI pointed at a socket nobody serves (nothing is sent anywhere)."""
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/no-daemon.sock", DOCKER_CONFIG=str(tmp_path))
    facts, status = _engine_answer("docker", env)
    row = engine_row("h1", "docker", facts, status)
    assert row.status is Status.FAIL and facts.version is None and facts.image_id is None
    assert "docker does not answer: Cannot connect to the Docker daemon" in row.reason
    assert "is dockerd running" in row.reason and row.fix == "check `docker version` on h1"


def test_an_engine_that_is_not_installed_is_named(tmp_path):
    facts, status = _engine_answer("podman", dict(os.environ, PATH=str(tmp_path)))
    row = engine_row("h2", "podman", facts, status)
    assert status == 127 and row.status is Status.FAIL
    assert row.reason == "podman is not installed (`podman`: command not found)"
    assert "install podman on h2" in (row.fix or "")
