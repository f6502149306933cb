"""When each rank arrives at its collectives (Flight Recorder's enqueue times), and from that how much of the
time its peers wait for it: the measure of a slow rank that works on every backend. Pure."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from harness.node.protocol import Arrival
from harness.plan.planner import Node

PEERS_ALONE = 4  # up to this many ranks, a rank's peers' median leaves it out; beyond, one median of all serves each


@dataclass
class Arrivals:
    """When each rank enqueued its recent collectives, on the controller's clock, so that hosts whose clocks differ
    compare fairly: each node's clock is off by what its agent says from the controller's pings (ahead:
    protocol.ControllerClock); an agent that does not say (one of an older harness, taken back by `harness attach`)
    is taken to be off by the least (receipt - sent) its messages showed. horizon: seconds of arrivals kept."""

    horizon: float
    offsets: dict[int, float] = field(default_factory=dict)  # node rank -> controller clock - node clock
    seen: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (group, seq) -> rank -> when
    newest: dict[tuple[str, int], float] = field(default_factory=dict)  # (group, seq) -> its latest arrival

    # Worked out once and kept while the live ranks stay the same (at 16,384 ranks, working out every kept collective
    # at every judgement was a third of the controller's core): each complete collective's first arrival, and each
    # stretch's lateness by rank. A collective's are let go when an arrival at it (or, for its stretch, at the next
    # one) comes, or when it is let go itself.
    _for: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _start: dict[tuple[str, int], float] = field(default_factory=dict, repr=False, compare=False)
    _late: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict, repr=False, compare=False)

    def add(self, node: Node, received: float, sent: float, rank: int, arrived: list[Arrival],
            ahead: float | None = None) -> None:
        """One rank's new arrivals; collectives whose latest arrival is older than the horizon are let go, oldest
        first, so that each message costs what it brings, not what is kept (every rank's agent sends one per
        sample: a cost per message that grew with the job made the whole grow with its square)."""
        offset = self.offsets[node.node_rank] = -ahead if ahead is not None else \
            min(self.offsets.get(node.node_rank, received - sent), received - sent)
        for group, seq, created_ns in arrived:
            key, when = (group, seq), created_ns / 1e9 + offset
            self.seen.setdefault(key, {})[rank] = when
            self.newest[key] = max(self.newest.get(key, when), when)
            self._forget(key)
        oldest = received - self.horizon
        while self.newest:
            key = next(iter(self.newest))  # the first collective seen: the oldest, but for a straggler's late word
            if self.newest[key] >= oldest:
                break
            del self.newest[key], self.seen[key]
            self._forget(key)

    def _forget(self, key: tuple[str, int]) -> None:
        self._start.pop(key, None)
        self._late.pop(key, None)
        self._late.pop((key[0], key[1] - 1), None)

    def waited(self, live: list[int], window: float) -> dict[int, float]:
        """Each rank's percentage of the last `window` seconds in which its peers had arrived at a collective
        it had not. Only stretches the arrivals cover count (from one collective every live rank arrived at
        to the next one of its group, #s to #s+1; an agent reads what the recorder still holds): in each,
        the span from the median peer's arrival at #s to the rank's own, as far as it falls before #s+1's
        first arrival, over the stretch's length. {} without such stretches over at least half the window."""
        if len(live) < 2:
            return {}
        if tuple(live) != self._for:
            self._for, self._start, self._late = tuple(live), {}, {}
        for key, ranks in self.seen.items():
            if key not in self._start and len(ranks) >= len(live) and all(r in ranks for r in live):
                self._start[key] = min(ranks[r] for r in live)
        if not self._start:
            return {}
        end = max(self._start.values())
        stretches = [(key, start, stop) for key, start in self._start.items()
                     if (stop := self._start.get((key[0], key[1] + 1))) is not None and start >= end - window]
        covered = sum(stop - start for _, start, stop in stretches)
        if covered <= 0 or max(s[2] for s in stretches) - min(s[1] for s in stretches) < window / 2:
            return {}
        late = dict.fromkeys(live, 0.0)
        for key, start, stop in stretches:
            if (stretch := self._late.get(key)) is None:
                stretch = self._late[key] = _stretch_late(self.seen[key], live, start, stop)
            for rank, value in stretch.items():
                late[rank] += value
        return {rank: 100 * value / covered for rank, value in late.items()}


def _stretch_late(ranks: dict[int, float], live: list[int], start: float, stop: float) -> dict[int, float]:
    """The seconds of one stretch in which each live rank's peers had arrived and it had not (those late only)."""
    everyone = statistics.median(ranks[r] for r in live)
    late = {}
    for rank in live:
        peers = everyone if len(live) > PEERS_ALONE else statistics.median(ranks[r] for r in live if r != rank)
        if (value := min(ranks[rank], stop) - max(peers, start)) > 0:
            late[rank] = value
    return late
