"""A small file system of its own at a folder (tmpfs, root only), for tests of what the harness and the payload do
when a disk fills up or turns read-only under them: filled to the last byte, emptied again, remounted read-only.
Unmounted on exit, also when the test fails.

    from testbed.disk import small_disk

    with small_disk(tmp_path / "runs", "16m") as disk:
        disk.fill()
        ...
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

FILLER = ".filler"


class SmallDisk:
    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def fill(self, leave: int = 0) -> None:
        """Every byte taken but `leave` (a file that grows until the file system refuses it, or has that left)."""
        chunk = b"\0" * (64 << 10)
        with open(self.mount / FILLER, "ab", buffering=0) as filler:
            for size in (len(chunk), 4096, 1):
                with contextlib.suppress(OSError):
                    while not leave or self.free_bytes() >= leave + size:
                        filler.write(chunk[:size])

    def empty(self) -> None:
        """The filler gone: the file system has room again."""
        (self.mount / FILLER).unlink(missing_ok=True)

    def read_only(self, on: bool = True) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if on else 'rw'}", str(self.mount)], check=True)

    def free_bytes(self) -> int:
        disk = os.statvfs(self.mount)
        return disk.f_bavail * disk.f_frsize


@contextlib.contextmanager
def small_disk(mount: Path, size: str) -> Iterator[SmallDisk]:
    """A tmpfs of size (`16m`) mounted at mount (made where missing) for the block's life."""
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "harness-test-disk", str(mount)],
                   check=True)
    try:
        yield SmallDisk(mount)
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)
