"""A running job's health, judged from what the node agents sample (harness.node.ranks,
harness.node.collectives): which ranks stalled, how each rank looks now, and which rank its peers wait
for. Pure: samples in, judgements out (the words of a hang are verdict.py's).

Progress is CPU time and I/O, not output, and collectives completing: a rank that computes without printing uses
CPU, one that sleeps between steps still sends its collectives' data; a rank that waits in a collective, sleeps, or
is stopped does neither (gloo waits asleep), and a rank whose collective has not completed for health.stall seconds
made none, even when its CPU spins (NCCL waits in a CUDA synchronization). Each agent judges its own ranks' progress
(node.ranks.ProgressWatch: how long each has gone without, how long its collectives' count stood still, said with
each sample); the judge weighs that against health.stall once per sample, so a tick looks only at the ranks that may
be hung. A rank without progress for health.stall seconds means the job is hung -- whatever its peers print. A slow
rank is the one its peers wait for: it enqueues its collectives last (Flight Recorder's arrival times, arrivals.py),
and its main thread is busy while theirs sleep (see docs/health.md). The agents sample as often as
spec.job.Health.sample_seconds says, which these rules were made for, and every second while an attempt is young
(node.protocol.sample_interval): shorter intervals only make progress easier to see, never a hang. A job of many
nodes is sampled less often (node.protocol.paced); the rules judge by time, not by a count of samples, so a hang is
still found, within stall + two intervals of its last progress.
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

from harness.health.arrivals import PEERS_ALONE, Arrivals
from harness.health.rank_stack import state_words
from harness.node.protocol import NodeArrivals, RankSample
from harness.node.ranks import ProgressWatch
from harness.plan.planner import Node

SLOW_WINDOW = 20.0  # seconds over which each rank's busy share is measured
STILL_SECONDS = 10.0  # idle this long (and for three samples) is shown as no progress, before it is a hang
SLOW_CONFIRM = 20.0  # seconds a rank must stay slow before it is named (and well again before it is cleared)


class Sample(NamedTuple):
    """One of a rank's health samples as the judge keeps it: taken at t (the node's clock), CPU seconds and
    main-thread busy seconds so far, I/O bytes so far, collectives completed (-1: unknown), and seconds its
    oldest unfinished collective has waited (-1: none)."""

    t: float
    cpu: float
    busy: float
    io: int
    completed: int
    pending: float
    gpu_util: float = -1.0  # % of the SMs' time since the sample before; -1: no GPU known
    gpu_memory: int = -1  # bytes held; -1: not known


class SlowMeasure(NamedTuple):
    """The percentage of the time a rank's peers wait for it, and by which measure: "arrival" (when it arrives
    at its collectives) or "busy" (main-thread busy time)."""

    percent: float
    by: str


class SlowChange(NamedTuple):
    """A rank newly named slow (percent: how much its peers wait for it), or cleared (percent None)."""

    rank: int
    percent: float | None


@dataclass(frozen=True)
class RankView:
    """A rank as the judge sees it now. state: computing (its main thread runs), waiting (it sleeps: for
    its peers in a collective, for data, in a sleep), no progress for N s, or stopped; cpu: CPUs used over
    the last sample interval; busy: its main thread's share of that interval; idle: seconds without progress;
    gpu_util and gpu_memory: its last sample's GPU use (None: no GPU the driver reports)."""

    node: Node
    state: str
    cpu: float
    busy: float
    idle: float
    gpu_util: float | None = None
    gpu_memory: int | None = None


@dataclass
class _Rank:
    node: Node
    pid: int
    state: str
    seen: float  # its first sample's time
    samples: deque[Sample] = field(default_factory=deque)
    slow_since: float | None = None
    onset: float | None = None  # when its slowness began, as dated once it is named (HealthJudge.slow_changes)
    well_since: float | None = None
    named_slow: float | None = None  # the percentage it was named with
    # As its agent judged its newest sample (node.ranks.ProgressWatch): when it last progressed (its first sample's
    # time: not yet), and when its count of completed collectives last changed (None: never), by the node's clock.
    moved: float = 0.0
    counted: float | None = None

    def hung(self, stall: float) -> bool:
        """No progress for `stall` seconds as of its newest sample, or its oldest unfinished collective waited that
        long while none of its collectives completed (whatever its CPU did: NCCL spins in a CUDA synchronization)."""
        last = self.samples[-1]
        return self.moved <= last.t - stall or (last.pending >= stall and last.completed >= 0 and (
            self.counted is None or self.counted < last.t - stall))


P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[Concatenate[HealthJudge, P], R]) -> Callable[Concatenate[HealthJudge, P], R]:
    """Each node's messages reach the judge on a thread of their own while the health loop reads it: one at a time."""
    @functools.wraps(method)
    def locked(self: HealthJudge, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass
class HealthJudge:
    """Every rank's recent samples and arrivals. stall: seconds without progress that make a hang (0: off);
    slow: the percentage of time its peers must wait for a rank before it is named (0: off)."""

    stall: float
    slow: float
    world_size: int = 0  # the attempt's ranks (0: not known)
    startup: float = 0.0  # the most seconds a rank may wait in its first collective for the others to start
    ranks: dict[int, _Rank] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # node ranks that have ended
    arrivals: Arrivals = field(default_factory=lambda: Arrivals(horizon=2 * SLOW_WINDOW))
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Kept as samples come, so that a tick looks only at the ranks that may be hung, not at every rank (at 16,384
    # ranks twice a second): those whose newest sample shows them hung, and those whose recorder was not read.
    suspects: set[int] = field(default_factory=set)
    unread: set[int] = field(default_factory=set)
    # Nodes whose agent does not judge its ranks' progress (an older harness): judged here as their agent would.
    unjudged: dict[int, ProgressWatch] = field(default_factory=dict)

    @_locked
    def observe(self, node: Node, t: float, samples: Mapping[int, RankSample]) -> None:
        """One health message of node's agent: its ranks' samples taken at t."""
        if any(taken.idle < 0 for taken in samples.values()):
            samples = self.unjudged.setdefault(node.node_rank, ProgressWatch()).judged(t, samples)
        keep = max(self.stall, SLOW_WINDOW) + 30
        for number, taken in samples.items():
            rank = self.ranks.setdefault(number, _Rank(node, taken.pid, taken.state, t))
            rank.pid, rank.state = taken.pid, taken.state
            rank.moved, rank.counted = t - taken.idle, None if taken.still < 0 else t - taken.still
            rank.samples.append(Sample(t, taken.cpu, taken.busy, taken.io, taken.completed, taken.pending,
                                       taken.gpu_util, taken.gpu_memory))
            while rank.samples[0].t < t - keep:
                rank.samples.popleft()
            _mark(self.suspects, number, self.stall > 0 and rank.hung(self.stall))
            _mark(self.unread, number, taken.completed < 0)

    @_locked
    def arrived(self, node: Node, received: float, said: NodeArrivals) -> None:
        """One arrivals message of node's agent (Arrivals.add)."""
        self.arrivals.add(node, received, said)

    @_locked
    def node_ended(self, node_rank: int) -> None:
        self.ended.add(node_rank)

    def _live(self) -> dict[int, _Rank]:
        return {r: v for r, v in self.ranks.items() if v.node.node_rank not in self.ended}

    @_locked
    def stalled(self) -> list[int]:
        """Ranks of running nodes that made no progress in any sample interval of the last `stall` seconds
        (node.ranks.progressed: each used less than IDLE_SHARE of a CPU and read or wrote nothing), so that "no
        progress for `stall` s" is literally true; or whose oldest unfinished collective has waited `stall` seconds
        while none of theirs completed, whatever their CPU did (_Rank.hung, as of each rank's newest sample)."""
        if self.stall <= 0:
            return []
        found = []
        starting = self._starting()
        for number in sorted(self.suspects):
            rank = self.ranks[number]
            if rank.node.node_rank in self.ended:
                continue
            if starting and rank.samples[-1].completed == 0 and rank.samples[-1].t - rank.seen < self.startup:
                continue  # waits in its first collective for ranks still starting: the rendezvous, not a hang
            found.append(number)
        return found

    def _starting(self) -> bool:
        """Some rank of the attempt has not made its process group yet (unseen, or its recorder not read): at
        hundreds of nodes start-up is spread over more than a short stall, and the first ranks' wait in their
        first collective is the job starting. Once every rank has, a rank stuck before that collective is a hang."""
        return self.startup > 0 and (len(self.ranks) < self.world_size or bool(self.unread))

    @_locked
    def views(self) -> dict[int, RankView]:
        """Each live rank as `harness status` shows it, from its last two samples and its idle time."""
        views = {}
        for number, rank in self._live().items():
            if len(rank.samples) < 2:
                continue
            before, last = rank.samples[-2], rank.samples[-1]
            span = max(last.t - before.t, 1e-6)
            idle = max(last.t - rank.moved, last.pending)
            busy = min(1.0, (last.busy - before.busy) / span)
            if rank.state in ("T", "t"):
                state = state_words(rank.state)
            elif idle >= max(3 * span, STILL_SECONDS):
                state = f"no progress for {idle:.0f} s"
            else:
                state = "computing" if busy >= 0.5 else "waiting"
            views[number] = RankView(rank.node, state, (last.cpu - before.cpu) / span, busy, idle,
                                     last.gpu_util if last.gpu_util >= 0 else None,
                                     last.gpu_memory if last.gpu_memory >= 0 else None)
        return views

    def busy_shares(self) -> dict[int, float]:
        """Each live rank's main-thread busy share over the last SLOW_WINDOW seconds (1: never waits)."""
        shares = {}
        for number, rank in self._live().items():
            if len(rank.samples) < 2:
                continue
            last = rank.samples[-1]
            first = next((s for s in rank.samples if s.t >= last.t - SLOW_WINDOW), None)
            if first is not None and last.t - first.t >= SLOW_WINDOW / 2:
                shares[number] = min(1.0, (last.busy - first.busy) / (last.t - first.t))
        return shares

    def busy_waited(self) -> dict[int, float]:
        """Each live rank's percentage of the time its peers wait for it, by main-thread busy time: how much
        more the median peer's main thread sleeps than its own does."""
        shares = self.busy_shares()
        if len(shares) < 2:
            return {}
        everyone = statistics.median(1 - s for s in shares.values())  # of many ranks, as good as the peers' own
        return {number: 100 * ((everyone if len(shares) > PEERS_ALONE else
                                statistics.median(1 - s for r, s in shares.items() if r != number)) - (1 - share))
                for number, share in shares.items()}

    @_locked
    def measures(self) -> dict[int, list[SlowMeasure]]:
        """Each live rank's percentage of the time its peers wait for it, by each measure that has one, the
        larger first: "arrival" (when it arrives at its collectives, where every live rank's arrivals are
        known) and "busy" (main-thread busy time)."""
        found: dict[int, list[SlowMeasure]] = {}
        for by, values in (("arrival", self.arrivals.waited(list(self._live()), SLOW_WINDOW)),
                           ("busy", self.busy_waited())):
            for number, value in values.items():
                found.setdefault(number, []).append(SlowMeasure(value, by))
        return {number: sorted(values, reverse=True) for number, values in found.items()}

    def waited(self) -> dict[int, SlowMeasure]:
        """Each live rank's percentage of the time its peers wait for it, by the measure that shows more.
        Arrival times see a rank that computes slowly, on every backend (NCCL's ranks spin while they wait,
        which blinds busy time); busy time sees a rank held up inside a collective it already entered (a
        host whose CPU quota freezes it), which arrival times cannot."""
        return {number: values[0] for number, values in self.measures().items()}

    @_locked
    def slow_changes(self, now: float) -> list[SlowChange]:
        """Ranks newly named slow, or cleared."""
        if self.slow <= 0:
            return []
        changes: list[SlowChange] = []
        for number, (waited, _) in self.waited().items():
            rank = self.ranks[number]
            if waited >= self.slow:
                rank.well_since = None
                rank.slow_since = rank.slow_since or now
                if rank.named_slow is None and now - rank.slow_since >= SLOW_CONFIRM:
                    rank.named_slow = waited
                    # The share is measured over SLOW_WINDOW: from a slowness's start it rises about linearly to
                    # the rank's full share (waited, once the window is all slowness), so it crossed the threshold
                    # that share of the window after the slowness began.
                    rank.onset = rank.slow_since - SLOW_WINDOW * min(1.0, self.slow / waited)
                    changes.append(SlowChange(number, waited))
            else:
                rank.slow_since = None
                rank.well_since = rank.well_since or now
                if rank.named_slow is not None and now - rank.well_since >= SLOW_CONFIRM:
                    rank.named_slow = None
                    changes.append(SlowChange(number, None))
        return changes

    @_locked
    def slow_since(self, rank: int) -> float | None:
        """Since when the rank has been slow without a break, from when its slowness began (None: it is not now)."""
        found = self.ranks.get(rank)
        if found is None or found.slow_since is None:
            return None
        return found.onset if found.onset is not None and found.named_slow is not None else found.slow_since

    @_locked
    def slow_ranks(self) -> dict[int, float]:
        return {r: v.named_slow for r, v in self.ranks.items() if v.named_slow is not None}


def _mark(ranks: set[int], rank: int, member: bool) -> None:
    if member:
        ranks.add(rank)
    else:
        ranks.discard(rank)
