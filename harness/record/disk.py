"""The disk a run's record is written to, as the controller writes it (RecordDisk). A write that fails there
(the file system full, read-only, gone) is the harness's own trouble, never the job's: it is said once, in one
line naming the directory and the space left; the job runs on, its lines reach the terminal, and the record
is marked incomplete. A reserve kept aside from the run's start is given back at the first such failure, so
that the record's own small files (state, attempts, summary) can still be written and `harness status` still
says how the run ended; the logs wait until the disk has room again."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

from harness.record.atomic import file_mode, folder_mode, make_folders, write_text_atomic

RESERVE_BYTES = 4 << 20  # kept aside for the record's own files: a summary of 1,024 ranks is a few hundred KiB
RESERVE_FILE = ".reserve-{pid}"  # each controller's own (a batch step's and the launch following it share a folder)
ROOM_CHECK_SECONDS = 5.0  # while writes wait, how often the disk is looked at again


def size_text(n: int) -> str:
    """`0 B`, `512 KiB`, `16.0 MiB`, `1.5 GiB`."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def space_text(path: Path) -> str:
    """What the file system that holds path has left, in words: `0 B free of 16.0 MiB`, read-only or not; or
    why that cannot be told (path and every folder above it gone)."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        disk = os.statvfs(where)
    except OSError as exc:
        return f"its free space cannot be read: {exc.strerror}"
    text = f"{size_text(disk.f_bavail * disk.f_frsize)} free of {size_text(disk.f_blocks * disk.f_frsize)}"
    return f"read-only, {text}" if disk.f_flag & os.ST_RDONLY else text


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on path's file system (0: none, or it cannot be read)."""
    try:
        disk = os.statvfs(path)
    except OSError:
        return 0
    return 0 if disk.f_flag & os.ST_RDONLY else disk.f_bavail * disk.f_frsize


class RecordDisk:
    """folder: the run's directory. notice: how a line reaches the user without being written here (the
    terminal); set once the terminal exists."""

    def __init__(self, folder: Path, notice: Callable[[str], None] = lambda line: None) -> None:
        self.folder = folder
        self.notice = notice
        self._lock = threading.Lock()
        self._gaps: list[list[float]] = []  # [from, to] of each time writes failed; the last may be open: [from]
        self._cause = ""
        self._looked_at = 0.0
        self._said: set[str] = set()
        self._reserved = False
        self._reserve = folder / RESERVE_FILE.format(pid=os.getpid())
        self.mode = file_mode(folder)
        self.folder_mode = folder_mode(folder)

    @property
    def incomplete(self) -> str | None:
        """What the record lacks and why, in words (None: nothing)."""
        if not self._gaps:
            return None
        spans = ", ".join(f"from {_clock(gap[0])}" + (f" to {_clock(gap[1])}" if len(gap) > 1 else "")
                          for gap in self._gaps)
        return f"its record and logs in {self.folder} could not be written {spans} ({self._cause})"

    def keep_reserve(self) -> None:
        """RESERVE_BYTES set aside in the run's directory; an OSError when the disk has not that much room (a
        launch then fails before anything starts)."""
        fd = os.open(self._reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            self._reserve.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._reserved = True

    def close(self) -> None:
        """The reserve given back: the run has ended."""
        self._give_back_reserve()

    def write(self, path: Path, text: str, what: str) -> None:
        """A file of the record written whole (atomically), or left as it was and the failure said; the first
        failure gives the reserve back, and the write is tried once more in its room."""
        def attempt() -> None:
            make_folders(path.parent, self.folder_mode)
            write_text_atomic(path, text, self.mode)

        with self.writing(what):
            try:
                attempt()
            except OSError as exc:
                self._failed(what, exc)
                attempt()

    def appended(self, path: Path, what: str) -> AppendedFile:
        """path, for appending to: what (words for the user) names it where a write fails."""
        return AppendedFile(self, path, what)

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """A write of the record: an OSError in it is said (once for each cause) and ends it, nothing more."""
        try:
            yield
        except OSError as exc:
            self._failed(what, exc)

    def has_room(self) -> bool:
        """Whether appends may be tried: not while writes fail, until a look at the disk (every
        ROOM_CHECK_SECONDS) finds twice the reserve free and the reserve is taken again."""
        if not self._waiting():
            return True
        now = time.time()
        with self._lock:
            if not self._waiting() or now - self._looked_at < ROOM_CHECK_SECONDS:
                return not self._waiting()
            self._looked_at = now
            if free_bytes(self.folder) < 2 * RESERVE_BYTES:
                return False
            with contextlib.suppress(OSError):
                self.keep_reserve()
            self._gaps[-1].append(now)
            self._said.clear()
            since = self._gaps[-1][0]
        self.notice(f"the run's record is written again in {self.folder} ({space_text(self.folder)}); what came "
                    f"between {_clock(since)} and {_clock(now)} is on the terminal only")
        return True

    def _waiting(self) -> bool:
        return bool(self._gaps) and len(self._gaps[-1]) == 1

    def _give_back_reserve(self) -> None:
        with self._lock:
            reserved, self._reserved = self._reserved, False
        if reserved:
            with contextlib.suppress(OSError):
                self._reserve.unlink()

    def _failed(self, what: str, exc: OSError) -> None:
        """Writes wait from now (the reserve given back for the record's own files); said once per cause."""
        why = exc.strerror or str(exc)
        with self._lock:
            first, said = not self._waiting(), why in self._said
            if first or not said:  # the space left when it failed, not once the reserve was given back
                space = space_text(self.folder)
            if first:
                self._gaps.append([time.time()])
                self._looked_at = time.time()
                self._cause = f"{why}; {space}"
            self._said.add(why)
        self._give_back_reserve()
        if not said:
            self.notice(f"cannot write {what} in {self.folder}: {why} ({space}); the job runs "
                        f"on, its lines on this terminal only until the disk has room, and the run's record is "
                        f"incomplete")


class RecordFile:
    """A file of the record opened at its first write (its folder made then), and again after one failed."""

    def __init__(self, disk: RecordDisk, path: Path, what: str) -> None:
        self.disk, self.path, self.what = disk, path, what
        self._fd: int | None = None

    def _opened(self, flags: int) -> int:
        if self._fd is None:
            make_folders(self.path.parent, self.disk.folder_mode)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, self.disk.mode)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AppendedFile(RecordFile):
    """A file of the record that text is appended to, each text whole or not at all (a short write is cut off
    again), nothing while its disk has no room. Its only writer: its size is looked up once, then counted (a
    stream's block is a system call fewer, and each call gives the interpreter's lock to another thread)."""

    def __init__(self, disk: RecordDisk, path: Path, what: str) -> None:
        super().__init__(disk, path, what)
        self.end: int | None = None  # the file's size after the last write (None: none yet)

    def write(self, text: str) -> None:
        if not self.disk.has_room():
            return
        with self.disk.writing(self.what):
            opened = self._fd is not None
            fd = self._opened(os.O_APPEND)
            if not opened or self.end is None:
                self.end = os.fstat(fd).st_size
            data, size, written = text.encode(), self.end, 0
            try:
                while written < len(data):
                    written += os.write(fd, data[written:])
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
            self.end = size + written


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
