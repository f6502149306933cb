"""One rank's stacks and last collectives as its node read them on a hang or for `harness stacks`
(harness.node.ranks, harness.node.collectives), typed, and the words every stack is said in: where a rank
is in the user's code, the torch call it waits in, alike stacks grouped. Pure.

stacks.json keeps them in the agents' JSON form (RankStack.to_answer; from_answer reads it back)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.node.protocol import number_ranges
from harness.plan.planner import Node

# Frames inside these parts of torch are a rank waiting for its peers (a collective, DDP's backward).
WAITING = re.compile(r"torch/(distributed|autograd|nn/parallel)/")
LOADER = re.compile(r"torch/utils/data/")  # a rank in its DataLoader: waiting for a worker, or loading itself
WRAPPERS = ("wrapper", "_fn", "inner", "decorate_context", "wrapped")
LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3[.\d]*/|^<")
STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)", "t": "traced",
          "Z": "a zombie", "gone": "gone"}
RANGES_SHOWN = 48  # characters of ranges short_ranges shows; beyond, how many there are
DEFAULT_GROUP = "0"  # Flight Recorder's name of the default process group: every rank is a member


@dataclass(frozen=True)
class Frame:
    """One frame of a thread, as py-spy reads it; code: its source line as the rank's node has it."""

    name: str
    file: str
    line: int
    code: str | None = None

    @property
    def in_library(self) -> bool:
        """In Python's or a package's code, not the user's."""
        return LIBRARY.search(self.file) is not None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Frame:
        return cls(str(data["name"]), str(data["file"]), int(data["line"]), data.get("code"))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "line": self.line, "code": self.code}


@dataclass(frozen=True)
class StackThread:
    """One thread of a rank: frames innermost first."""

    name: str | None
    tid: int | None
    frames: tuple[Frame, ...]
    active: bool | None = None
    gil: bool | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StackThread:
        return cls(data.get("name"), data.get("tid"), tuple(Frame.from_json(f) for f in data["frames"]),
                   data.get("active"), data.get("gil"))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tid": self.tid, "active": self.active, "gil": self.gil,
                "frames": [frame.to_json() for frame in self.frames]}


@dataclass(frozen=True)
class Collective:
    """One of a rank's last collectives by Flight Recorder (harness.node.collectives.last_entries): its
    process group, sequence number in it, operation (`gloo:all_reduce`), whether it completed, the tensor
    sizes and when it was enqueued (ns, by the node's clock)."""

    group: str
    seq: int
    op: str
    done: bool
    sizes: Any
    created_ns: int = 0

    @property
    def op_name(self) -> str:
        """all_reduce, not gloo:all_reduce: the backend is the job's."""
        return self.op.rpartition(":")[2] or "a collective"

    @property
    def of(self) -> str:
        """` of process group 2`; nothing for the default group."""
        return "" if self.group == DEFAULT_GROUP else f" of process group {self.group}"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Collective:
        return cls(str(data["group"]), int(data["seq"]), str(data["op"]), bool(data["done"]), data.get("sizes"),
                   int(data.get("created_ns") or 0))

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "seq": self.seq, "op": self.op, "done": self.done, "sizes": self.sizes,
                "created_ns": self.created_ns}


@dataclass(frozen=True)
class RankStack:
    """One rank's stacks as its node read them: threads (py-spy's, frames innermost first, each with its
    source line), or why they could not be read."""

    rank: int
    node: Node
    pid: int
    state: str
    threads: tuple[StackThread, ...] | None
    error: str | None = None
    workers: tuple[RankStack, ...] = ()  # its DataLoader workers (processes running its Python), oldest first
    # Its last collectives by Flight Recorder, or why they could not be read; None where nobody asked (a
    # DataLoader worker, an older record).
    collectives: tuple[Collective, ...] | str | None = None
    command: str | None = None  # its command line, where the agent said it (a node's launcher's)

    @classmethod
    def from_answer(cls, rank: int, node: Node, answer: Mapping[str, Any]) -> RankStack:
        """An agent's answer for one rank (harness.node.observer), or a rank of stacks.json."""
        threads, collectives = answer["threads"], answer.get("collectives")
        return cls(rank, node, answer["pid"], answer["state"],
                   None if isinstance(threads, str) else tuple(StackThread.from_json(t) for t in threads),
                   threads if isinstance(threads, str) else None,
                   tuple(cls.from_answer(rank, node, worker) for worker in answer.get("workers", [])),
                   collectives if collectives is None or isinstance(collectives, str) else
                   tuple(Collective.from_json(entry) for entry in collectives), answer.get("command"))

    def to_answer(self) -> dict[str, Any]:
        """As stacks.json keeps it (from_answer reads it back)."""
        collectives = self.collectives if self.collectives is None or isinstance(self.collectives, str) else \
            [entry.to_json() for entry in self.collectives]
        return {"node": self.node.node_rank, "host": self.node.host, "pid": self.pid, "state": self.state,
                "threads": [t.to_json() for t in self.threads] if self.threads is not None else self.error,
                "workers": [worker.to_answer() for worker in self.workers], "collectives": collectives}

    def stuck_worker(self) -> tuple[int, RankStack] | None:
        """(its number, the worker) when the rank waits in its DataLoader and one of its workers is in the
        user's code (a __getitem__ that never returns): the place of the hang is there."""
        if not any(LOADER.search(f.file) for f in self.main_frames()):
            return None
        return next(((number, worker) for number, worker in enumerate(self.workers)
                     if any(not f.in_library for f in worker.main_frames())), None)

    def main_frames(self) -> list[Frame]:
        threads = self.threads or ()
        main = next((t for t in threads if t.tid == self.pid), None) or \
            next((t for t in threads if t.name == "MainThread"), None) or (threads[0] if threads else None)
        return list(main.frames) if main else []

    def waiting(self) -> bool:
        """In one of torch's waits for peers (a collective, DDP's backward)."""
        return any(WAITING.search(f.file) for f in self.main_frames())

    def where(self) -> str:
        """Where its main thread is, in the user's terms: the torch call it is in, and the user's line."""
        frames = self.main_frames()
        user = next((f for f in frames if not f.in_library), None)
        if user is None or user is frames[0]:
            return self.place()
        return f"in {_call_name(frames, user)} {self.place()}"

    def place(self) -> str:
        """The user's line its main thread is at (with the line's text where that is the innermost frame)."""
        frames = self.main_frames()
        if not frames:
            return f"(no stack: {self.error})" if self.error else "(no stack)"
        user = next((f for f in frames if not f.in_library), None)
        if user is None:
            return f"in {frames[0].name} at {short_path(frames[0].file)}:{frames[0].line}"
        place = f"at {short_path(user.file)}:{user.line} in {user.name}"
        return f"{place}: {user.code}" if user is frames[0] and user.code else place

    def text(self, head: str | None = None) -> str:
        """The stacks as py-spy dump shows them, with each frame's source line; then its workers'."""
        head = head or \
            f"rank {self.rank} ({self.node.label} on {self.node.host}), pid {self.pid}, {state_words(self.state)}"
        workers = "".join("\n" + worker.text(f"rank {self.rank}'s DataLoader worker {number}, pid {worker.pid}, "
                                              f"{state_words(worker.state)}")
                          for number, worker in enumerate(self.workers))
        if self.threads is None:
            return f"{head}\n    stacks unavailable: {self.error}\n{workers}"
        lines = [head]
        for thread in self.threads:
            lines.append(f"Thread {thread.tid} ({'active' if thread.active else 'idle'}): \"{thread.name}\"")
            for frame in thread.frames:
                lines.append(f"    {frame.name} ({short_path(frame.file)}:{frame.line})")
                if frame.code:
                    lines.append(f"        {frame.code}")
        return "\n".join(lines) + "\n" + workers

    def waits_in(self) -> list[Collective]:
        """The collective it waits in, in each process group where it has an unfinished one (Flight Recorder);
        none where its collectives were not read."""
        if not isinstance(self.collectives, tuple):
            return []
        groups = dict.fromkeys(entry.group for entry in self.collectives)
        return [entry for group in groups
                if (entry := oldest_unfinished(e for e in self.collectives if e.group == group)) is not None]

    def collectives_text(self) -> str:
        """Its last collectives by process group, as a hang's rankN.txt ends: `#21 all_reduce [[100, 100]]
        unfinished`; or why they could not be read."""
        if self.collectives is None:
            return ""
        if isinstance(self.collectives, str):
            return f"\nFlight Recorder not read: {self.collectives}\n"
        lines = [f"\nrank {self.rank}'s last collectives (Flight Recorder):"]
        lines += [f"    #{entry.seq}{entry.of} {entry.op_name} {entry.sizes} "
                  f"{'completed' if entry.done else 'unfinished'}" for entry in self.collectives]
        return "\n".join(lines) + "\n"


def oldest_unfinished(entries: Iterable[Collective]) -> Collective | None:
    """The collective a rank waits in among its entries of one process group: its oldest unfinished one."""
    return min((entry for entry in entries if not entry.done), key=lambda entry: entry.seq, default=None)


def short_path(path: str) -> str:
    """A library file from its package on (torch/distributed/...), the user's file as written."""
    match = re.search(r"/(?:site|dist)-packages/(.*)$", path)
    return match.group(1) if match else path


def _call_name(frames: list[Frame], user: Frame) -> str:
    """The library function the user's frame called: the outermost frame inside it that is not a
    decorator's wrapper (torch wraps its collectives in loggers)."""
    inside = frames[:frames.index(user)]
    named = [f for f in inside if f.name.rsplit(".", 1)[-1] not in WRAPPERS and "<locals>" not in f.name]
    return (named or inside)[-1].name


def state_words(state: str) -> str:
    return STATES.get(state, state)


def ranks_text(numbers: Iterable[int], noun: str = "rank") -> str:
    """`rank 5`, or `ranks 0-3,8,10,11`: one line however many there are."""
    numbers = sorted(set(numbers))
    return f"{noun} {numbers[0]}" if len(numbers) == 1 else f"{noun}s {number_ranges(numbers)}"


def short_ranges(numbers: Iterable[int]) -> str:
    """The numbers as ranges, or the first of them and how many there are: a line that names them stays short."""
    ranges = number_ranges(numbers)
    if len(ranges) <= RANGES_SHOWN:
        return ranges
    return f"{ranges[:ranges.rfind(',', 0, RANGES_SHOWN)]},... {len(set(numbers))} in all"


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose stacks are alike: head names them (each with its node, pid, state and the collective it waits
    in, where known), body is the stacks they share."""

    head: str
    body: str


def stack_groups(stacks: Iterable[RankStack]) -> list[StackGroup]:
    """Every rank's stacks, ranks with the same stacks together (as `py-spy dump` / `ray stack` do), by rank."""
    groups: dict[str, list[RankStack]] = {}
    for stack in sorted(stacks, key=lambda s: s.rank):
        body = stack.text().split("\n", 1)[1]
        key = re.sub(r"Thread \d+ ", "Thread ", body)
        groups.setdefault(key, []).append(stack)
    return [StackGroup(f"{ranks_text(s.rank for s in members)}: " + ", ".join(map(_member, members)),
                       members[0].text().split("\n", 1)[1]) for members in groups.values()]


def _member(stack: RankStack) -> str:
    waits = "".join(f", waiting in {entry.op_name} #{entry.seq}{entry.of}" for entry in stack.waits_in())
    return f"{stack.rank} ({stack.node.label} on {stack.node.host}, pid {stack.pid}, {state_words(stack.state)}{waits})"


def grouped(stacks: Iterable[RankStack]) -> str:
    """Every rank's stacks as text, ranks with the same stacks shown once (stack_groups)."""
    return "\n".join(f"{group.head}\n{group.body}" for group in stack_groups(stacks))
