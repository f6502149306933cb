"""A node made slow as a real one is (a throttled GPU, a noisy neighbour, a host whose CPU is taken): its processes
moved into a CPU cgroup with a quota, a share of one CPU (root only; cgroup v2's cpu.max, else v1's cfs quota).
Moved back and the group removed on exit, also when the test or benchmark fails.

    from testbed.throttle import throttled

    with throttled([pid, ...], share=0.25):
        ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

PERIOD_US = 100_000
V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")


def _root() -> tuple[Path, bool]:
    """Where a CPU group is made here, and whether it is cgroup v2."""
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.controllers").read_text().split():
        return V2, True
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, False
    raise RuntimeError("no CPU cgroup controller is mounted here (neither /sys/fs/cgroup/cgroup.controllers with "
                       "cpu nor /sys/fs/cgroup/cpu)")


@contextlib.contextmanager
def throttled(pids: Sequence[int], share: float, name: str | None = None) -> Iterator[Path]:
    """pids (each process whole: every thread) limited together to share of one CPU while the block runs."""
    root, v2 = _root()
    group = root / (name or f"harness-throttle-{os.getpid()}")
    group.mkdir()
    try:
        quota = int(PERIOD_US * share)
        if v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for left in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(left)
        group.rmdir()
