"""The job's health while it runs, judged twice a second from the agents' samples (run/health.py):
slow ranks named as they become slow and cleared as they recover, a hang found, its stacks kept and
its verdict said before every node is stopped; health.json says the same to `harness status`. The same
loop answers `harness stacks` requests."""

from __future__ import annotations

import json
import threading
import time

from harness.plan.planner import Node
from harness.run.atomic import write_text_atomic
from harness.run.health import SLOW_WINDOW, HealthWatch, Verdict, hang_verdict, ranks_text
from harness.run.live import LiveNode
from harness.run.output import Output
from harness.run.rundir import RunDir
from harness.run.stack_capture import StackCapture, keep
from harness.run.stopping import Stopper

TICK_SECONDS = 0.5


class Watch:
    """health: the judge (None: hangs and slow ranks are not watched, only `harness stacks` answered);
    run: where stacks, health.json and `harness stacks` requests live (None: nowhere); stopper: stops
    every node once a hang is found (and once the nodes are stopping, there is nothing more to judge)."""

    def __init__(self, health: HealthWatch | None, run: RunDir | None, attempt: int, nodes: list[LiveNode],
                 stacks: StackCapture, output: Output, stopper: Stopper) -> None:
        self.health, self.run, self.attempt, self.nodes = health, run, attempt, nodes
        self.stacks, self.output, self.stopper = stacks, output, stopper
        self.hang: Verdict | None = None  # the job hung: who it is about
        self.hang_at: float | None = None
        self.ended = threading.Event()  # every node has ended: the loop ends at once, not at its next tick

    def loop(self) -> None:
        """Until every node has ended."""
        while not self.ended.wait(TICK_SECONDS):
            if self.run is not None:
                self.stacks.answer_requests(self.run)
            if self.health is None or self.stopper.since is not None:
                continue
            for live in self.nodes:
                if live.outcome is not None:
                    self.health.node_ended(live.node.node_rank)
            for rank, waited in self.health.slow_changes(time.time()):
                self.output.say(self._slow_words(rank, waited))
                self._write_health()
            if stalled := self.health.stalled():
                self._hung(stalled)

    def _slow_words(self, rank: int, waited: float | None) -> str:
        node = self._node_of(rank)
        if waited is None:
            return f"rank {rank} ({node.label} on {node.host}) is no longer slow"
        return (f"slow: rank {rank} ({node.label} on {node.host}): its peers wait for it {waited:.0f}% of the time "
                f"(over the last {SLOW_WINDOW:g} s)")

    def _node_of(self, rank: int) -> Node:
        return next(live.node for live in self.nodes if rank in live.node.ranks)

    def _hung(self, stalled: list[int]) -> None:
        """Read every rank's stacks, keep them, say who the hang is about, and stop the job."""
        assert self.health is not None
        self.hang_at = time.time()
        self.output.say(f"no progress for {self.health.stall:g} s on {ranks_text(stalled)}: reading every rank's "
                        f"stack")
        stacks = self.stacks.capture(f"hang-{self.attempt}")
        ended = {rank: (live.node, live.outcome.describe()) for live in self.nodes if live.outcome is not None
                 for rank in live.node.ranks}
        if self.run is not None:
            keep(self.run.stacks / f"attempt-{self.attempt}", stacks)
        self.hang = hang_verdict(self.health.stall, stacks, ended)
        self._write_health()
        kept = f" (stacks in {self.run.stacks}/attempt-{self.attempt}/)" if self.run else ""
        self.output.say(f"hang: {self.hang.text}{kept}")
        self.stopper.stop_all()

    def _write_health(self) -> None:
        if self.run is None or self.health is None:
            return
        slow = {str(rank): round(waited, 1) for rank, waited in self.health.slow_ranks().items()}
        write_text_atomic(self.run.health_file, json.dumps(
            {"attempt": self.attempt, "slow": slow, "hang": f"hang: {self.hang.text}" if self.hang else None}))
