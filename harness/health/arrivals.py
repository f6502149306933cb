"""When each rank arrives at its collectives (Flight Recorder's enqueue times), and from that how much of the
time its peers wait for it: the measure of a slow rank that works on every backend. Each node says its ranks'
arrivals at a collective as one time for those that arrived together and the others by rank
(collectives.ArrivalsDigest), and they are weighed that way: what a collective costs grows with the nodes and the
ranks that straggle. Pure."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from harness.node.protocol import NodeArrivals
from harness.plan.planner import Node

PEERS_ALONE = 4  # up to this many ranks, a rank's peers' median leaves it out; beyond, one median of all serves each

Ranks = tuple[int, ...]  # ranks that arrived at one time


@dataclass
class NodeAt:
    """One node's ranks at one collective, on the controller's clock: at, when those it does not name arrived
    (None: not said, as by an agent of an older harness); named: the others, rank -> when."""

    at: float | None = None
    named: dict[int, float] = field(default_factory=dict)


@dataclass
class Arrivals:
    """When each rank enqueued its recent collectives, on the controller's clock, so that hosts whose clocks differ
    compare fairly: each node's clock is off by what its agent says from the controller's pings (ahead:
    protocol.ControllerClock); an agent that does not say (one of an older harness, taken back by `harness attach`)
    is taken to be off by the least (receipt - sent) its messages showed. horizon: seconds of arrivals kept."""

    horizon: float
    offsets: dict[int, float] = field(default_factory=dict)  # node rank -> controller clock - node clock
    seen: dict[tuple[str, int], dict[int, NodeAt]] = field(default_factory=dict)  # (group, seq) -> node rank -> its
    newest: dict[tuple[str, int], float] = field(default_factory=dict)  # (group, seq) -> its latest arrival
    nodes: dict[int, range] = field(default_factory=dict)  # node rank -> its ranks, of every node that said

    # Worked out once and kept while the live ranks stay the same (at 16,384 ranks, working out every kept collective
    # at every judgement was a third of the controller's core): each complete collective's live ranks by when they
    # arrived (_groups) and its first arrival, and each stretch's lateness by ranks. A collective's are let go when
    # an arrival at it (or, for its stretch, at the next one) comes, or when it is let go itself.
    _for: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _live: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)  # node rank -> live ranks
    _complete: dict[tuple[str, int], list[tuple[float, Ranks]]] = field(default_factory=dict, repr=False,
                                                                         compare=False)
    _start: dict[tuple[str, int], float] = field(default_factory=dict, repr=False, compare=False)
    _late: dict[tuple[str, int], dict[Ranks, float]] = field(default_factory=dict, repr=False, compare=False)

    def add(self, node: Node, received: float, said: NodeArrivals) -> None:
        """One arrivals message of node's agent; collectives whose latest arrival is older than the horizon are let
        go, oldest first, so that each message costs what it brings, not what is kept (a cost per message that grew
        with the job made the whole grow with its square)."""
        if node.node_rank not in self.nodes:
            self.nodes[node.node_rank], self._for = node.ranks, ()  # its ranks are placed at the next look
        offset = self.offsets[node.node_rank] = -said.ahead if said.ahead is not None else \
            min(self.offsets.get(node.node_rank, received - said.t), received - said.t)
        for one in said.collectives:
            key = (one.group, one.seq)
            entry = self.seen.setdefault(key, {}).setdefault(node.node_rank, NodeAt())
            if one.at is not None:
                entry.at = one.at / 1e9 + offset
            entry.named.update((rank, ns / 1e9 + offset) for rank, ns in one.named.items())
            latest = max([*entry.named.values(), *([] if entry.at is None else [entry.at])])
            self.newest[key] = max(self.newest.get(key, latest), latest)
            self._forget(key)
        oldest = received - self.horizon
        while self.newest:
            key = next(iter(self.newest))  # the first collective seen: the oldest, but for a straggler's late word
            if self.newest[key] >= oldest:
                break
            del self.newest[key], self.seen[key]
            self._forget(key)

    def _forget(self, key: tuple[str, int]) -> None:
        self._complete.pop(key, None)
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
            self._for, self._complete, self._start, self._late, self._live = tuple(live), {}, {}, {}, {}
            node_of = {rank: number for number, ranks in self.nodes.items() for rank in ranks}
            for rank in live:
                self._live.setdefault(node_of.get(rank, -1), []).append(rank)
        for key, nodes in self.seen.items():
            if key not in self._start and len(nodes) >= len(self._live) and (groups := self._groups(key)):
                self._complete[key], self._start[key] = groups, min(when for when, _ in groups)
        if not self._start:
            return {}
        end = max(self._start.values())
        stretches = [(key, start, stop) for key, start in self._start.items()
                     if (stop := self._start.get((key[0], key[1] + 1))) is not None and start >= end - window]
        covered = sum(stop - start for _, start, stop in stretches)
        if covered <= 0 or max(s[2] for s in stretches) - min(s[1] for s in stretches) < window / 2:
            return {}
        late_by: dict[Ranks, float] = {}
        for key, start, stop in stretches:
            if (stretch := self._late.get(key)) is None:
                stretch = self._late[key] = _stretch_late(self._complete[key], len(live), start, stop)
            for ranks, value in stretch.items():
                late_by[ranks] = late_by.get(ranks, 0.0) + value
        late = dict.fromkeys(live, 0.0)
        for ranks, value in late_by.items():
            for rank in ranks:
                late[rank] += value
        return {rank: 100 * value / covered for rank, value in late.items()}

    def _groups(self, key: tuple[str, int]) -> list[tuple[float, Ranks]] | None:
        """The live ranks at collective key, as (when, the ranks that arrived then); None until every one did."""
        nodes, groups = self.seen[key], list[tuple[float, Ranks]]()
        for number, ranks in self._live.items():
            if (entry := nodes.get(number)) is None:
                return None
            groups += [(entry.named[rank], (rank,)) for rank in ranks if rank in entry.named]
            if together := tuple(rank for rank in ranks if rank not in entry.named):
                if entry.at is None:
                    return None
                groups.append((entry.at, together))
        return groups


def _stretch_late(groups: list[tuple[float, Ranks]], live: int, start: float, stop: float) -> dict[Ranks, float]:
    """The seconds of one stretch in which each live rank's peers had arrived and it had not (those late only), by
    the ranks that arrived together."""
    if live <= PEERS_ALONE:
        groups = [(when, (rank,)) for when, ranks in groups for rank in ranks]
        late = {}
        for when, ranks in groups:
            peers = statistics.median(other for other, them in groups if them != ranks)
            if (value := min(when, stop) - max(peers, start)) > 0:
                late[ranks] = value
        return late
    everyone = _median(groups)
    return {ranks: value for when, ranks in groups if (value := min(when, stop) - max(everyone, start)) > 0}


def _median(groups: list[tuple[float, Ranks]]) -> float:
    """statistics.median of every rank's time, each group's time counted once for each of its ranks."""
    ordered = sorted((when, len(ranks)) for when, ranks in groups)
    count = sum(size for _, size in ordered)
    low, high, seen = (count - 1) // 2, count // 2, 0
    found: list[float] = []
    for when, size in ordered:
        while len(found) < 2 and seen <= (low, high)[len(found)] < seen + size:
            found.append(when)
        seen += size
        if len(found) == 2:
            break
    return (found[0] + found[1]) / 2
