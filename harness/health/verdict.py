"""A hang's verdict: who it is about and where every rank is, from each rank's stack (harness.node.ranks)
and its last collectives (Flight Recorder, harness.node.collectives.last_entries). Pure.

By collective, where every running rank's could be read: in each process group with an unfinished
collective, #N is the furthest one a rank waits in, and
- ranks waiting in #N with different operations (or sizes) are a mismatch: the program calls different
  collectives on different ranks (an if/else, a skipped call). Both sides are named; neither is picked
  as the culprit, since nothing says which side is wrong;
- a rank that has not reached #N is behind: the others wait for it, and its stack says where it is;
- a rank still in a collective the others completed (#N-1) waits for data that did not arrive: the
  network, not the rank;
- every rank in #N, none behind: the collective itself does not complete.
Else by stack alone, with the reason Flight Recorder could not be read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from harness.health.rank_stack import (
    DEFAULT_GROUP,
    Collective,
    RankStack,
    oldest_unfinished,
    ranks_text,
    short_path,
    state_words,
)
from harness.plan.planner import Node


class Ended(NamedTuple):
    """A rank whose node had ended before the hang was judged, and how it ended."""

    node: Node
    how: str


@dataclass(frozen=True)
class Verdict:
    """Who a hang is about. odd: the ranks at fault, where it can tell; text: the one line said everywhere
    (after "hang: ")."""

    text: str
    odd: list[int]


def hang_verdict(stall: float, stacks: Mapping[int, RankStack], ended: Mapping[int, Ended]) -> Verdict:
    """ended: ranks whose node had already ended -> (node, how). Ranks that ended or are stopped first; then
    where the others are by collective, where every one's last collectives were read; else by stack."""
    odd: dict[int, str] = {}
    for rank, (node, how) in ended.items():
        odd[rank] = f"({node.label} on {node.host}) had ended ({how})"
    for rank, stack in stacks.items():
        if rank not in odd and stack.state in ("T", "t"):
            odd[rank] = f"({stack.node.label} on {stack.node.host}) is {state_words(stack.state)} {stack.where()}"
    head = f"no progress for {stall:g} s: "
    first = [f"rank {rank} {what}" for rank, what in sorted(odd.items())]
    reading = {r: s for r, s in stacks.items() if r not in odd}
    unread = {r: s.collectives for r, s in reading.items() if not isinstance(s.collectives, tuple)}
    if reading and not unread and (found := collective_verdict(dict(reading), explained=bool(odd))) is not None:
        parts, culprits = found
        return Verdict(head + "; ".join(first + parts), sorted(set(odd) | set(culprits)))
    verdict = _stack_verdict(stacks, odd)
    reasons: dict[str, list[int]] = {}
    for rank, why in sorted(unread.items()):
        if isinstance(why, str):
            reasons.setdefault(why, []).append(rank)
    said = [f"{ranks_text(ranks)}: {why}" for why, ranks in reasons.items()]
    note = f" (Flight Recorder not read: {'; '.join(said)})" if said else ""
    return Verdict(head + verdict.text + note, verdict.odd)


def _stack_verdict(stacks: Mapping[int, RankStack], odd: dict[int, str]) -> Verdict:
    """Who is odd by stack alone: besides ranks that ended or are stopped (odd), a rank whose DataLoader
    worker is in the user's code, a rank outside torch's waits while its peers are in one, a minority in
    another collective, or the one that got further in the function where the stacks part."""
    odd = dict(odd)
    live = {r: s for r, s in stacks.items() if r not in odd}
    for rank, stack in live.items():
        if found := stack.stuck_worker():
            number, worker = found
            odd[rank] = f"'s DataLoader worker {number} ({stack.node.label} on {stack.node.host}, pid " \
                        f"{worker.pid}) {worker.where()}"
        elif stack.threads is not None and not stack.waiting():
            odd[rank] = f"({stack.node.label} on {stack.node.host}) {stack.where()}"
    waiters = {r: s for r, s in live.items() if r not in odd}
    groups: dict[str, list[int]] = {}
    for rank, stack in sorted(waiters.items()):
        groups.setdefault(stack.where(), []).append(rank)
    parts = _said_once(odd)
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
    return Verdict("; ".join(parts), sorted(odd))


NODE_PART = re.compile(r"^\((\S+?)(\d+) on \S+\) ")  # `(node29 on h29) `: a rank's words start with its node


def _said_once(odd: dict[int, str]) -> list[str]:
    """Each odd rank's words, ranks whose words differ only in their node said together (`ranks 116-123
    (nodes 29,30) at ...`): at hundreds of ranks the verdict stays one readable line."""
    alike: dict[str, list[int]] = {}
    for rank, what in sorted(odd.items()):
        match = NODE_PART.match(what)
        alike.setdefault(what[match.end():] if match else what, []).append(rank)
    parts = []
    for rest, ranks in alike.items():
        if len(ranks) == 1:
            what = odd[ranks[0]]
            parts.append(f"rank {ranks[0]}{'' if what.startswith(chr(39)) else ' '}{what}")
            continue
        nodes = [match[2] for r in ranks if (match := NODE_PART.match(odd[r]))]
        label = NODE_PART.match(odd[ranks[0]])
        where = f" ({ranks_text(map(int, nodes), label[1])})" if label and len(nodes) == len(ranks) else ""
        parts.append(f"{ranks_text(ranks)}{where} {rest}")
    return parts


def _ahead(groups: list[list[RankStack]]) -> tuple[list[int], str] | None:
    """The group that got furthest in the function where the groups' stacks part, when one did: the
    outermost frame they do not share is the same function on a later line (e.g. after the loop that
    holds the others' collective). (its ranks, "FUNC (FILE:LINE, the others at :LINE)")."""
    outer = [list(reversed(group[0].main_frames())) for group in groups]
    depth = 0
    while all(len(frames) > depth for frames in outer) and \
            len({(f[depth].file, f[depth].name, f[depth].line) for f in outer}) == 1:
        depth += 1
    if not all(len(frames) > depth for frames in outer) or \
            len({(f[depth].file, f[depth].name) for f in outer}) != 1:
        return None
    lines = [frames[depth].line for frames in outer]
    furthest = max(lines)
    if lines.count(furthest) != 1:
        return None
    at = outer[lines.index(furthest)][depth]
    others = ", :".join(str(line) for line in sorted(set(lines) - {furthest}))
    return (sorted(r.rank for r in groups[lines.index(furthest)]),
            f"{at.name} ({short_path(at.file)}:{furthest}, the others at :{others})")


@dataclass(frozen=True)
class _Group:
    """One process group's state on a hang: its member ranks, each one's collectives in it, the unfinished
    one each waits in, #furthest, and who waits there."""

    name: str
    members: list[int]
    mine: dict[int, list[Collective]]
    waiting: dict[int, Collective]
    furthest: int
    at: dict[int, Collective]

    @property
    def of(self) -> str:
        """` of process group 2`; nothing for the default group."""
        return "" if self.name == DEFAULT_GROUP else f" of process group {self.name}"

    def behind(self) -> list[int]:
        return [r for r in self.members if r not in self.at]


def _groups(entries: dict[int, tuple[Collective, ...]]) -> list[_Group]:
    """The groups with an unfinished collective, the default one first."""
    names = sorted({e.group for found in entries.values() for e in found if not e.done},
                   key=lambda g: (g != DEFAULT_GROUP, g))
    found = []
    for name in names:
        members = sorted(entries) if name == DEFAULT_GROUP else \
            sorted(r for r, mine in entries.items() if any(e.group == name for e in mine))
        mine = {r: [e for e in entries[r] if e.group == name] for r in members}
        waiting = {r: entry for r, own in mine.items() if (entry := oldest_unfinished(own)) is not None}
        furthest = max(e.seq for e in waiting.values())
        found.append(_Group(name, members, mine, waiting, furthest,
                            {r: e for r, e in waiting.items() if e.seq == furthest}))
    return found


def collective_verdict(stacks: dict[int, RankStack], explained: bool = False) -> tuple[list[str], list[int]] | None:
    """(the verdict's parts, the ranks at fault) from stacks whose collectives were read, or None
    when no rank waits in a collective (then the stacks alone tell). explained: a rank that ended or is
    stopped is the reason already, so a collective nobody is behind in needs no other suspect. Each rank
    is said once: where it waits, or, waiting nowhere, as behind in the smallest group that waits for it."""
    groups = _groups({r: s.collectives for r, s in stacks.items() if isinstance(s.collectives, tuple)})
    if not groups:
        return None
    waits = {r for g in groups for r in g.waiting}
    behind = {g.name: g.behind() for g in groups}  # each once: every look below is then linear in the ranks
    home: dict[int, str] = {}
    # Largest first, so that the smallest group that waits for a rank is its home (the first of equals, as min() would)
    for group in sorted(reversed(groups), key=lambda g: len(g.members), reverse=True):
        home.update((r, group.name) for r in behind[group.name] if r not in waits)
    parts: list[str] = []
    odd: set[int] = set()
    for group in groups:
        kinds: dict[str, list[int]] = {}
        alike = len({e.op_name for e in group.at.values()}) == 1
        mixed = len({str(e.sizes) for e in group.at.values()}) > 1  # the same operation on different shapes
        finished: dict[int, list[int]] = {}  # seq -> the ranks at #furthest that completed it (asked of, once)
        for rank, entry in sorted(group.at.items()):
            kind = f"{entry.op_name}{f' of {entry.sizes}' if mixed else ''}" if alike else entry.op_name
            kinds.setdefault(kind, []).append(rank)
        if len(kinds) > 1:
            sides = [f"{ranks_text(ranks)} in {kind} {_places(stacks, ranks)}" for kind, ranks in kinds.items()]
            parts.append(f"collective mismatch at #{group.furthest}{group.of}: {', '.join(sides)}: the program calls "
                         f"different collectives on different ranks")
            odd |= set(group.at)
        else:
            verb = "waits" if len(group.at) == 1 else "wait"
            parts.append(f"{ranks_text(group.at)} {verb} in {next(iter(kinds))} #{group.furthest}{group.of} "
                         f"{_places(stacks, list(group.at))}")
        for rank in behind[group.name]:
            stack, behind_in = stacks[rank], group.waiting.get(rank)
            who = f"rank {rank} ({stack.node.label} on {stack.node.host})"
            if behind_in is not None and behind_in.seq not in finished:
                finished[behind_in.seq] = [r for r in group.at if any(
                    e.seq == behind_in.seq and e.done for e in group.mine[r])]
            if behind_in is not None and len(finished[behind_in.seq]) == len(group.at):
                parts.append(f"{who} waits in {behind_in.op_name} #{behind_in.seq}{group.of}, which "
                             f"{ranks_text(finished[behind_in.seq])} completed: the rest of its data did not arrive "
                             f"(suspect the network between the nodes, or a peer's host)")
                continue
            if behind_in is not None:
                parts.append(f"{who} waits in {behind_in.op_name} #{behind_in.seq}{group.of}, behind "
                             f"#{group.furthest}, {stack.place()}")
            elif home.get(rank) != group.name:
                continue  # said where it waits, or in the group that waits for it most closely
            elif any(e.seq >= group.furthest for e in group.mine[rank]):
                parts.append(f"{who} completed #{group.furthest}{group.of} and is {_where(stack)}")
                continue
            else:
                parts.append(f"{who} has not reached #{group.furthest}{group.of}, {_where(stack)}")
            odd.add(rank)
        if not behind[group.name] and len(kinds) == 1 and not explained:
            parts.append("no rank is behind: the collective itself does not complete (suspect the network between "
                         "the nodes, a peer's host, or a GPU kernel before it that never ends)")
    return parts, sorted(odd)


def _places(stacks: dict[int, RankStack], ranks: list[int]) -> str:
    """Where these ranks are in the code: once when they are at the same line, else each place once with its ranks."""
    by_place: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        by_place.setdefault(stacks[rank].place(), []).append(rank)
    if len(by_place) == 1:
        return next(iter(by_place))
    return "(" + ", ".join(f"{ranks_text(alike)} {place}" for place, alike in by_place.items()) + ")"


def _where(stack: RankStack) -> str:
    """Where a rank outside the collective is: its own line, or its DataLoader worker's when it waits for
    one that is in the user's code."""
    if found := stack.stuck_worker():
        number, worker = found
        return f"waiting for its DataLoader worker {number} (pid {worker.pid}) {worker.place()}"
    return stack.place()
