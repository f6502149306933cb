"""One node of an attempt while it runs, as the controller sees it (LiveNode): its lines, taken a block
at a time, which ranks joined, each rank's last line and step, how and when it ended. results.py
turns it into the run record's RecordedNode and Failure once the attempt is over; recovery.py
classifies its failure."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from harness.control import worker_output
from harness.control.cascade import TRACEBACK, Cascade
from harness.node.protocol import RANKS_PREFIX, collapsed_ranks, expanded
from harness.plan.planner import Node, NodePlan
from harness.spec.progress import LinePatterns, global_step, step_total
from harness.targets.base import Outcome

TAIL_LINES = 20  # of the failing rank's, in the report
TAIL_KEPT = 500  # of the node's last lines, kept for the report and the root cause
LAST_LINES_LOOKED_AT = 64  # per block, from its end: each rank's last line and step
FIRST_STEP_LOOKED_AT = 2048  # characters at each end of a block, searched for a step until the node's first
STEPS_KEPT = 30


@dataclass
class Block:
    """What a block of a node's output becomes: logged (every line, one rank prefix), streamed (the lines
    meant for the stream: not the harness's own noise), shown (streamed, but not held back)."""

    logged: str
    streamed: str
    shown: str
    shown_lines: int


class StepMark(NamedTuple):
    """A step a rank reported, and when its line arrived."""

    at: float
    step: int


class RootCause(NamedTuple):
    """The worker torchrun names as the first to fail: its global rank and exit code (None: not reported)."""

    rank: int | None
    exit_code: int | None


@dataclass
class RankActivity:
    """A rank's last line and when it came; the steps it reported, where the job says them."""

    line: str
    at: float
    steps: deque[StepMark] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    total: int | None = None  # the run's steps, where its lines say (step_total); a line without keeps it
    resumed: StepMark | None = None  # the step its attempt resumed at, where a line says (no step taken)
    restore_s: float | None = None  # how long that resume line says the restore took
    loss: float | None = None  # its last loss and throughput (items per second), where its lines say them
    throughput: float | None = None
    saving_s: float = 0.0  # seconds its lines said its checkpoint saves took (health.checkpoint)


# torchrun's ChildFailedError report names the root-cause rank; use it when present.
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)")
ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
LINE_END = re.compile(r"\r\n|\r|\n")  # where a line of the node's output ends (_lines)


@dataclass
class LiveNode:
    """One node of an attempt as the controller saw it: its lines, how and when it ended."""

    node: Node
    started: float
    ended: float | None = None
    outcome: Outcome | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_KEPT))
    joined: dict[int, float] = field(default_factory=dict)  # rank -> when seen connecting to the rendezvous store
    ranks_at: float | None = None  # when its agent said its ranks exist: torchrun's rendezvous was done (STARTED)
    unwatched_lines: int = 0  # of its lines, those its agent kept while no controller watched (`harness attach`)
    torchrun_reporting: bool = False  # torchrun's failure report began: its lines stay in the log
    in_agent_cpp_log: bool = False  # within a C++ log line of torchrun's own and its exception dump
    oom: dict[int, str] = field(default_factory=dict)  # rank -> the kernel's line: its OOM killer ended it
    cascade: Cascade = field(default_factory=Cascade)  # its ranks' consequent errors, held back
    held_all: bool = False  # another node failed first: what this node's torchrun and torch say now is held back
    activity: dict[int, RankActivity] = field(default_factory=dict)
    taken: int = 0  # lines that went into the tail so far (it keeps the last TAIL_KEPT)
    stopped_at: int | None = None  # lines taken when the harness began stopping it (None: it did not)

    @property
    def ranks_started(self) -> bool:
        """Whether its torchrun's rendezvous is done and its ranks exist: its agent said so, or a rank of it joined
        the store or printed a line. A node in a container (its cleanup removes it) has its ranks out of its
        agent's sight: it counts as started, and torch's own rendezvous timeout holds it."""
        in_container = isinstance(self.node, NodePlan) and bool(self.node.cleanup)
        return self.ranks_at is not None or bool(self.joined) or bool(self.activity) or in_container

    def root_cause(self) -> RootCause:
        """The first failed worker, from torchrun's "Root Cause" report."""
        rank = code = None
        in_root_cause = False
        for line in self.tail:
            in_root_cause = in_root_cause or line.startswith("Root Cause")
            if not in_root_cause:
                continue
            if rank is None and (match := ROOT_CAUSE_RANK.match(line)):
                rank = int(match.group(1))
            elif rank is not None and code is None and (match := ROOT_CAUSE_EXIT.match(line)):
                code = int(match.group(1))
        return RootCause(rank, code)

    def take(self, raw: str, quiet_cpp_info: bool = False, at: float = 0.0) -> tuple[str, bool]:
        """A line of the node's output as it is logged (one rank prefix), and whether the live stream
        shows it: not torch's lines of the harness's own doing (worker_output.is_harness_doing), nor torch's
        C++ INFO lines when they are the harness's own watch (quiet_cpp_info), nor torchrun's own C++ log lines
        with their exception dumps (its store client's, e.g. a peer's agent that left first at the end of a
        run), nor torchrun's ChildFailedError report: the harness reports what they mean. Notes which ranks
        joined the rendezvous store, and when (at: the line's arrival)."""
        line = worker_output.normalize(raw)
        if worker_output.is_harness_doing(line):
            return line, False  # the harness's own rank hook, its own network: in the node's log only
        # An INFO line of torchrun's own may begin an exception dump too (a c10d rendezvous store's).
        self.in_agent_cpp_log = worker_output.is_agent_cpp_log(line) or \
            (self.in_agent_cpp_log and worker_output.continues_cpp_dump(line))
        if worker_output.is_cpp_info(line):
            if (rank := worker_output.joined_rank(line)) is not None:
                self.joined.setdefault(rank, at)
            if quiet_cpp_info:
                return line, False
        self.tail.append(line)
        self.taken += 1
        if self.in_agent_cpp_log:
            return line, False
        self.torchrun_reporting = self.torchrun_reporting or worker_output.starts_torchrun_report(line)
        return line, not (self.torchrun_reporting and worker_output.rank_of(line) is None)

    def take_block(self, text: str, at: float, quiet_cpp_info: bool = False,
                   progress: LinePatterns | None = None) -> Block:
        """A block of whole lines that arrived at `at`: what is logged, streamed and shown of it (take()'s
        rules line by line, and the cascade's), each rank's last line and step noted. A block of plain rank
        lines, while nothing is held or being read, passes whole."""
        count = text.count("\n")
        if progress is not None:
            self._note_resumes(text, at, progress)
            self._note_first_step(text, at, progress)
        if not (self.in_agent_cpp_log or self.torchrun_reporting or self.held_all or not self.cascade.idle) and \
                _plain(text, count):
            last = text[:-1].rsplit("\n", TAIL_KEPT)[-TAIL_KEPT:]  # from the end: no str for each line of a big block
            self.tail.extend(last)
            self.taken += count
            self._note(last, at, progress)
            return Block(text, text, text, count)
        logged: list[str] = []
        streamed: list[str] = []
        shown: list[str] = []
        for raw in _lines(expanded(text, self.node.ranks)):
            line, show = self.take(raw, quiet_cpp_info, at)
            logged.append(line)
            if not show:
                continue
            streamed.append(line)
            rank = worker_output.rank_of(line)
            if self.held_all and (rank is None or worker_output.is_rank_cpp_log(line)):
                self.cascade.hold(rank)  # torchrun's and torch's own words on what followed another node's failure
            elif rank is None:
                shown.append(line)
            else:  # a rank's own line is shown, unless the cascade holds it (a consequence, a copy of another's)
                shown += self.cascade.take(rank, line, line[len(f"[rank{rank}]: "):])
        self._note(streamed, at, progress)
        return Block(_text(logged), _text(streamed), _text(shown), len(shown))

    def note_saves(self, text: str, at: float, checkpoint: re.Pattern[str]) -> None:
        """The checkpoint saves the ranks' lines in text say, each rank's seconds added up (one scan of a block
        without any first)."""
        if checkpoint.search(text) is None:
            return
        for rank, line, found in _ranks_lines(text, checkpoint.search, self.node.ranks):
            self.activity.setdefault(rank, RankActivity(line, at)).saving_s += _number(found, "seconds") or 0.0

    def release(self) -> Block:
        """The node's output ended: what the cascade was still reading is shown."""
        shown = [] if self.held_all else self.cascade.release()
        return Block("", "", _text(shown), len(shown))

    def _note_resumes(self, text: str, at: float, progress: LinePatterns) -> None:
        """Where each rank says its attempt resumed: the step its count starts from, which is no step taken."""
        if progress.find_resume(text) is None:
            return
        for rank, line, found in _ranks_lines(text, progress.find_resume, self.node.ranks):
            activity = self.activity.setdefault(rank, RankActivity(line, at))
            if activity.resumed is None:
                activity.resumed, activity.restore_s = StepMark(at, global_step(found)), _number(found, "seconds")

    def _note_first_step(self, text: str, at: float, progress: LinePatterns) -> None:
        """The node's first step line, where the block with it brings several (a restart's steps come quickly):
        the attempt's first step is the one after its resume, not the block's last, which _note keeps. A block is
        read line by line only once one of its ends has a step: a chatty job that prints no step lines would
        otherwise pay a search of all it prints (the stream's end to end time, benchmark 11, was 1.6x)."""
        if any(activity.steps for activity in self.activity.values()):
            return
        ends = [text] if len(text) <= 2 * FIRST_STEP_LOOKED_AT else \
            [text[:FIRST_STEP_LOOKED_AT], text[-FIRST_STEP_LOOKED_AT:]]
        if all(progress.search(end) is None for end in ends):
            return
        for rank, line, found in _ranks_lines(text, progress.search, self.node.ranks):
            self.activity.setdefault(rank, RankActivity(line, at)).steps.append(StepMark(at, global_step(found)))
            return

    def _note(self, lines: list[str], at: float, progress: LinePatterns | None) -> None:
        """Each rank's last line and, where progress finds one, its last step, from the block's last lines (a line its
        agent collapsed from several ranks: each one's)."""
        looked_at = lines[-LAST_LINES_LOOKED_AT:]
        if progress is not None and progress.search("\n".join(looked_at)) is None:
            progress = None  # one scan says no line here has a step
        seen: set[int] = set()
        stepped: set[int] = set()
        for line in reversed(looked_at):
            if progress is None and len(seen) == len(self.node.ranks):
                break
            rank = worker_output.rank_of(line)
            if rank is not None:
                ranks, text = [rank], None
            elif line.startswith(RANKS_PREFIX) and (collapsed := collapsed_ranks(line, self.node.ranks)) is not None:
                ranks, text = collapsed
            else:
                continue
            waiting = [rank for rank in ranks if rank not in stepped and (progress is not None or rank not in seen)]
            found = progress.search(line) if waiting and progress is not None else None
            for rank in waiting:
                self._note_rank(rank, line if text is None else f"[rank{rank}]: {text}", at, found, seen, stepped)

    def _note_rank(self, rank: int, line: str, at: float, found: re.Match[str] | None, seen: set[int],
                   stepped: set[int]) -> None:
        """A rank's line, the block's last lines read from the end: its last line (the first seen), and its step
        where found is the progress pattern's match in it."""
        if rank not in seen:
            seen.add(rank)
            if (last := self.activity.get(rank)) is None:
                self.activity[rank] = RankActivity(line, at)
            else:
                last.line, last.at = line, at
        if found:
            activity = self.activity[rank]
            stepped.add(rank)
            step = global_step(found)
            if not activity.steps or activity.steps[-1].step != step:  # (the block's first: _note_first_step's)
                activity.steps.append(StepMark(at, step))
            activity.total = step_total(found) or activity.total
            activity.loss, activity.throughput = _number(found, "loss"), _number(found, "throughput")

    def stopping(self) -> None:
        """The harness begins to stop the node: what it says from now on is its reaction (torchrun's
        SignalException, a rank's KeyboardInterrupt), not its last words."""
        if self.stopped_at is None:
            self.stopped_at = self.taken

    def last_lines(self, rank: int | None, count: int = TAIL_LINES) -> list[str]:
        """The failing rank's own last lines say why, before the harness acted on the node; the node's lines
        before then are the fallback."""
        lines = list(self.tail)
        if self.stopped_at is not None:
            lines = lines[:max(0, len(lines) - (self.taken - self.stopped_at))]
        own = [line for line in worker_output.each_rank(lines, self.node.ranks)
               if rank is not None and line.startswith(f"[rank{rank}]:")]
        return (own or lines)[-count:]


def _number(found: re.Match[str], group: str) -> float | None:
    """A named group's number (None: no such group, not matched, or not a number)."""
    try:
        return float(found.groupdict()[group])
    except (KeyError, TypeError, ValueError):
        return None


def _ranks_lines(text: str, search: Callable[[str], re.Match[str] | None],
                 ranks: Container[int]) -> Iterator[tuple[int, str, re.Match[str]]]:
    """Each rank's line of text that search finds, with its rank and the match (ranks: the node's, whose lines its
    agent may have collapsed)."""
    for line in worker_output.each_rank(_lines(text), ranks):
        if (found := search(line)) and (rank := worker_output.rank_of(line)) is not None:
            yield rank, line, found


def _plain(text: str, count: int) -> bool:
    """Whether every line of text is a rank's plain line -- one rank prefix, no C++ log line of torch's, no
    traceback's start -- by a few scans of the whole text, not a look at each line (lines that merely look
    otherwise go the slow way, and come out the same)."""
    return text.startswith("[rank") and text.count("\n[rank") == count - 1 and "]: [" not in text and \
        "]:[" not in text and TRACEBACK not in text and "WorkerServer.cpp" not in text


def _lines(text: str) -> list[str]:
    """The lines of a block, as str.splitlines gives them but broken only where a terminal breaks one (\\n, \\r\\n,
    and \\r, a progress bar's): str.splitlines breaks too at characters a rank may print inside a line (\\f, the
    separators \\x1c-\\x1e, U+2028), which would leave the line's rest without its rank."""
    lines = LINE_END.split(text)
    if lines[-1] == "":
        lines.pop()
    return lines


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)
