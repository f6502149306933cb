"""health.json past schema.SUMMED_PAST ranks: each node summed up in a constant room (NodeHealth) and only the odd
ranks listed, so that what the health loop writes twice a second grows with the nodes, not with their ranks (at
2,048 nodes x 8, about 100 bytes a node where every rank's row took 500 bytes a rank); every rank's row goes to
health-ranks.json every TABLE_SECONDS (and at a hang), for whoever wants them all."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from harness.record.schema import LiveHealth, NodeHealth, RankRow

TABLE_SECONDS = 30.0  # how often every rank's row is written to health-ranks.json
ODD_LISTED = 64  # odd ranks listed in health.json at most, the most telling first (the rest counted: odd_left)
BEHIND_LISTED = 8  # of them, ranks listed for being furthest behind in steps
WORKING = ("computing", "waiting")  # one activity: a rank of a healthy job goes from one to the other within a step
STILL = ("no progress", "stopped (SIGSTOP)", "traced")  # kinds always odd (health/judge.py's views)
SECONDS = re.compile(r" for \d+ s$")


class NodeSpan(NamedTuple):
    """A node as the summary needs it: its node rank, host and global ranks."""

    node_rank: int
    host: str
    ranks: range


def state_kind(state: str) -> str:
    """A rank's state without its seconds (`no progress for 31 s` -> `no progress`): what nodes count by."""
    return SECONDS.sub("", state) if state.endswith(" s") else state


def activity(kind: str) -> str:
    """A state kind with computing and waiting as one (WORKING): what `most ranks are doing` compares."""
    return "computing or waiting" if kind in WORKING else kind


def by_activity(states: Mapping[str, int]) -> Counter[str]:
    """Ranks counted by state kind (NodeHealth.states), counted by activity."""
    counted = Counter[str]()
    for kind, count in states.items():
        counted[activity(kind)] += count
    return counted


def odd_ranks(ranks: dict[int, RankRow], kinds: dict[int, str], named: Iterable[int]) -> list[int]:
    """The ranks worth a row of their own, the most telling first: those named (a hang's verdict's, the slow ones);
    then those whose state is odd, the longest without progress first: no progress or stopped (STILL), or another
    activity than the one most ranks are in (computing and waiting one activity: WORKING); then up to BEHIND_LISTED
    ranks furthest behind in steps, where more than one step behind the furthest rank (ranks in step print their
    lines a moment apart, one step apart at times). kinds: each rank's state_kind."""
    odd = dict.fromkeys(rank for rank in named if rank in ranks)
    usual = next(iter(by_activity(Counter(kinds.values())).most_common(1)), ("", 0))[0]
    stuck = [rank for rank, kind in kinds.items() if kind in STILL or activity(kind) != usual]
    odd.update(dict.fromkeys(sorted(stuck, key=lambda rank: (-(ranks[rank].idle or 0.0), rank))))
    steps = {rank: row.step for rank, row in ranks.items() if row.step is not None}
    if steps:
        furthest = max(steps.values())
        behind = sorted((step, rank) for rank, step in steps.items() if step < furthest - 1)
        odd.update(dict.fromkeys(rank for _, rank in behind[:BEHIND_LISTED]))
    return list(odd)


def node_health(node: NodeSpan, ranks: dict[int, RankRow], kinds: dict[int, str]) -> NodeHealth:
    """A node's ranks in a few numbers (ranks: the attempt's rows by rank, the node's among them; kinds: their
    state_kind)."""
    rows = [ranks[rank] for rank in node.ranks if rank in ranks]
    steps = [row.step for row in rows if row.step is not None]
    cpus = [row.cpu for row in rows if row.cpu is not None]
    states: dict[str, int] = {}
    for rank in node.ranks:
        if rank in kinds:
            states[kinds[rank]] = states.get(kinds[rank], 0) + 1
    return NodeHealth(node.node_rank, node.host, node.ranks[0], node.ranks[-1], states, min(steps, default=None),
                      max(steps, default=None), round(sum(cpus), 3) if cpus else None)


def summed(health: LiveHealth, nodes: Sequence[NodeSpan], named: Iterable[int], table_at: float | None) -> LiveHealth:
    """health (every rank's row) as health.json holds it past SUMMED_PAST ranks: every node summed up, and only the
    odd ranks' rows (named: ranks a hang's verdict names; the slow ones are named by health itself), at most
    ODD_LISTED of them; table_at: when health-ranks.json last took every row."""
    slow = [*health.slow, *([health.slowed.rank] if health.slowed is not None else [])]
    kinds = {rank: state_kind(row.state) for rank, row in health.ranks.items()}
    odd = odd_ranks(health.ranks, kinds, [*named, *slow])
    listed = sorted(odd[:ODD_LISTED])
    return replace(health, ranks={rank: health.ranks[rank] for rank in listed},
                   nodes=[node_health(node, health.ranks, kinds) for node in nodes], odd_left=len(odd) - len(listed),
                   table_at=table_at)
