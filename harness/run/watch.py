"""The job's health while it runs, judged twice a second from the agents' samples (run/health.py):
slow ranks named as they become slow and cleared as they recover, a hang found, its stacks kept and
its verdict said before every node is stopped. health.json says the same to `harness status` and
`harness top`, with every rank's state, CPU use, last line and step; timeline.jsonl keeps each rank's
course for `harness report`; the verdicts go into the attempt's record. The same loop answers
`harness stacks` requests."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from harness.plan.planner import Node
from harness.run.atomic import write_text_atomic
from harness.run.health import SLOW_WINDOW, HealthWatch, RankView, ranks_text
from harness.run.live import LiveNode, RankActivity
from harness.run.output import Output
from harness.run.records import HealthEvent, HealthEventKind
from harness.run.rundir import RunDir
from harness.run.stack_capture import StackCapture, keep
from harness.run.stopping import Stopper
from harness.run.timeline import RankPoint, Sample, append_sample
from harness.run.verdict import Verdict, hang_verdict

TICK_SECONDS = 0.5
TIMELINE_SECONDS = 5.0  # how often each rank's course is added to timeline.jsonl
RATE_WINDOW = 60.0  # seconds of reported steps the step rate is measured over
LINE_KEPT = 240  # characters of a rank's last line in health.json


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
        self.events: list[HealthEvent] = []  # the verdicts, for the attempt's record
        self._sampled = 0.0

    def loop(self) -> None:
        """Until every node has ended."""
        while not self.ended.wait(TICK_SECONDS):
            if self.run is not None:
                self.stacks.answer_requests(self.run)
            judging = self.health is not None and self.stopper.since is None
            if self.health is not None and judging:
                for live in self.nodes:
                    if live.outcome is not None:
                        self.health.node_ended(live.node.node_rank)
                for rank, waited in self.health.slow_changes(time.time()):
                    words = self._slow_words(rank, waited)
                    self.output.say(words)
                    kind = HealthEventKind.SLOW if waited is not None else HealthEventKind.RECOVERED
                    self.events.append(HealthEvent(time.time(), kind, words, rank, waited and round(waited, 1)))
            if self.run is not None:
                self._write_health()
            if self.health is not None and judging and (stalled := self.health.stalled()):
                self._hung(stalled)

    def _slow_words(self, rank: int, waited: float | None) -> str:
        node = self._node_of(rank)
        if waited is None:
            return f"rank {rank} ({node.label} on {node.host}) is no longer slow"
        assert self.health is not None
        words = {"arrival": "when it arrives at its collectives", "busy": "CPU time"}
        measures = self.health.measures().get(rank, {})
        shown = sorted(measures.items(), key=lambda item: -item[1])
        by = "; ".join(f"{round(value)}% by {words[name]}" for name, value in shown[1:])
        return (f"slow: rank {rank} ({node.label} on {node.host}): its peers wait for it {round(waited)}% of the time "
                f"(over the last {SLOW_WINDOW:g} s, by {words[shown[0][0]] if shown else 'CPU time'}"
                f"{'; ' + by if by else ''})")

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
        self.events.append(HealthEvent(self.hang_at, HealthEventKind.HANG, f"hang: {self.hang.text}",
                                       self.hang.odd[0] if len(self.hang.odd) == 1 else None))
        self._write_health()
        kept = f" (stacks in {self.run.stacks}/attempt-{self.attempt}/)" if self.run else ""
        self.output.say(f"hang: {self.hang.text}{kept}")
        self.stopper.stop_all()

    def _write_health(self) -> None:
        """health.json for status and top; every TIMELINE_SECONDS, a line of timeline.jsonl."""
        if self.run is None:
            return
        now = time.time()
        views = self.health.views() if self.health is not None else {}
        slow = self.health.slow_ranks() if self.health is not None else {}
        ranks = {rank: _rank_json(live, rank, views.get(rank), live.activity.get(rank), now)
                 for live in self.nodes for rank in live.node.ranks}
        write_text_atomic(self.run.health_file, json.dumps(
            {"attempt": self.attempt, "t": now, "slow": {str(rank): round(waited, 1) for rank, waited in slow.items()},
             "hang": f"hang: {self.hang.text}" if self.hang else None,
             "ranks": {str(rank): value for rank, value in sorted(ranks.items())}}))
        if now - self._sampled >= TIMELINE_SECONDS and (views or any(r["step"] is not None for r in ranks.values())):
            self._sampled = now
            append_sample(self.run.timeline, Sample(now, self.attempt, {
                rank: RankPoint(views[rank].cpu if rank in views else 0.0,
                                views[rank].busy if rank in views else None, value["step"])
                for rank, value in ranks.items() if rank in views or value["step"] is not None}))


def _rank_json(live: LiveNode, rank: int, view: RankView | None, activity: RankActivity | None,
               now: float) -> dict[str, Any]:
    """One rank's row of health.json: its node, state, CPU use, last line and step."""
    if live.outcome is not None:
        state = f"ended ({live.outcome.describe()})"
    else:
        state = view.state if view is not None else "running"
    step = rate = None
    if activity is not None and activity.steps:
        step = activity.steps[-1][1]
        recent = [(t, s) for t, s in activity.steps if t >= now - RATE_WINDOW]
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            rate = round((recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]), 3)
    return {"node": live.node.label, "host": live.node.host, "state": state,
            "cpu": None if view is None else round(view.cpu, 3), "busy": None if view is None else round(view.busy, 3),
            "last_line": None if activity is None else activity.line[:LINE_KEPT],
            "last_line_at": None if activity is None else round(activity.at, 3), "step": step, "step_rate": rate}
