"""`harness top RUN_ID`: `harness status` of a running run, redrawn every second in the terminal, with
the tail of the job's stream below it; q quits. It only reads the run's files: the job never waits for it."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import select
import shutil
import sys
import termios
import tty
from collections.abc import Callable, Iterable, Iterator
from typing import IO

from harness.record.liveness import has_ended
from harness.record.rundir import RunDir
from harness.record.stream import STAMP_WIDTH, unstamp
from harness.view.logs import Selection
from harness.view.status import run_details

TAIL_BYTES = 1 << 16  # read from the end of each file of the record, for the stream's last lines
CHUNK_BYTES = 1 << 12  # read first: a file's share of a screen where many nodes write
CLEAR = "\x1b[H\x1b[2J"


def frame(run: RunDir, width: int, height: int) -> str:
    """One screen: the run's status, rank by rank, then as many of the stream's last lines as fit."""
    head = run_details(run, width).splitlines()
    room = max(0, height - len(head) - 2)
    tail = [unstamp(line).rstrip("\n")[:width] for line in stream_tail(run, room)] if room else []
    return "\n".join([*head, "", *tail]) + "\n"


def stream_tail(run: RunDir, count: int) -> list[str]:
    """The last count lines of the run's record, in time order, read from the end of each file: CHUNK_BYTES of each
    first, then up to TAIL_BYTES of those whose chunk may not hold all they have of the last count lines (at 2,048
    nodes a frame reads 8 MiB, not 128)."""
    if count <= 0:
        return []
    tails = {path: _last_lines(path, count, CHUNK_BYTES) for path in Selection().files(run.stream)}
    kept = _newest(tails.values(), count)
    oldest = kept[0][:STAMP_WIDTH] if len(kept) == count else ""
    for path, lines in tails.items():
        if len(lines) < count and (not lines or lines[0][:STAMP_WIDTH] >= oldest):  # it may hold more of them
            tails[path] = _last_lines(path, count)
    return _newest(tails.values(), count)


def _newest(tails: Iterable[list[str]], count: int) -> list[str]:
    """The count newest of the files' lines, in time order (their stamps sort as text): heapq.merge of 2,048 files
    takes a second where this takes a few hundredths."""
    return sorted(heapq.nlargest(count, itertools.chain.from_iterable(tails)))


def _last_lines(path: os.PathLike[str], count: int, room: int = TAIL_BYTES) -> list[str]:
    """The file's last count whole lines within its last room bytes."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - room))
            data = file.read()
    except FileNotFoundError:
        return []
    # Split as bytes, at \n and \r alone: str.splitlines would cut a rank's line at a separator it printed (\x1e).
    lines = [line.decode("utf-8", errors="replace") for line in data.splitlines(keepends=True)]
    if size > room:
        lines = lines[1:]  # the first may be cut
    return [line for line in lines[-count:] if line.endswith("\n")]


def top(run: RunDir, out: IO[str] = sys.stdout, interval: float = 1.0, once: bool = False) -> int:
    """Redraw until q or the run's end (then its last frame stays); once, or off a terminal: one frame."""
    if once or not (out.isatty() and sys.stdin.isatty()):
        size = shutil.get_terminal_size((200, 40))
        out.write(frame(run, size.columns, size.lines))
        return 0
    with _keys() as key:
        while True:
            size = shutil.get_terminal_size()
            ended = has_ended(run)
            out.write(CLEAR + frame(run, size.columns, size.lines - 1))
            out.flush()
            if ended or key(interval) in ("q", "Q"):
                return 0


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """A key at a time, without echo, until the context ends (the terminal's settings come back)."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def key(timeout: float) -> str | None:
        readable, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if readable else None

    tty.setcbreak(fd)
    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
