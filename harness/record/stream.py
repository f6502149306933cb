"""logs/ in a run's directory: the run's stream as it would be shown with nothing held back, each line
with the time it arrived, appended as it arrives -- logs/harness.log for the harness's own words (and
logs/follower.log for those of a `harness launch` that follows a batch job's controller), and per
attempt one file per node, logs/attempt<N>/node<R>.log, whose lines carry their rank as the stream shows
them (`[node1] [rank3]: ...`), or the ranks whose identical lines their agent said as one (`[node1] [ranks 8-15]:
...`, harness.node.protocol.RankLines; each_rank gives each rank's back). `harness logs` merges them in time order
(view/logs.py), reading each file with a StreamReader.

Each line is `STAMP LINE`: STAMP is UTC to the microsecond in a fixed width (STAMP_WIDTH), so that
lines sort by time as text. The node logs beside them (node<R>.log) keep the node's output as it came,
torchrun's own noise included, without times."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.node.protocol import each_ranks
from harness.record.atomic import make_folders
from harness.record.disk import AppendedFile, RecordDisk, RecordFile

STAMP_WIDTH = len("2026-01-01T00:00:00.000000Z")
HARNESS_FILE = "harness.log"
FOLLOWER_FILE = "follower.log"  # the words of `harness launch` following a controller that a scheduler runs


def stamp(t: float) -> str:
    """`2026-11-25T17:10:59.123456Z`: sortable as text, readable, the same on every machine."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def unstamp(line: str) -> str:
    """A line of the record as the stream showed it: without its STAMP."""
    return line[STAMP_WIDTH + 1:]


def each_rank(line: str) -> Iterator[str]:
    """A line of the record, or where its agent collapsed it from several ranks, each rank's own, with its stamp and
    node (a line of the harness's own has no node, and stays as it is)."""
    if not line.startswith("[", STAMP_WIDTH + 1):
        yield line
        return
    at = line.find("] ", STAMP_WIDTH) + 2  # after the node's label
    yield from (line[:at] + own for own in each_ranks(line[at:]))


def stamped(text: str, head: str) -> str:
    """Every line of text (whole lines, each ending with a newline) with head in front."""
    return head + text[:-1].replace("\n", "\n" + head) + "\n" if text else ""


def attempt_folder(folder: Path, attempt: int) -> Path:
    return folder / f"attempt{attempt}"


def node_file(folder: Path, attempt: int, node_rank: int) -> Path:
    return attempt_folder(folder, attempt) / f"node{node_rank}.log"


def mark_file(folder: Path, attempt: int, node_rank: int) -> Path:
    return attempt_folder(folder, attempt) / f"node{node_rank}.logged"


class LoggedMark(RecordFile):
    """How far a node's logs hold its agent's stream: the place in the stream (its bytes) and each log's size then,
    rewritten in place after every block. A controller that takes the node back (`harness attach`) cuts each log
    back to its size (what a lost controller wrote past its last mark) and has the agent send its stream again
    from that place (harness.node.link): no line is lost with the controller, none is logged twice."""

    def write(self, position: int, ends: Sequence[int | None]) -> None:
        """ends: each log's size (None: not written by this controller: never cut back)."""
        with self.disk.writing(self.what):
            # One write of a fixed width at the file's start: a SIGKILL leaves the old mark or the new one.
            fields = (position, *(-1 if end is None else end for end in ends))
            os.pwrite(self._opened(0), " ".join(f"{n:020d}" for n in fields).encode() + b"\n", 0)


def resume_point(mark: Path, logs: Sequence[Path]) -> int | None:
    """Where in its agent's stream a node's logs (in the order LoggedMark was given their sizes) end, each log cut
    back to its size at the mark. None: no mark (nothing logged, or a record older than marks)."""
    try:
        position, *ends = (int(field) for field in mark.read_text(encoding="utf-8").split())
    except (OSError, ValueError):
        return None
    for log, end in zip(logs, ends, strict=False):
        with contextlib.suppress(OSError):
            if end >= 0 and log.stat().st_size > end:
                os.truncate(log, end)
    return position


def record_files(folder: Path) -> list[Path]:
    """Every file of a run's timed record: the harness's own words (the controller's, and a follower's on
    the user's machine), then each attempt's node files."""
    return sorted(folder.glob("*.log")) + sorted(folder.glob("attempt*/node*.log"))


class StreamRecord:
    """The run's logs/ folder, opened for appending, on the run's disk (a write that fails there is the disk's to
    say, never the writer's)."""

    def __init__(self, folder: Path, harness_file: str = HARNESS_FILE, disk: RecordDisk | None = None) -> None:
        self.folder = folder
        self.disk = disk or RecordDisk(folder.parent)
        make_folders(folder, self.disk.folder_mode)
        self._harness = self.disk.appended(folder / harness_file, "the harness's log")
        self._lock = threading.Lock()

    def harness(self, text: str) -> None:
        """The harness's own whole lines."""
        with self._lock:
            self._harness.write(stamped(text, f"{stamp(time.time())} "))

    def open_node(self, attempt: int, node_rank: int) -> AppendedFile:
        """The node's file of this attempt: its pump is its only writer."""
        return self.disk.appended(node_file(self.folder, attempt, node_rank), f"node{node_rank}'s log")

    def open_mark(self, attempt: int, node_rank: int) -> LoggedMark:
        """The node's LoggedMark of this attempt: its pump is its only writer."""
        return LoggedMark(self.disk, mark_file(self.folder, attempt, node_rank), f"node{node_rank}'s log mark")

    def close(self) -> None:
        with self._lock:
            self._harness.close()


class StreamReader:
    """One file of the record, read on from where the last read stopped; a line still being written waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def lines(self) -> Iterator[str]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                for line in file:
                    if not line.endswith(b"\n"):
                        break
                    self.offset += len(line)
                    yield line.decode("utf-8", errors="replace")
        except FileNotFoundError:
            return
