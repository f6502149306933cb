"""The user's terminal during a run: one thread writes to it, so that a slow terminal (a paused SSH
session, a pager, a slow pipe) never holds up the nodes' output, whose every line the run's record
keeps (record/stream.py). The harness's own words always reach the terminal; the job's lines may be
left out when the terminal falls too far behind, and the terminal is then told how many and where they are.

At scale the same line comes from every rank (a warning, a step line); with collapse on, the terminal
holds each job line for a short window and shows the identical ones that came from several ranks (or
several nodes' torchrun) within it as one line that names them: `[ranks 0-1023]: UserWarning: ...`. The agents
collapse their own ranks' lines first (harness.node.protocol.RankLines): such a line joins as all the ranks it names,
and a terminal that does not collapse shows each of them."""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from harness.health.rank_stack import short_ranges
from harness.node.protocol import MOST_COLLAPSED, numbers_of
from harness.record.stream import StreamRecord

BACKLOG_BYTES = 8 << 20  # the job's text waiting for the terminal beyond which its lines are left out here
COLLAPSE_WINDOW = 0.5  # seconds after a line's latest copy within which further copies from other ranks join it
COLLAPSE_LONGEST = 4  # windows after its first copy that a line is held at most, however its copies keep coming
# A shown job line: its node, torchrun's rank prefix (none on torchrun's own lines), and a glog-style header
# (torch's `W1127 09:12:33.123000 12345 ` or C++ `[W1127 09:12:33.123456 `), which differs between copies.
JOB_LINE = re.compile(r"\[node(\d+)\] (?:\[rank(\d+)\]: |\[ranks ([\d,-]+)\]: )?"
                      r"(\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ (?:\d+ )?)?(.*)")


@dataclass
class _Group:
    """A job line held for its window, and the ranks (or nodes) whose identical copies joined it. key:
    what the copies share (None: a line that collapses with none); first: the line as its first copy came."""

    key: tuple[str, str] | None
    first: str
    header: str
    due: float
    latest: float  # the most it may be held to
    members: list[int] = field(default_factory=list)

    def shown(self) -> str:
        if len(self.members) < 2 or self.key is None:
            return self.first
        kind, text = self.key
        return f"[ranks {short_ranges(self.members)}]: {self.header}{text}\n" if kind == "rank" else \
            f"[nodes {short_ranges(self.members)}] {self.header}{text}\n"


@dataclass
class _Copies:
    """The held groups of one key, oldest first. A member's copies are in consecutive groups, so that its
    next copy goes to the group numbered next[member] (or the oldest, or a new one): no search per line,
    however often a rank repeats itself (blank lines)."""

    groups: deque[_Group] = field(default_factory=deque)
    released: int = 0  # this key's groups shown already: the number of groups[0]
    next: dict[int, int] = field(default_factory=dict)

    def group_of(self, members: list[int]) -> _Group | None:
        """The oldest group without a copy from any of members (None: every one has one)."""
        at = max(self.next.get(member, 0) for member in members) - self.released
        return self.groups[max(at, 0)] if at < len(self.groups) else None

    def joined(self, members: list[int]) -> None:
        """members' copies joined the group group_of gave, or a new one."""
        number = max(self.released, *(self.next.get(member, 0) for member in members)) + 1
        for member in members:
            self.next[member] = number


def _identity(line: str) -> tuple[tuple[str, str] | None, list[int], str]:
    """What a line's copies share (None: it has none), whose line it is (a rank, the ranks an agent collapsed it
    from, or a node for torchrun's own), and its glog-style header."""
    parsed = JOB_LINE.match(line)
    if parsed is None:
        return None, [0], ""
    node, rank, ranks, header, rest = parsed.groups()
    if ranks is not None:
        named = numbers_of(ranks, MOST_COLLAPSED)
        return (("rank", rest), named, header or "") if named else (None, [0], "")
    if rank is None:
        return ("node", rest), [int(node)], header or ""
    return ("rank", rest), [int(rank)], header or ""


def _lines(text: str) -> Iterator[str]:
    """Each line of text with its newline (the last may have none)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start) + 1 or len(text)
        yield text[start:end]
        start = end


class Terminal:
    """out: the user's stream. record: where the harness's own words are kept too, once the run's
    directory exists; logs_command: the command that shows the lines left out. collapse: identical job
    lines from several ranks or nodes within window seconds are shown as one (the controller turns it on
    for attempts of more than COLLAPSE_ABOVE ranks)."""

    def __init__(self, out: IO[str], backlog_bytes: int = BACKLOG_BYTES, window: float = COLLAPSE_WINDOW,
                 collapse: bool = False) -> None:
        self.out = out
        self.record: StreamRecord | None = None
        self.logs_command = "harness logs RUN_ID"
        self.collapse = collapse
        self._backlog_bytes = backlog_bytes
        self._window = window
        self._queue: deque[str] = deque()
        self._queued = 0  # bytes of the job's text in the queue
        self._held: deque[_Group] = deque()  # in the order their first copies came
        self._open: dict[tuple[str, str], _Copies] = {}  # the held groups by what their copies share
        self._held_bytes = 0  # of the held groups' first lines
        self._left_out = 0  # the job's lines not written here since the last notice
        self._ready = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_out, name="terminal", daemon=True)
        self._writer.start()

    def say(self, message: str, kept: bool = True) -> None:
        """A line of the harness's own: `harness: MESSAGE`. kept: in the record too (not where the record's disk
        says it cannot write it)."""
        self.write(f"harness: {message}\n", kept)

    def write(self, text: str, kept: bool = True) -> None:
        """The harness's own text, whole lines: never held or left out, kept in the record (kept). The job's
        lines held for collapsing are shown first, as they came before it. (The run's end report writes
        through this, as to a file.)"""
        if self.record is not None and kept:
            self.record.harness(text)
        with self._ready:
            self._release(everything=True)
            self._queue.append(text)
            self._ready.notify()

    def flush(self) -> None:
        """Writing is the writer thread's: nothing to wait for here (close() waits for all of it)."""

    def job_lines(self, text: str, count: int) -> None:
        """count of the job's lines in text; left out when the terminal is BACKLOG_BYTES behind. With
        collapse on, each line is held for the window, and what it holds counts as behind."""
        with self._ready:
            if self.collapse:
                self._hold(text)
                return
            self._release(everything=True)
            if self._queued + len(text) > self._backlog_bytes:
                self._left_out += count
                return
            self._queued += len(text)
            self._queue.append(text)
            self._ready.notify()

    def close(self) -> None:
        """Once everything queued and held is written (a run's last words must reach the user)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._writer.join()

    def _hold(self, text: str) -> None:
        """Each line into the group of its identical copies from other ranks, or a new group (a rank's
        second copy too, so that no line is lost)."""
        now = time.monotonic()
        due = now + self._window
        was_empty = not self._held
        for line in _lines(text):
            key, members, header = _identity(line)
            copies = self._open.get(key) if key is not None else None
            group = copies.group_of(members) if copies is not None else None
            if group is None:
                if self._queued + self._held_bytes + len(line) > self._backlog_bytes:
                    self._left_out += 1
                    continue
                group = _Group(key, line, header, due, now + COLLAPSE_LONGEST * self._window)
                self._held.append(group)
                self._held_bytes += len(line)
                if key is not None:
                    copies = self._open.setdefault(key, _Copies())
                    copies.groups.append(group)
            if copies is not None:
                copies.joined(members)
            group.members += members
            group.due = min(due, group.latest)  # copies still coming: a step's lines from 1,024 ranks take a while
        if was_empty and self._held:
            self._ready.notify()

    def _release(self, everything: bool = False) -> None:
        """The held groups whose window ended (everything: all of them) into the queue, in their order."""
        now = time.monotonic()
        while self._held and (everything or self._held[0].due <= now):
            group = self._held.popleft()
            if group.key is not None:
                copies = self._open[group.key]
                copies.groups.popleft()
                copies.released += 1
                if not copies.groups:
                    del self._open[group.key]
            shown = group.shown()
            self._held_bytes -= len(group.first)
            self._queued += len(shown)
            self._queue.append(shown)

    def _write_out(self) -> None:
        while True:
            with self._ready:
                while True:
                    self._release(everything=self._closed)
                    if self._queue or self._closed:
                        break
                    self._ready.wait(self._held[0].due - time.monotonic() if self._held else None)
                if not self._queue and not self._left_out:
                    break
                text = "".join(self._queue)
                self._queue.clear()
                self._queued = 0
                left_out, self._left_out = self._left_out, 0
            try:
                self.out.write(text)
                if left_out:
                    self.out.write(f"harness: this terminal fell behind the job: {left_out} of its lines are not "
                                   f"shown here (all are kept: `{self.logs_command}`)\n")
                self.out.flush()
            except (OSError, ValueError):  # a closed terminal: the record still keeps every line
                continue
