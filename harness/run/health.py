"""A running job's health, judged from what the node agents sample (harness.node.ranks) and the stacks
they read (harness.node.stacks). Pure: samples and stacks in, judgements and words out.

Progress is CPU time and I/O, not output: a rank that computes without printing uses CPU, one that
sleeps between steps still sends its collectives' data; a rank that waits in a collective, sleeps,
or is stopped does neither (gloo waits asleep). A rank without progress for
health.stall seconds means the job is hung -- whatever its peers print -- and the stacks then say who
is the odd one out: a rank that ended, a stopped rank, a rank outside torch's collectives while its
peers wait in one, or a minority in a different collective. A slow rank is the one its peers wait
for: its main thread is busy (on a CPU or queued for one) while theirs sleep (see docs/health.md).
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from harness.node.protocol import RankSample
from harness.plan.planner import Node

IDLE_SHARE = 0.02  # a rank that used less than 2% of one CPU between two samples made no progress
SLOW_WINDOW = 20.0  # seconds over which each rank's busy share is measured
STILL_SECONDS = 10.0  # idle this long (and for three samples) is shown as no progress, before it is a hang
SLOW_CONFIRM = 20.0  # seconds a rank must stay slow before it is named (and well again before it is cleared)
# Frames inside these parts of torch are a rank waiting for its peers (a collective, DDP's backward).
WAITING = re.compile(r"torch/(distributed|autograd|nn/parallel)/")
LOADER = re.compile(r"torch/utils/data/")  # a rank in its DataLoader: waiting for a worker, or loading itself
WRAPPERS = ("wrapper", "_fn", "inner", "decorate_context", "wrapped")
LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3[.\d]*/|^<")
STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)", "t": "traced",
          "Z": "a zombie", "gone": "gone"}


@dataclass(frozen=True)
class RankView:
    """A rank as the watch sees it now. state: computing (its main thread runs), waiting (it sleeps: for
    its peers in a collective, for data, in a sleep), no progress for N s, or stopped; cpu: CPUs used over
    the last sample interval; busy: its main thread's share of that interval; idle: seconds without progress."""

    node: Node
    state: str
    cpu: float
    busy: float
    idle: float


@dataclass
class _Rank:
    node: Node
    pid: int
    state: str
    samples: deque[tuple[float, float, float, int]] = field(default_factory=deque)  # (t, cpu s, busy s, io bytes)
    slow_since: float | None = None
    well_since: float | None = None
    named_slow: float | None = None  # the percentage it was named with


@dataclass
class HealthWatch:
    """Every rank's recent samples. stall: seconds without progress that make a hang (0: off); slow: the
    percentage of time its peers must wait for a rank before it is named (0: off)."""

    stall: float
    slow: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # node ranks that have ended

    def observe(self, node: Node, t: float, samples: Mapping[int, RankSample]) -> None:
        """One health message of node's agent: its ranks' samples taken at t."""
        for number, (pid, state, cpu, busy, io) in samples.items():
            rank = self.ranks.setdefault(number, _Rank(node, pid, state))
            rank.pid, rank.state = pid, state
            rank.samples.append((t, cpu, busy, io))
            keep = max(self.stall, SLOW_WINDOW) + 30
            while rank.samples and rank.samples[0][0] < t - keep:
                rank.samples.popleft()

    def node_ended(self, node_rank: int) -> None:
        self.ended.add(node_rank)

    def _live(self) -> dict[int, _Rank]:
        return {r: v for r, v in self.ranks.items() if v.node.node_rank not in self.ended}

    def stalled(self) -> list[int]:
        """Ranks of running nodes that made no progress in any sample interval of the last `stall` seconds
        (each used less than IDLE_SHARE of a CPU and read or wrote nothing), so that "no progress for
        `stall` s" is literally true."""
        if self.stall <= 0:
            return []
        found = []
        for number, rank in sorted(self._live().items()):
            if not rank.samples or rank.samples[0][0] > rank.samples[-1][0] - self.stall:
                continue  # not watched for `stall` seconds yet
            since = next(i for i in range(len(rank.samples) - 1, -1, -1)
                         if rank.samples[i][0] <= rank.samples[-1][0] - self.stall)
            window = list(rank.samples)[since:]
            if all(b[1] - a[1] <= IDLE_SHARE * (b[0] - a[0]) and b[3] == a[3] for a, b in pairwise(window)):
                found.append(number)
        return found

    def views(self) -> dict[int, RankView]:
        """Each live rank as `harness status` shows it, from its last two samples and its idle time."""
        views = {}
        for number, rank in self._live().items():
            if len(rank.samples) < 2:
                continue
            (t0, cpu0, busy0, _), (t1, cpu1, busy1, _) = rank.samples[-2], rank.samples[-1]
            span = max(t1 - t0, 1e-6)
            progressed = [b[0] for a, b in pairwise(rank.samples)
                          if b[1] - a[1] > IDLE_SHARE * (b[0] - a[0]) or b[3] != a[3]]
            idle = t1 - (progressed[-1] if progressed else rank.samples[0][0])
            busy = min(1.0, (busy1 - busy0) / span)
            if rank.state in ("T", "t"):
                state = _state(rank.state)
            elif idle >= max(3 * span, STILL_SECONDS):
                state = f"no progress for {idle:.0f} s"
            else:
                state = "computing" if busy >= 0.5 else "waiting"
            views[number] = RankView(rank.node, state, (cpu1 - cpu0) / span, busy, idle)
        return views

    def busy_shares(self) -> dict[int, float]:
        """Each live rank's main-thread busy share over the last SLOW_WINDOW seconds (1: never waits)."""
        shares = {}
        for number, rank in self._live().items():
            if len(rank.samples) < 2:
                continue
            last = rank.samples[-1]
            first = next((s for s in rank.samples if s[0] >= last[0] - SLOW_WINDOW), None)
            if first is not None and last[0] - first[0] >= SLOW_WINDOW / 2:
                shares[number] = min(1.0, (last[2] - first[2]) / (last[0] - first[0]))
        return shares

    def slow_changes(self, now: float) -> list[tuple[int, float | None]]:
        """Ranks newly named slow (rank, percent its peers wait for it), or cleared (rank, None)."""
        if self.slow <= 0:
            return []
        shares = self.busy_shares()
        changes: list[tuple[int, float | None]] = []
        for number, share in shares.items():
            peers = [1 - s for r, s in shares.items() if r != number]
            if not peers:
                continue
            waited = 100 * (statistics.median(peers) - (1 - share))
            rank = self.ranks[number]
            if waited >= self.slow:
                rank.well_since = None
                rank.slow_since = rank.slow_since or now
                if rank.named_slow is None and now - rank.slow_since >= SLOW_CONFIRM:
                    rank.named_slow = waited
                    changes.append((number, waited))
            else:
                rank.slow_since = None
                rank.well_since = rank.well_since or now
                if rank.named_slow is not None and now - rank.well_since >= SLOW_CONFIRM:
                    rank.named_slow = None
                    changes.append((number, None))
        return changes

    def slow_ranks(self) -> dict[int, float]:
        return {r: v.named_slow for r, v in self.ranks.items() if v.named_slow is not None}


# --- stacks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStack:
    """One rank's stacks as its node read them: threads (py-spy's, frames innermost first, each with its
    source line), or why they could not be read."""

    rank: int
    node: Node
    pid: int
    state: str
    threads: list[dict[str, Any]] | None
    error: str | None = None
    workers: tuple[RankStack, ...] = ()  # its DataLoader workers (processes running its Python), oldest first

    @classmethod
    def from_answer(cls, rank: int, node: Node, answer: Mapping[str, Any]) -> RankStack:
        threads = answer["threads"]
        workers = tuple(cls.from_answer(rank, node, worker) for worker in answer.get("workers", []))
        if isinstance(threads, str):
            return cls(rank, node, answer["pid"], answer["state"], None, threads, workers)
        return cls(rank, node, answer["pid"], answer["state"], threads, workers=workers)

    def to_answer(self) -> dict[str, Any]:
        """As stacks.json keeps it (from_answer reads it back)."""
        return {"node": self.node.node_rank, "host": self.node.host, "pid": self.pid, "state": self.state,
                "threads": self.threads if self.threads is not None else self.error,
                "workers": [worker.to_answer() for worker in self.workers]}

    def stuck_worker(self) -> tuple[int, RankStack] | None:
        """(its number, the worker) when the rank waits in its DataLoader and one of its workers is in the
        user's code (a __getitem__ that never returns): the place of the hang is there."""
        if not any(LOADER.search(f["file"]) for f in self.main_frames()):
            return None
        return next(((number, worker) for number, worker in enumerate(self.workers)
                     if any(not LIBRARY.search(f["file"]) for f in worker.main_frames())), None)

    def main_frames(self) -> list[dict[str, Any]]:
        threads = self.threads or []
        main = next((t for t in threads if t.get("tid") == self.pid), None) or \
            next((t for t in threads if t.get("name") == "MainThread"), None) or (threads[0] if threads else None)
        return list(main["frames"]) if main else []

    def waiting(self) -> bool:
        """In one of torch's waits for peers (a collective, DDP's backward)."""
        return any(WAITING.search(f["file"]) for f in self.main_frames())

    def where(self) -> str:
        """Where its main thread is, in the user's terms: the torch call it is in, and the user's line."""
        frames = self.main_frames()
        if not frames:
            return f"(no stack: {self.error})" if self.error else "(no stack)"
        user = next((f for f in frames if not LIBRARY.search(f["file"])), None)
        inner = frames[0]
        if user is None:
            return f"in {inner['name']} at {_short(inner['file'])}:{inner['line']}"
        place = f"at {_short(user['file'])}:{user['line']} in {user['name']}"
        if inner is user:
            return f"{place}: {user['code']}" if user.get("code") else place
        return f"in {_call_name(frames, user)} {place}"

    def text(self, head: str | None = None) -> str:
        """The stacks as py-spy dump shows them, with each frame's source line; then its workers'."""
        head = head or f"rank {self.rank} ({self.node.label} on {self.node.host}), pid {self.pid}, {_state(self.state)}"
        workers = "".join("\n" + worker.text(f"rank {self.rank}'s DataLoader worker {number}, pid {worker.pid}, "
                                              f"{_state(worker.state)}") for number, worker in enumerate(self.workers))
        if self.threads is None:
            return f"{head}\n    stacks unavailable: {self.error}\n{workers}"
        lines = [head]
        for thread in self.threads:
            lines.append(f"Thread {thread.get('tid')} ({'active' if thread.get('active') else 'idle'}): "
                         f"\"{thread.get('name')}\"")
            for frame in thread["frames"]:
                lines.append(f"    {frame['name']} ({_short(frame['file'])}:{frame['line']})")
                if frame.get("code"):
                    lines.append(f"        {frame['code']}")
        return "\n".join(lines) + "\n" + workers


def _short(path: str) -> str:
    """A library file from its package on (torch/distributed/...), the user's file as written."""
    match = re.search(r"/(?:site|dist)-packages/(.*)$", path)
    return match.group(1) if match else path


def _call_name(frames: list[dict[str, Any]], user: dict[str, Any]) -> str:
    """The library function the user's frame called: the outermost frame inside it that is not a
    decorator's wrapper (torch wraps its collectives in loggers)."""
    inside = frames[:frames.index(user)]
    named = [f for f in inside if f["name"].rsplit(".", 1)[-1] not in WRAPPERS and "<locals>" not in f["name"]]
    return (named or inside)[-1]["name"]


def _state(state: str) -> str:
    return STATES.get(state, state)


def ranks_text(numbers: Iterable[int]) -> str:
    numbers = sorted(numbers)
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {','.join(map(str, numbers))}"


@dataclass(frozen=True)
class Verdict:
    """Who a hang is about. odd: the ranks at fault, where it can tell; text: the one line said everywhere
    (after "hang: ")."""

    text: str
    odd: list[int]


def hang_verdict(stall: float, stacks: Mapping[int, RankStack], ended: Mapping[int, tuple[Node, str]]) -> Verdict:
    """ended: ranks whose node had already ended -> (node, how). The odd ranks first, then the rest."""
    odd: dict[int, str] = {}
    for rank, (node, how) in ended.items():
        odd[rank] = f"({node.label} on {node.host}) had ended ({how})"
    live = {r: s for r, s in stacks.items() if r not in odd}
    for rank, stack in live.items():
        if stack.state in ("T", "t"):
            odd[rank] = f"({stack.node.label} on {stack.node.host}) is {_state(stack.state)} {stack.where()}"
        elif found := stack.stuck_worker():
            number, worker = found
            odd[rank] = f"'s DataLoader worker {number} ({stack.node.label} on {stack.node.host}, pid " \
                        f"{worker.pid}) {worker.where()}"
        elif stack.threads is not None and not stack.waiting():
            odd[rank] = f"({stack.node.label} on {stack.node.host}) {stack.where()}"
    waiters = {r: s for r, s in live.items() if r not in odd}
    groups: dict[str, list[int]] = {}
    for rank, stack in sorted(waiters.items()):
        groups.setdefault(stack.where(), []).append(rank)
    parts = [f"rank {rank}{'' if what.startswith(chr(39)) else ' '}{what}" for rank, what in sorted(odd.items())]
    ahead = None
    if not odd and len(groups) > 1:
        biggest = max(len(g) for g in groups.values())
        minority = [r for g in groups.values() if len(g) < biggest for r in g]
        if minority:
            odd.update({r: "" for r in minority})
        elif ahead := _ahead([[waiters[r] for r in g] for g in groups.values()]):
            odd.update({r: "" for r in ahead[0]})
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), not ahead or item[1] != ahead[0]))
    else:
        ordered = list(groups.items())
    parts += [f"{ranks_text(g)} {'waits' if len(g) == 1 else 'wait'} {where}" for where, g in ordered]
    if not odd and len(groups) == 1:
        parts.append("no rank is behind the others: suspect the network between the nodes, or a peer's host")
    elif ahead:
        parts.append(f"the ranks wait in different collectives, and {ranks_text(ahead[0])} got further in "
                     f"{ahead[1]}: {'it' if len(ahead[0]) == 1 else 'they'} likely skipped a collective the others "
                     f"wait in (or the others call one {'it does' if len(ahead[0]) == 1 else 'they do'} not)")
    elif len(groups) > 1 and not any(odd.values()):
        parts.append("the ranks wait in different collectives: the program calls them in a different order on "
                     "different ranks")
    return Verdict(f"no progress for {stall:g} s: " + "; ".join(parts), sorted(odd))


def _ahead(groups: list[list[RankStack]]) -> tuple[list[int], str] | None:
    """The group that got furthest in the function where the groups' stacks part, when one did: the
    outermost frame they do not share is the same function on a later line (e.g. after the loop that
    holds the others' collective). (its ranks, "FUNC (FILE:LINE, the others at :LINE)")."""
    outer = [list(reversed(group[0].main_frames())) for group in groups]
    depth = 0
    while all(len(frames) > depth for frames in outer) and \
            len({(f[depth]["file"], f[depth]["name"], f[depth]["line"]) for f in outer}) == 1:
        depth += 1
    if not all(len(frames) > depth for frames in outer) or \
            len({(f[depth]["file"], f[depth]["name"]) for f in outer}) != 1:
        return None
    lines = [frames[depth]["line"] for frames in outer]
    furthest = max(lines)
    if lines.count(furthest) != 1:
        return None
    at = outer[lines.index(furthest)][depth]
    others = ", :".join(str(line) for line in sorted(set(lines) - {furthest}))
    return (sorted(r.rank for r in groups[lines.index(furthest)]),
            f"{at['name']} ({_short(at['file'])}:{furthest}, the others at :{others})")


def grouped(stacks: Iterable[RankStack]) -> str:
    """Every rank's stacks, ranks with the same stacks shown once (as `py-spy dump` / `ray stack` do)."""
    groups: dict[str, list[RankStack]] = {}
    for stack in sorted(stacks, key=lambda s: s.rank):
        body = stack.text().split("\n", 1)[1]
        key = re.sub(r"Thread \d+ ", "Thread ", body)
        groups.setdefault(key, []).append(stack)
    blocks = []
    for members in groups.values():
        where = ", ".join(f"{s.rank} ({s.node.label} on {s.node.host}, pid {s.pid}, {_state(s.state)})"
                          for s in members)
        blocks.append(f"{ranks_text(s.rank for s in members)}: {where}\n{members[0].text().split(chr(10), 1)[1]}")
    return "\n".join(blocks)
