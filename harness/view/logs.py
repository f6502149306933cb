"""`harness logs RUN_ID`: the run's stream as it was shown, from its timed record (record/stream.py),
in time order -- lines held back from the terminal included -- filtered by rank, node, attempt, a
regular expression and age; --follow prints lines as they come until the run ends."""

from __future__ import annotations

import heapq
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from harness.errors import HarnessError, UsageError
from harness.record.liveness import has_ended
from harness.record.rundir import RunDir
from harness.record.stream import STAMP_WIDTH, StreamReader, each_rank, record_files, stamp, unstamp

FOLLOW_POLL_SECONDS = 0.25
NODE_FILE = re.compile(r"^attempt(\d+)/node(\d+)\.log$")
PLAN_FILE = re.compile(r"^plan(?:\.attempt(\d+))?\.json$")
RANK_OF_LINE = re.compile(r"^\[[^]]+\] \[rank(\d+)\]: ")
DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """`90s`, `5m`, `1h30m`, `2d` (a bare number is seconds) in seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"expected a duration such as 90s, 5m, 1h30m or 2d, got {text!r}")
    return sum(float(number) * UNIT_SECONDS[unit] for number, unit in parts)


@dataclass(frozen=True)
class Selection:
    """Which lines to print: ranks and node (None: all), attempt (None: all), grep, since (a stamp); holders: by
    attempt, the nodes that hold the ranks asked for, whose logs alone are read (None, or an attempt not there: every
    node's; log_lines finds them in the plans)."""

    ranks: frozenset[int] | None = None
    node: int | None = None
    attempt: int | None = None
    grep: re.Pattern[str] | None = None
    since: str | None = None
    timestamps: bool = False
    holders: Mapping[int, frozenset[int]] | None = None

    def files(self, folder: Path) -> list[Path]:
        """The record's files these lines can be in: the harness's own words only when no rank or node is asked for."""
        return [path for path in record_files(folder) if self._may_hold(path.relative_to(folder).as_posix())]

    def _may_hold(self, name: str) -> bool:
        if "/" not in name:  # the harness's own words
            return self.ranks is None and self.node is None
        match = NODE_FILE.match(name)
        if match is None:
            return False
        attempt, node = int(match[1]), int(match[2])
        held = None if self.holders is None else self.holders.get(attempt)
        return (self.attempt is None or attempt == self.attempt) and (self.node is None or node == self.node) and \
            (held is None or node in held)

    def keeps(self, line: str) -> bool:
        if self.since is not None and line[:STAMP_WIDTH] < self.since:
            return False
        text = unstamp(line)
        if self.ranks is not None:
            rank = RANK_OF_LINE.match(text)
            if rank is None or int(rank[1]) not in self.ranks:
                return False
        return self.grep is None or self.grep.search(text) is not None

    def shown(self, line: str) -> str:
        return line if self.timestamps else unstamp(line)

    def filters(self) -> str:
        """The filters as the command line gave them, for a message."""
        given = [("--rank", ",".join(map(str, sorted(self.ranks))) if self.ranks is not None else None),
                 ("--node", self.node), ("--attempt", self.attempt),
                 ("--grep", repr(self.grep.pattern) if self.grep is not None else None),
                 ("--since", f"(after {self.since})" if self.since is not None else None)]
        return " ".join(f"{flag} {value}" for flag, value in given if value is not None)


def print_logs(run: RunDir, selection: Selection, out: IO[str], follow: bool = False) -> int:
    written = 0
    for line in log_lines(run, selection, follow, flushed=out.flush):
        out.write(line)
        written += 1
    out.flush()
    if not written:
        which = selection.filters()
        print(f"harness: no line of run {run.run_id}" + (f" matches {which}" if which else " was recorded yet"),
              file=sys.stderr)
    return 0


def log_lines(run: RunDir, selection: Selection, follow: bool = False,
              flushed: Callable[[], None] = lambda: None) -> Iterator[str]:
    """The run's lines that selection keeps, as it shows them (each with its newline), in time order; with follow, on
    as they come until the run ends. flushed: called whenever the lines there are now have all been given."""
    folder = run.stream
    if not folder.is_dir():
        raise HarnessError(f"run {run.run_id} has no timed record of its stream ({folder}/ is missing: it was "
                           f"launched by an older harness); its nodes' logs are {run.path}/node*.log")
    if selection.attempt is not None and not (folder / f"attempt{selection.attempt}").is_dir():
        raise UsageError(f"run {run.run_id} has no attempt {selection.attempt}; it has "
                         f"{', '.join(p.name for p in sorted(folder.glob('attempt*'))) or 'none yet'}")
    plans = _planned(run)
    _refuse_unknown(run, selection, plans)
    if selection.ranks is not None:  # only the logs of the nodes that hold them: at 2,048 nodes, a few files of 2,048
        selection = replace(selection, holders={attempt: frozenset(node for node, ranks in nodes.items()
                                                                   if not selection.ranks.isdisjoint(ranks))
                                                for attempt, nodes in plans.items()})
    readers = {path: StreamReader(path) for path in selection.files(folder)}
    yield from _kept(selection, heapq.merge(*(reader.lines() for reader in readers.values())))
    while follow:
        flushed()
        ended = has_ended(run)  # read before the last lines: what the run wrote before it ended is all there
        for path in selection.files(folder):
            readers.setdefault(path, StreamReader(path))
        yield from _kept(selection, heapq.merge(*(reader.lines() for reader in readers.values())))
        if ended:
            break
        time.sleep(FOLLOW_POLL_SECONDS)


def _planned(run: RunDir) -> dict[int, dict[int, list[int]]]:
    """By attempt, each node's ranks as the attempt's plan says (an attempt whose plan cannot be read is left out)."""
    plans: dict[int, dict[int, list[int]]] = {}
    for path in run.path.glob("plan*.json"):
        if (named := PLAN_FILE.match(path.name)) is None:
            continue
        try:
            plans[int(named[1] or 0)] = {int(node["node_rank"]): [int(rank) for rank in node["ranks"]]
                                         for node in json.loads(path.read_text())["nodes"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return plans


def _refuse_unknown(run: RunDir, selection: Selection, plans: dict[int, dict[int, list[int]]]) -> None:
    """A rank or node no attempt of the run had (by its plans) is a mistake to say, not an empty answer."""
    ranks = {rank for nodes in plans.values() for held in nodes.values() for rank in held}
    nodes = {node for planned in plans.values() for node in planned}
    if ranks and selection.ranks is not None and not selection.ranks <= ranks:
        raise UsageError(f"run {run.run_id} has no rank {','.join(map(str, sorted(selection.ranks - ranks)))}: its "
                         f"ranks are {_span(ranks)}")
    if nodes and selection.node is not None and selection.node not in nodes:
        raise UsageError(f"run {run.run_id} has no node{selection.node}: its nodes are node{_span(nodes)}")


def _span(numbers: set[int]) -> str:
    """0-3 for a range, else 0,2,5."""
    low, high = min(numbers), max(numbers)
    if high > low and numbers == set(range(low, high + 1)):
        return f"{low}-{high}"
    return ",".join(map(str, sorted(numbers)))


def _kept(selection: Selection, lines: Iterable[str]) -> Iterator[str]:
    return (selection.shown(line) for each in lines for line in each_rank(each)
            if selection.keeps(line))


def since_stamp(seconds: float) -> str:
    return stamp(time.time() - seconds)
