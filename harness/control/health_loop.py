"""The job's health while it runs, judged twice a second from the agents' samples (health/judge.py), its rank-wide
work less often in a job of many nodes (HealthLoop.every):
slow ranks named as they become slow and cleared as they recover, a hang found, its stacks kept and
its verdict said before every node is stopped. health.json says the same to `harness status` and
`harness top`, with every rank's state, CPU use, last line and step; timeline.jsonl keeps each rank's
course for `harness report`; the verdicts go into the attempt's record. The same loop answers
`harness stacks` requests."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

from harness.control.live import LiveNode, RankActivity
from harness.control.output import Output
from harness.control.stack_capture import StackCapture, keep
from harness.control.stopper import Stopper
from harness.health.judge import SLOW_WINDOW, HealthJudge, RankView, SlowMeasure
from harness.health.rank_stack import RankStack, ranks_text, short_ranges
from harness.health.rendezvous import RendezvousVerdict, rendezvous_verdict
from harness.health.slowdown import Course, PaceHistory, Slowdown, SlowPolicy, decide, slowdown
from harness.health.verdict import Ended, Verdict, hang_verdict
from harness.node.protocol import YOUNG_SECONDS, paced, sample_interval
from harness.plan.planner import Node
from harness.record.health_summary import TABLE_SECONDS, NodeSpan, summed
from harness.record.rundir import RunDir
from harness.record.schema import SUMMED_PAST, HealthEvent, HealthEventKind, LiveHealth, Progress, RankRow, Slowed
from harness.record.timeline import RankPoint, Sample

TICK_SECONDS = 0.5
TIMELINE_SECONDS = 5.0  # how often each rank's course is added to timeline.jsonl (more often while young)
RATE_WINDOW = 60.0  # seconds of reported steps the step rate is measured over
STEP_QUIET_SECONDS = 10.0  # no new step for this long (and three of the rank's usual intervals): its rate is 0
LINE_KEPT = 240  # characters of a rank's last line in health.json
LAUNCHERS_LEAD = 5.0  # seconds before the rendezvous deadline that the late nodes' launchers are read
MEASURE_WORDS = {"arrival": "when it arrives at its collectives", "busy": "CPU time"}


class HealthLoop:
    """judge: what decides (None: hangs and slow ranks are not watched, only `harness stacks` answered);
    run: where stacks, health.json and `harness stacks` requests live (None: nowhere); stopper: stops
    every node once a hang is found (and once the nodes are stopping, there is nothing more to judge);
    furthest: the furthest step the run's earlier attempts reached (None: none), which this one redoes first;
    slow_policy: what a slowness that lasts is weighed against, and whether it is acted on (None: it is not weighed)."""

    def __init__(self, judge: HealthJudge | None, run: RunDir | None, attempt: int, nodes: list[LiveNode],
                 stacks: StackCapture, output: Output, stopper: Stopper, furthest: int | None = None,
                 rendezvous: float | None = None, slow_policy: SlowPolicy | None = None) -> None:
        self.judge, self.run, self.attempt, self.nodes = judge, run, attempt, nodes
        self.stacks, self.output, self.stopper, self.furthest = stacks, output, stopper, furthest
        self.rendezvous = rendezvous  # seconds every node has to start its ranks (None: no deadline)
        self.unjoined: RendezvousVerdict | None = None  # the rendezvous did not complete in time: who never joined
        self._launchers: dict[int, RankStack] | None = None  # where the late nodes' torchrun was, near the deadline
        self.started_at = time.time()  # when this loop began: the rendezvous deadline counts from it
        self.attempt_started_at = self.started_at  # the attempt's start (earlier, for an attempt taken back)
        self.progress: Progress | None = None  # the attempt's steps so far
        self.on_first_step: Callable[[Progress], None] | None = None  # told once, when the attempt's first step comes
        self.hang: Verdict | None = None  # the job hung: who it is about
        self.hang_at: float | None = None
        self.ended = threading.Event()  # every node has ended: the loop ends at once, not at its next tick
        self.events: list[HealthEvent] = []  # the verdicts, for the attempt's record
        self.slow_policy = slow_policy
        self.paces = PaceHistory()  # the job's furthest step over time: its pace before a slowness and since
        self.slow_episodes: dict[int, float] = {}  # ranks named slow -> when their slowness began
        self.weighed: set[int] = set()  # of those, the ones whose slowness was weighed (once each)
        self.slow_out: HealthEvent | None = None  # the weighing that stopped the job to restart without a slow host
        self.saved_step: int | None = None  # the furthest step when the job last said a checkpoint was saved
        self._saved_s = 0.0
        self._sampled = 0.0
        self._table_at: float | None = None  # when every rank's row was last written (a job past SUMMED_PAST ranks)
        self._timeline_every_at: float | None = None  # when timeline.jsonl last took every rank (past SUMMED_PAST)
        self._captures = 0  # hang captures made (one may prove no hang: its ranks made progress meanwhile)
        self._weighed_at = 0.0  # when every rank was last weighed (HealthLoop.every)

    @property
    def every(self) -> float:
        """How often what weighs every rank is done (slowness from their arrivals; each rank's row, the steps,
        health.json): as often as the agents' samples come (protocol.paced), twice a second up to 250 nodes, every
        4.1 s at 2,048, where twice a second was half of the controller's core for nothing new. A hang is looked
        for at every tick (the judge keeps each rank's progress as samples come: judge.stalled costs little)."""
        return paced(TICK_SECONDS, len(self.nodes))

    def loop(self) -> None:
        """Until every node has ended. A tick that fails is said once (the watch goes on at the next one):
        a bug in judging must not leave the run unwatched without a word."""
        failed: set[str] = set()
        while not self.ended.wait(TICK_SECONDS):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - said, and the next tick tries again
                if (why := f"{type(exc).__name__}: {exc}") not in failed:
                    failed.add(why)
                    frame = traceback.extract_tb(exc.__traceback__)[-1]
                    self.output.say(f"the health watch failed a tick ({why}, at {frame.filename}:{frame.lineno}); "
                                    "it goes on")

    def _tick(self) -> None:
        if self.run is not None:
            self.stacks.answer_requests(self.run)
        judging = self.judge is not None and self.stopper.since is None
        now = time.time()
        weighing = now - self._weighed_at >= self.every - TICK_SECONDS / 2
        if weighing:
            self._weighed_at = now
        if self.judge is not None and judging:
            for live in self.nodes:
                if live.outcome is not None:
                    self.judge.node_ended(live.node.node_rank)
            if weighing:
                self._watch_slowness(now)
        if self.run is not None and weighing:
            self._write_health()
        if self.rendezvous is not None and self.unjoined is None and self.stopper.since is None:
            self._watch_rendezvous(self.rendezvous)
        if self.judge is not None and judging and (stalled := self.judge.stalled()):
            self._hung(stalled)

    def _watch_rendezvous(self, deadline: float) -> None:
        """Every running node starts its ranks within deadline seconds of the attempt's start (torchrun's rendezvous
        done), whatever the rendezvous kind, or the attempt ends: the late nodes' launchers are read LAUNCHERS_LEAD
        seconds before the deadline, so that they are named at it, and every node is stopped."""
        age = time.time() - self.started_at
        late = [live for live in self.nodes if not live.ranks_started and live.outcome is None]
        lead = min(LAUNCHERS_LEAD, deadline / 2)
        if not late or age < deadline - lead:
            return
        if self._launchers is None:
            asked = {live.node.node_rank for live in late}
            self._launchers = self.stacks.launchers(f"rendezvous-{self.attempt}", asked, lead)
            return
        if age < deadline:
            return
        joined = sum(live.ranks_started for live in self.nodes)
        self.unjoined = rendezvous_verdict(deadline, [live.node for live in late], self._launchers, joined)
        self.output.say(f"rendezvous: {self.unjoined.text}")
        self.stopper.stop_all()

    def _slow_words(self, rank: int, waited: float | None, slowed: Slowdown | None,
                    measures: dict[int, list[SlowMeasure]]) -> str:
        node = self._node_of(rank)
        if waited is None:
            return f"rank {rank} ({node.label} on {node.host}) is no longer slow"
        assert slowed is not None
        shown = measures.get(rank, [])
        by = "; ".join(f"{round(measure.percent)}% by {MEASURE_WORDS[measure.by]}" for measure in shown[1:])
        return (f"slow: rank {rank} ({node.label} on {node.host}): its peers wait for it {round(waited)}% of the time "
                f"(over the last {SLOW_WINDOW:g} s, by {MEASURE_WORDS[shown[0].by] if shown else 'CPU time'}"
                f"{'; ' + by if by else ''}); {slowed.words()}")

    def _watch_slowness(self, now: float) -> None:
        """Ranks named slow or cleared as the judge finds them at now, each said and recorded; then a slowness that
        lasted health.slow_for weighed."""
        assert self.judge is not None
        changes = self.judge.slow_changes(now)
        # Worked out once for all of them: once per rank was a second each at 16,384 ranks, the loop minutes late.
        measures = self.judge.measures() if changes else {}
        for rank, waited in changes:
            slowed = None
            if waited is not None:
                since = self.judge.slow_since(rank) or now
                self.slow_episodes[rank] = since
                slowed = slowdown(self.paces, since, now, self.attempt_started_at)
            else:
                self.slow_episodes.pop(rank, None)
                self.weighed.discard(rank)
            words = self._slow_words(rank, waited, slowed, measures)
            self.output.say(words)
            kind = HealthEventKind.SLOW if waited is not None else HealthEventKind.RECOVERED
            self.events.append(HealthEvent(now, kind, words, rank, waited and round(waited, 1), *_paces(slowed)))
        self._weigh_slowness(now)

    def _weigh_slowness(self, now: float) -> None:
        """A slowness that lasted health.slow_for, weighed once: its cost by the job's end against a restart
        without the slow host (health/slowdown.py); the sum said either way, and acted on where the policy allows."""
        policy, judge = self.slow_policy, self.judge
        if policy is None or judge is None or self.slow_out is not None:
            return
        for rank, since in sorted(self.slow_episodes.items()):
            lasting = judge.slow_since(rank)
            if rank in self.weighed or lasting is None or now - lasting < policy.slow_for:
                continue
            self.weighed.add(rank)
            node = self._node_of(rank)
            slowed = slowdown(self.paces, since, now, self.attempt_started_at)
            course = None if (p := self.progress) is None else Course(p.total, p.last_step, p.first_step, p.first_at)
            act, sum_words = decide(policy, slowed, course, self.saved_step, self.attempt_started_at, node.host)
            words = f"slow: rank {rank} ({node.label} on {node.host}) for {now - since:.0f} s: {sum_words}"
            self.output.say(words)
            event = HealthEvent(now, HealthEventKind.WEIGHED, words, rank, None, *_paces(slowed), acted=act)
            self.events.append(event)
            if act:
                self.slow_out = event
                self.stopper.stop_all()
                return

    def _node_of(self, rank: int) -> Node:
        return next(live.node for live in self.nodes if rank in live.node.ranks)

    def _hung(self, stalled: list[int]) -> None:
        """Read every rank's stacks, keep them, say who the hang is about, and stop the job; unless the ranks
        judged stalled made progress meanwhile (the capture takes seconds, a minute for 1,024 ranks on 2 cores)."""
        assert self.judge is not None
        self.hang_at = time.time()
        self.output.say(f"no progress for {self.judge.stall:g} s on rank{'s' if len(stalled) > 1 else ''} "
                        f"{short_ranges(stalled)}: reading every rank's stack")
        self._captures += 1  # a tag of its own: answers to an earlier capture may still be coming
        stacks = self.stacks.capture(f"hang-{self.attempt}-{self._captures}")
        if not set(stalled) & set(self.judge.stalled()):  # a slow start on a loaded machine, not a hang
            self.hang_at = None
            self.output.say(f"{ranks_text(stalled)} made progress while their stacks were read: not hung")
            return
        ended = {rank: Ended(live.node, live.outcome.describe()) for live in self.nodes if live.outcome is not None
                 for rank in live.node.ranks}
        if self.run is not None:
            keep(self.run, self.run.hang_stacks(self.attempt), stacks)
        self.hang = hang_verdict(self.judge.stall, stacks, ended)
        self.events.append(HealthEvent(self.hang_at, HealthEventKind.HANG, f"hang: {self.hang.text}",
                                       self.hang.odd[0] if len(self.hang.odd) == 1 else None))
        self._write_health()
        kept = f" (stacks in {self.run.hang_stacks(self.attempt)}/)" if self.run else ""
        self.output.say(f"hang: {self.hang.text}{kept}")
        self.stopper.stop_all()

    def _write_health(self) -> None:
        """health.json for status and top; a line of timeline.jsonl as soon as a rank's first view or step is
        known, then every second while the attempt is young and every TIMELINE_SECONDS after (sample_interval);
        past SUMMED_PAST ranks, every rank in each line while the attempt is young (a short run's course, drawn
        whole), then every TABLE_SECONDS, and the ranks health.json lists in the lines between."""
        if self.run is None:
            return
        now = time.time()
        views = self.judge.views() if self.judge is not None else {}
        slow = self.judge.slow_ranks() if self.judge is not None else {}
        ranks = {rank: rank_row(live, views.get(rank), live.activity.get(rank), now)
                 for live in self.nodes for rank in live.node.ranks}
        stepped = self.progress is not None
        self.track_progress([row.step_rate for row in ranks.values() if row.step_rate is not None])
        if not stepped and self.progress is not None and self.on_first_step is not None:
            self.on_first_step(self.progress)
        if self.progress is not None:
            self.paces.add(self.progress.last_at, self.progress.last_step)
            if self.progress.saving_s > self._saved_s:
                self._saved_s, self.saved_step = self.progress.saving_s, self.progress.last_step
        listed = self._write_rows(LiveHealth(
            attempt=self.attempt, t=now, slow={rank: round(waited, 1) for rank, waited in slow.items()},
            hang=f"hang: {self.hang.text}" if self.hang else None, ranks=dict(sorted(ranks.items())),
            started_at=self.attempt_started_at, progress=self.progress, slowed=self._slowed(now)))
        age = now - min((live.started for live in self.nodes), default=now)
        if now - self._sampled >= sample_interval(TIMELINE_SECONDS, age) and \
                (views or any(r.step is not None for r in ranks.values())):
            self._sampled = now
            every = listed is None or age < YOUNG_SECONDS or self._timeline_every_at is None or \
                now - self._timeline_every_at >= TABLE_SECONDS
            if every:
                self._timeline_every_at = now
            points = {rank: RankPoint(views[rank].cpu if rank in views else None,
                                      views[rank].busy if rank in views else None, row.step, row.gpu_util, row.loss,
                                      row.throughput)
                      for rank, row in ranks.items()
                      if (every or rank in (listed or ())) and (rank in views or row.step is not None)}
            if every or points:
                self.run.append_timeline(Sample(now, self.attempt, points, every))

    def _write_rows(self, health: LiveHealth) -> set[int] | None:
        """health.json with every rank's row, up to SUMMED_PAST ranks; past them, each node summed up and the odd
        ranks (record/health_summary.py), every rank's row in health-ranks.json every TABLE_SECONDS and once a hang's
        verdict is made: what is written twice a second grows with the nodes, not with their ranks. The ranks whose
        rows health.json lists (None: every rank)."""
        assert self.run is not None and health.t is not None
        if len(health.ranks) <= SUMMED_PAST:
            self.run.write_health(health)
            return None
        hang_untold = self.hang is not None and (self._table_at or 0.0) < (self.hang_at or 0.0)
        if self._table_at is None or health.t - self._table_at >= TABLE_SECONDS or hang_untold:
            self._table_at = health.t
            self.run.write_health_table(replace(health, table_at=health.t))
        spans = [NodeSpan(live.node.node_rank, live.node.host, live.node.ranks) for live in self.nodes]
        written = summed(health, spans, self.hang.odd if self.hang else [], self._table_at)
        self.run.write_health(written)
        return set(written.ranks)

    def _slowed(self, now: float) -> Slowed | None:
        """The slowness of the rank named slow first, as the job's pace shows it now."""
        if not self.slow_episodes:
            return None
        rank, since = min(self.slow_episodes.items(), key=lambda episode: episode[1])
        slowed = slowdown(self.paces, since, now, self.attempt_started_at)
        return Slowed(rank, round(since, 3), *_paces(slowed)[1:])

    def track_progress(self, rates: list[float]) -> Progress | None:
        """The attempt's progress from every rank's steps (rates: their step rates now; none: as before): the
        furthest step any rank reported (in a data-parallel job, often only rank 0 prints), and when it first
        went past the earlier attempts' furthest step; and where a rank said it resumed (the first to say)."""
        # Each as a list first, at once: the nodes' readers add ranks and steps meanwhile.
        marks = [mark for live in self.nodes for activity in list(live.activity.values())
                 for mark in list(activity.steps)]
        if not marks:
            return self.progress
        first = min(marks, key=lambda mark: (mark.at, mark.step))  # a block's first step, where it has several
        if self.progress is not None:
            first = first._replace(step=self.progress.first_step, at=self.progress.first_at)
        last = max(marks, key=lambda mark: (mark.step, -mark.at))  # the furthest step, when it first came
        new_at = self.progress.new_at if self.progress else None
        if new_at is None:
            past = [mark.at for mark in marks if self.furthest is None or mark.step > self.furthest]
            new_at = min(past) if past else None
        activities = [activity for live in self.nodes for activity in list(live.activity.values())]
        totals = [activity.total for activity in activities if activity.total is not None]
        rate = max(rates) if rates else self.progress.rate if self.progress else None
        resumes = [(activity.resumed, activity.restore_s) for activity in activities if activity.resumed is not None]
        resumed, restore_s = min(resumes, key=lambda said: said[0].at) if resumes else (None, None)
        self.progress = Progress(first.step, first.at, last.step, last.at, new_at, max(totals) if totals else None,
                                 rate, round(max(activity.saving_s for activity in activities), 3),
                                 resumed.step if resumed else None, resumed.at if resumed else None, restore_s)
        return self.progress


def _paces(slowed: Slowdown | None) -> tuple[float | None, float | None, float | None]:
    """A slowdown's start and paces as records keep them."""
    if slowed is None:
        return None, None, None
    return (round(slowed.since, 3), None if slowed.before is None else round(slowed.before, 4),
            None if slowed.now is None else round(slowed.now, 4))


def rank_row(live: LiveNode, view: RankView | None, activity: RankActivity | None, now: float) -> RankRow:
    """One rank's row of health.json: its node, state, CPU use, last line and step."""
    if live.outcome is not None:
        state = f"ended ({live.outcome.describe()})"
    else:
        state = view.state if view is not None else "running" if live.ranks_started else "starting"
    step = rate = step_at = None
    steps = list(activity.steps) if activity is not None else []  # at once: the node's reader adds to it meanwhile
    if steps:
        step, step_at = steps[-1].step, steps[-1].at
        recent = [mark for mark in steps if mark.at >= now - RATE_WINDOW]
        if len(recent) >= 2 and recent[-1].at > recent[0].at:
            between = (recent[-1].at - recent[0].at) / (len(recent) - 1)
            still = now - recent[-1].at > max(STEP_QUIET_SECONDS, 3 * between)  # no new step for a while: not moving
            rate = 0.0 if still else round((recent[-1].step - recent[0].step) / (recent[-1].at - recent[0].at), 3)
    return RankRow(node=live.node.label, host=live.node.host, state=state,
                   cpu=None if view is None else round(view.cpu, 3), busy=None if view is None else round(view.busy, 3),
                   last_line=None if activity is None else activity.line[:LINE_KEPT],
                   last_line_at=None if activity is None else round(activity.at, 3), step=step, step_rate=rate,
                   gpu_util=None if view is None else view.gpu_util,
                   gpu_memory=None if view is None else view.gpu_memory,
                   idle=None if view is None else round(view.idle, 1), step_at=step_at and round(step_at, 3),
                   loss=None if activity is None else activity.loss,
                   throughput=None if activity is None else activity.throughput)
