"""A running job's health, judged from what the node agents sample (harness.node.ranks,
harness.node.collectives) and the stacks and last collectives they read on a hang. Pure: samples and
stacks in, judgements and words out.

Progress is CPU time and I/O, not output, and collectives completing: a rank that computes without
printing uses CPU, one that sleeps between steps still sends its collectives' data; a rank that
waits in a collective, sleeps, or is stopped does neither (gloo waits asleep), and a rank whose
collective has not completed for health.stall seconds made none, even when its CPU spins (NCCL waits
in a CUDA synchronization). A rank without progress for health.stall seconds means the job is hung --
whatever its peers print. Flight Recorder then says where every rank is by collective (verdict.py's
words): a rank behind the others, ranks in different collectives at the same sequence number (a
mismatch); the stacks say where in the code, and who is odd where the collectives cannot be read. A
slow rank is the one its peers wait for: it enqueues its collectives last (Flight Recorder's
arrival times), and its main thread is busy while theirs sleep (see docs/health.md).
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
    # (t, cpu s, busy s, io bytes, collectives completed (-1: unknown), s its oldest unfinished one waited (-1: none))
    samples: deque[tuple[float, float, float, int, int, float]] = field(default_factory=deque)
    slow_since: float | None = None
    well_since: float | None = None
    named_slow: float | None = None  # the percentage it was named with


@dataclass
class Arrivals:
    """When each rank enqueued its recent collectives (Flight Recorder), on the controller's clock: each
    node's clock is taken to be off by the least (receipt - sent) its messages showed, so that hosts whose
    clocks differ compare fairly."""

    offsets: dict[int, float] = field(default_factory=dict)  # node rank -> controller clock - node clock
    seen: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (group, seq) -> rank -> when

    def add(self, node: Node, received: float, sent: float, rank: int, arrived: list[tuple[str, int, int]]) -> None:
        offset = self.offsets[node.node_rank] = min(self.offsets.get(node.node_rank, received - sent), received - sent)
        for group, seq, created_ns in arrived:
            self.seen.setdefault((group, seq), {})[rank] = created_ns / 1e9 + offset
        horizon = received - 2 * SLOW_WINDOW
        for key in [key for key, ranks in self.seen.items() if max(ranks.values()) < horizon]:
            del self.seen[key]

    def waited(self, live: list[int], window: float) -> dict[int, float]:
        """Each rank's percentage of the last `window` seconds in which its peers had arrived at a collective
        it had not. Only stretches the arrivals cover count (from one collective every live rank arrived at
        to the next one of its group, #s to #s+1; an agent reads what the recorder still holds): in each,
        the span from the median peer's arrival at #s to the rank's own, as far as it falls before #s+1's
        first arrival, over the stretch's length. {} without such stretches over at least half the window."""
        if len(live) < 2:
            return {}
        complete = {key: ranks for key, ranks in self.seen.items() if set(live) <= set(ranks)}
        if not complete:
            return {}
        end = max(min(ranks[r] for r in live) for ranks in complete.values())
        stretches = []
        for (group, seq), ranks in complete.items():
            after = complete.get((group, seq + 1))
            start = min(ranks[r] for r in live)
            if after is not None and start >= end - window:
                stretches.append((start, min(after[r] for r in live), ranks))
        covered = sum(stop - start for start, stop, _ in stretches)
        if covered <= 0 or max(s[1] for s in stretches) - min(s[0] for s in stretches) < window / 2:
            return {}
        late = dict.fromkeys(live, 0.0)
        for start, stop, ranks in stretches:
            everyone = statistics.median(ranks[r] for r in live)  # of many ranks, as good as the peers' own
            for rank in live:
                peers = everyone if len(live) > 4 else statistics.median(ranks[r] for r in live if r != rank)
                late[rank] += max(0.0, min(ranks[rank], stop) - max(peers, start))
        return {rank: 100 * value / covered for rank, value in late.items()}


@dataclass
class HealthWatch:
    """Every rank's recent samples. stall: seconds without progress that make a hang (0: off); slow: the
    percentage of time its peers must wait for a rank before it is named (0: off)."""

    stall: float
    slow: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # node ranks that have ended
    arrivals: Arrivals = field(default_factory=Arrivals)

    def observe(self, node: Node, t: float, samples: Mapping[int, RankSample]) -> None:
        """One health message of node's agent: its ranks' samples taken at t."""
        for number, (pid, state, cpu, busy, io, completed, pending) in samples.items():
            rank = self.ranks.setdefault(number, _Rank(node, pid, state))
            rank.pid, rank.state = pid, state
            rank.samples.append((t, cpu, busy, io, completed, pending))
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
        `stall` s" is literally true; or whose oldest unfinished collective has waited `stall` seconds
        while none of theirs completed, whatever their CPU did."""
        if self.stall <= 0:
            return []
        found = []
        for number, rank in sorted(self._live().items()):
            if rank.samples and _collective_stuck(rank.samples, self.stall):
                found.append(number)
                continue
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
            (t0, cpu0, busy0, *_), (t1, cpu1, busy1, _, _, pending) = rank.samples[-2], rank.samples[-1]
            span = max(t1 - t0, 1e-6)
            progressed = [b[0] for a, b in pairwise(rank.samples)
                          if b[1] - a[1] > IDLE_SHARE * (b[0] - a[0]) or b[3] != a[3]]
            idle = max(t1 - (progressed[-1] if progressed else rank.samples[0][0]), pending)
            busy = min(1.0, (busy1 - busy0) / span)
            if rank.state in ("T", "t"):
                state = state_words(rank.state)
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

    def busy_waited(self) -> dict[int, float]:
        """Each live rank's percentage of the time its peers wait for it, by main-thread busy time: how much
        more the median peer's main thread sleeps than its own does."""
        shares = self.busy_shares()
        return {number: 100 * (statistics.median(1 - s for r, s in shares.items() if r != number) - (1 - share))
                for number, share in shares.items() if len(shares) > 1}

    def measures(self) -> dict[int, dict[str, float]]:
        """Each live rank's percentage of the time its peers wait for it, by each measure that has one:
        "arrival" (when it arrives at its collectives, where every live rank's arrivals are known) and
        "busy" (main-thread busy time)."""
        live = list(self._live())
        found: dict[int, dict[str, float]] = {}
        for name, values in (("arrival", self.arrivals.waited(live, SLOW_WINDOW)), ("busy", self.busy_waited())):
            for number, value in values.items():
                found.setdefault(number, {})[name] = value
        return found

    def waited(self) -> dict[int, tuple[float, str]]:
        """Each live rank's percentage of the time its peers wait for it, by the measure that shows more.
        Arrival times see a rank that computes slowly, on every backend (NCCL's ranks spin while they wait,
        which blinds busy time); busy time sees a rank held up inside a collective it already entered (a
        host whose CPU quota freezes it), which arrival times cannot."""
        return {number: max((value, name) for name, value in values.items())
                for number, values in self.measures().items()}

    def slow_changes(self, now: float) -> list[tuple[int, float | None]]:
        """Ranks newly named slow (rank, percent its peers wait for it), or cleared (rank, None)."""
        if self.slow <= 0:
            return []
        changes: list[tuple[int, float | None]] = []
        for number, (waited, _) in self.waited().items():
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


def _collective_stuck(samples: deque[tuple[float, float, float, int, int, float]], stall: float) -> bool:
    """The rank's oldest unfinished collective has waited `stall` seconds (by its node's clock, from when it
    was enqueued), and the count of its completed collectives did not move in that time."""
    last = samples[-1]
    if last[5] < stall or last[4] < 0:
        return False
    return all(s[4] == last[4] for s in samples if s[0] >= last[0] - stall)


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
    # Its last collectives by Flight Recorder (harness.node.collectives.last_entries), or why they could not
    # be read; None where nobody asked (a DataLoader worker, an older record).
    collectives: list[dict[str, Any]] | str | None = None

    @classmethod
    def from_answer(cls, rank: int, node: Node, answer: Mapping[str, Any]) -> RankStack:
        threads = answer["threads"]
        workers = tuple(cls.from_answer(rank, node, worker) for worker in answer.get("workers", []))
        if isinstance(threads, str):
            return cls(rank, node, answer["pid"], answer["state"], None, threads, workers, answer.get("collectives"))
        return cls(rank, node, answer["pid"], answer["state"], threads, workers=workers,
                   collectives=answer.get("collectives"))

    def to_answer(self) -> dict[str, Any]:
        """As stacks.json keeps it (from_answer reads it back)."""
        return {"node": self.node.node_rank, "host": self.node.host, "pid": self.pid, "state": self.state,
                "threads": self.threads if self.threads is not None else self.error,
                "workers": [worker.to_answer() for worker in self.workers], "collectives": self.collectives}

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
        user = next((f for f in frames if not LIBRARY.search(f["file"])), None)
        if user is None or user is frames[0]:
            return self.place()
        return f"in {_call_name(frames, user)} {self.place()}"

    def place(self) -> str:
        """The user's line its main thread is at (with the line's text where that is the innermost frame)."""
        frames = self.main_frames()
        if not frames:
            return f"(no stack: {self.error})" if self.error else "(no stack)"
        user = next((f for f in frames if not LIBRARY.search(f["file"])), None)
        if user is None:
            return f"in {frames[0]['name']} at {short_path(frames[0]['file'])}:{frames[0]['line']}"
        place = f"at {short_path(user['file'])}:{user['line']} in {user['name']}"
        return f"{place}: {user['code']}" if user is frames[0] and user.get("code") else place

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
            lines.append(f"Thread {thread.get('tid')} ({'active' if thread.get('active') else 'idle'}): "
                         f"\"{thread.get('name')}\"")
            for frame in thread["frames"]:
                lines.append(f"    {frame['name']} ({short_path(frame['file'])}:{frame['line']})")
                if frame.get("code"):
                    lines.append(f"        {frame['code']}")
        return "\n".join(lines) + "\n" + workers


DEFAULT_GROUP = "0"  # Flight Recorder's name of the default process group: every rank is a member


def op_name(entry: Mapping[str, Any]) -> str:
    """all_reduce, not gloo:all_reduce: the backend is the job's."""
    return str(entry["op"]).rpartition(":")[2] or "a collective"


def collectives_text(stack: RankStack) -> str:
    """Its last collectives by process group, as a hang's rankN.txt ends: `#21 all_reduce [[100, 100]]
    unfinished`; or why they could not be read."""
    if stack.collectives is None:
        return ""
    if isinstance(stack.collectives, str):
        return f"\nFlight Recorder not read: {stack.collectives}\n"
    lines = [f"\nrank {stack.rank}'s last collectives (Flight Recorder):"]
    for entry in stack.collectives:
        group = "" if entry["group"] == DEFAULT_GROUP else f" of process group {entry['group']}"
        lines.append(f"    #{entry['seq']}{group} {op_name(entry)} {entry['sizes']} "
                     f"{'completed' if entry['done'] else 'unfinished'}")
    return "\n".join(lines) + "\n"


def short_path(path: str) -> str:
    """A library file from its package on (torch/distributed/...), the user's file as written."""
    match = re.search(r"/(?:site|dist)-packages/(.*)$", path)
    return match.group(1) if match else path


def _call_name(frames: list[dict[str, Any]], user: dict[str, Any]) -> str:
    """The library function the user's frame called: the outermost frame inside it that is not a
    decorator's wrapper (torch wraps its collectives in loggers)."""
    inside = frames[:frames.index(user)]
    named = [f for f in inside if f["name"].rsplit(".", 1)[-1] not in WRAPPERS and "<locals>" not in f["name"]]
    return (named or inside)[-1]["name"]


def state_words(state: str) -> str:
    return STATES.get(state, state)


def ranks_text(numbers: Iterable[int]) -> str:
    numbers = sorted(numbers)
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {','.join(map(str, numbers))}"


def grouped(stacks: Iterable[RankStack]) -> str:
    """Every rank's stacks, ranks with the same stacks shown once (as `py-spy dump` / `ray stack` do)."""
    groups: dict[str, list[RankStack]] = {}
    for stack in sorted(stacks, key=lambda s: s.rank):
        body = stack.text().split("\n", 1)[1]
        key = re.sub(r"Thread \d+ ", "Thread ", body)
        groups.setdefault(key, []).append(stack)
    blocks = []
    for members in groups.values():
        where = ", ".join(f"{s.rank} ({s.node.label} on {s.node.host}, pid {s.pid}, {state_words(s.state)})"
                          for s in members)
        blocks.append(f"{ranks_text(s.rank for s in members)}: {where}\n{members[0].text().split(chr(10), 1)[1]}")
    return "\n".join(blocks)
