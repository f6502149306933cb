"""A real OOM kill: a process over its memory cgroup's limit, ended by the kernel's OOM killer, and
harness.node.oom naming it from the kernel's log and from the cgroup's counter (the parsing:
tests/unit/test_oom_kernel_lines.py)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node.oom import cgroup_oom_kills, memory_cgroup, oom_counts, oom_kills

LIMIT = 64 * 2**20
# Waits for a word on stdin (its cgroup is set by then), then touches 500 MB.
HOG = "import sys; sys.stdin.readline(); x = b'\\x01' * (500 * 2**20); print('survived', flush=True)"


def _memory_parent() -> tuple[Path, dict[str, str]]:
    """Where a memory-limited child cgroup can be made here, and the files that limit it (memory and swap):
    the cgroup v2 root where v2 has the memory controller, else this process's v1 memory cgroup."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    for _, point, kind, *_ in mounts:
        if kind == "cgroup2" and "memory" in (Path(point) / "cgroup.controllers").read_text().split():
            (Path(point) / "cgroup.subtree_control").write_text("+memory")
            return Path(point), {"memory.max": str(LIMIT), "memory.swap.max": "0"}
    own = memory_cgroup()
    if own is None:
        pytest.fail("no memory controller in cgroup v2 nor v1 on this machine: a memory limit cannot be set")
    return own, {"memory.limit_in_bytes": str(LIMIT), "memory.memsw.limit_in_bytes": str(LIMIT)}


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup of 64 MiB without swap; removed afterwards, whatever happened."""
    parent, limits = _memory_parent()
    cgroup = parent / f"harness-oom-test-{secrets.token_hex(4)}"
    cgroup.mkdir()
    try:
        for name, value in limits.items():
            if (cgroup / name).exists():  # v1 without swap accounting has no memsw file: nothing to swap to limit
                (cgroup / name).write_text(value)
        yield cgroup
    finally:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # the kernel frees a cgroup's last task a moment after it is reaped
            try:
                cgroup.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_a_process_the_oom_killer_ends_is_named_with_the_kernels_line(limited_cgroup: Path):
    since = time.time()
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hog.stdin is not None
    try:
        (limited_cgroup / "cgroup.procs").write_text(str(hog.pid))
        before = oom_counts([hog.pid])
        assert before == {str(limited_cgroup): 0}, before
        hog.stdin.write("go\n")
        hog.stdin.flush()
        out, _ = hog.communicate(timeout=60)
    finally:
        if hog.poll() is None:
            hog.kill()
            hog.wait()
    assert hog.returncode == -signal.SIGKILL and "survived" not in out, (hog.returncode, out)
    found = oom_kills({hog.pid: 5, hog.pid + 1: 6}, since)
    assert list(found) == [5], found
    assert f"Killed process {hog.pid} (python" in found[5], found
    # Where the kernel's log cannot be read (no root, a container), the cgroup's counter tells it.
    assert cgroup_oom_kills({hog.pid: 5}, before) == {
        5: f"memory cgroup {limited_cgroup}: oom_kill count grew from 0 to 1 (the kernel's log is not readable here)"}
    assert oom_kills({hog.pid: 5}, time.time() + 3600) == {}, "a kill before `since` is not this node's"
