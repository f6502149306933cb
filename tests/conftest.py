"""Shared test helpers: run the real CLI, write job specs, find processes of a run."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.procs import run_processes

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def harness(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real `harness` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def leftover(run_id: str) -> list[int]:
    return run_processes(run_id)


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write dedented YAML to a file under tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write
