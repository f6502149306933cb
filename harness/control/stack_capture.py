"""Every rank's Python stack, asked of every running node's agent at once (on a hang, and for each
`harness stacks` request), reassembled from the agents' STACKS messages and kept in the run directory.
The requesting side of `harness stacks` is view/stacks.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from harness.control.live import LiveNode
from harness.health.rank_stack import RankStack, ranks_text
from harness.node.protocol import LAUNCHER_RANK, Kind, Message, StackChunks, answers_of
from harness.plan.planner import Node
from harness.record.rundir import STACKS_TAG, RunDir
from harness.targets.base import NodeProcess

STACKS_SECONDS = 20.0  # how long the nodes have to answer for their ranks' stacks
RANK_FILES = 256  # up to this many ranks, a hang's stacks are kept in a file per rank


class StackCapture:
    """The answers of every node's agent, as its listener hands them over (take), for whoever asked. nodes:
    the attempt's started nodes (the supervisor's list, filled as it starts them)."""

    def __init__(self, nodes: list[tuple[NodeProcess, LiveNode]]) -> None:
        self._nodes = nodes
        self._chunks: dict[int, StackChunks] = {}  # node rank -> its answers' chunks so far
        self._answers: dict[str, dict[int, dict[str, Any]]] = {}  # tag -> rank -> answer
        self._launchers: dict[str, dict[int, dict[str, Any]]] = {}  # tag -> node rank -> its launcher's answer
        self._answered: dict[str, set[int]] = {}  # tag -> node ranks done
        self._changed = threading.Condition()

    def take(self, live: LiveNode, message: Message) -> None:
        """A STACKS or STACKS_DONE message of live's agent; ValueError for a damaged one."""
        with self._changed:
            if message.kind is Kind.STACKS:
                chunks = self._chunks.setdefault(live.node.node_rank, StackChunks())
                if (whole := chunks.take(message.body)) is not None and isinstance(whole.answer, dict):
                    if whole.rank == LAUNCHER_RANK:
                        self._launchers.setdefault(whole.tag, {})[live.node.node_rank] = whole.answer
                    else:  # with the ranks whose stacks were alike, each made whole again
                        self._answers.setdefault(whole.tag, {}).update(answers_of(whole.rank, whole.answer))
            elif message.kind is Kind.STACKS_DONE:
                self._answered.setdefault(message.body, set()).add(live.node.node_rank)
                self._changed.notify_all()

    def node_ended(self) -> None:
        """A node that ended will not answer: whoever waits for it stops waiting."""
        with self._changed:
            self._changed.notify_all()

    def capture(self, tag: str, timeout: float = STACKS_SECONDS) -> dict[int, RankStack]:
        """Every running node's ranks' stacks, asked for at once; whatever arrived within timeout."""
        nodes = self._ask(tag, None, timeout)
        with self._changed:
            answers = self._answers.pop(tag, {})
            self._launchers.pop(tag, None)
        by_rank = {rank: node for node in nodes.values() for rank in node.ranks}
        return {rank: RankStack.from_answer(rank, by_rank[rank], answer) for rank, answer in answers.items()
                if rank in by_rank}

    def launchers(self, tag: str, asked: set[int], timeout: float) -> dict[int, RankStack]:
        """Where the launchers of the asked nodes (by node rank) are, of those still running with no ranks yet:
        their torchrun before its workers exist (harness.node.protocol.LAUNCHER_RANK), by node rank; a node that
        answered with ranks, or not within timeout, has none."""
        nodes = self._ask(tag, asked, timeout)
        with self._changed:
            self._answers.pop(tag, None)
            answers = self._launchers.pop(tag, {})
        return {number: RankStack.from_answer(LAUNCHER_RANK, nodes[number], answer)
                for number, answer in answers.items() if number in nodes}

    def _ask(self, tag: str, asked: set[int] | None, timeout: float) -> dict[int, Node]:
        """The asked running nodes (None: all) asked for their stacks at once, their answers awaited until each has
        answered or ended, at most timeout seconds; those nodes by node rank."""
        running = [(process, live) for process, live in self._nodes
                   if live.outcome is None and (asked is None or live.node.node_rank in asked)]
        for process, _ in running:
            process.request_stacks(tag)
        deadline = time.monotonic() + timeout
        nodes = {live.node.node_rank: live.node for _, live in running}
        with self._changed:
            while not set(nodes) <= self._answered.get(tag, set()) | self._ended():
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    break
        return nodes

    def _ended(self) -> set[int]:
        return {live.node.node_rank for _, live in self._nodes if live.outcome is not None}

    def answer_requests(self, run: RunDir) -> None:
        """`harness stacks` leaves request-TAG in the stacks directory; the answer is TAG/stacks.json."""
        for request in sorted(run.stacks.glob("request-*")) if run.stacks.is_dir() else []:
            tag = request.name.removeprefix("request-")
            if not STACKS_TAG.fullmatch(tag):  # not of `harness stacks`: a name that could carry another word
                request.unlink(missing_ok=True)
                continue
            keep(run, run.stacks / tag, self.capture(tag))
            request.unlink(missing_ok=True)


def keep(run: RunDir, where: Path, stacks: dict[int, RankStack]) -> None:
    """Each rank's stacks as py-spy shows them, its DataLoader workers' after them, then its last collectives
    (rankN.txt), and all of them as stacks.json, in where, a folder of run's. Past RANK_FILES ranks, ranks whose stacks
    are alike share one file (alike-rankN.txt, N the first of them, with their ranks) and only a rank alike with
    none has a file of its own: a file per rank was 16,384 files written before a verdict at 2,048 nodes x 8."""
    groups: dict[object, list[int]] = {}
    for rank, stack in sorted(stacks.items()):
        groups.setdefault(_alike(stack) if len(stacks) > RANK_FILES else rank, []).append(rank)
    for ranks in groups.values():
        stack = stacks[ranks[0]]
        if len(ranks) == 1:
            run.write_text(where / f"rank{ranks[0]}.txt", stack.text() + stack.collectives_text(),
                           f"rank {ranks[0]}'s stacks")
            continue
        head = f"{ranks_text(ranks)} ({len(ranks)} ranks) have stacks alike; rank {ranks[0]}'s:\n"
        run.write_text(where / f"alike-rank{ranks[0]}.txt", head + stack.text() + stack.collectives_text(),
                       f"the stacks of {ranks_text(ranks)}")
    answers = {str(rank): stack.to_answer() for rank, stack in sorted(stacks.items())}
    run.write_text(where / "stacks.json", json.dumps(answers), "the ranks' stacks")


def _alike(stack: RankStack) -> object:
    """What a rank's stacks say but who it is (its pid, its threads' ids): where each thread is, its collectives."""
    threads = tuple((t.name, tuple((f.name, f.file, f.line) for f in t.frames)) for t in stack.threads or ())
    collectives = stack.collectives if stack.collectives is None or isinstance(stack.collectives, str) else \
        tuple((c.group, c.seq, c.op, c.done, str(c.sizes)) for c in stack.collectives)
    return stack.state, stack.error, threads, collectives, tuple(_alike(worker) for worker in stack.workers)
