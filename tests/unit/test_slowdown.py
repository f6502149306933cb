"""A slow node's policy where it must do nothing (issue 68, "never wrong"), and the sum it says either way: the
paces and sums of harness/health/slowdown.py, and the health loop's weighing (control/health_loop.py) on a real judge
fed a rank's samples second by second. The launches that act, and one whose job does not put slow in restarts.on:
tests/integration/test_recovery.py (a spare on SSH hosts, fewer simulated nodes) and test_health.py."""

from __future__ import annotations

import io
from collections.abc import Callable

from test_health_rules import NODES

from harness.control.health_loop import HealthLoop
from harness.control.live import LiveNode
from harness.control.output import Output
from harness.control.stack_capture import StackCapture
from harness.control.stopper import Stopper
from harness.control.terminal import Terminal
from harness.health.judge import HealthJudge
from harness.health.slowdown import Course, PaceHistory, Slowdown, SlowPolicy, decide, slowdown
from harness.node.protocol import RankSample
from harness.record.schema import HealthEventKind, Progress

TOTAL = 1000  # the job's steps, as its progress lines say them
SPARE = SlowPolicy(slow_for=60, acts=True, no_restart=None, without=lambda host: 1.0, recovery_s=10.0)


def paced(history: PaceHistory, start: float, until: float, rate: float, step: int = 0, work_every: int = 0,
          work_s: float = 0.0) -> int:
    """Step lines at rate from start to until (with a pause of work_s after every work_every steps: a rank's own
    periodic work, an evaluation or a checkpoint write), added to history; the last step."""
    at = start
    while at <= until:
        step += 1
        history.add(at, step)
        at += 1 / rate
        if work_every and step % work_every == 0:
            at += work_s
    return step


def slowed_4_to_1() -> tuple[Slowdown, Course]:
    """60 s at 4 steps a second, then 30 s at 1: the slowness began at 60, weighed at 90."""
    history = PaceHistory()
    last = paced(history, 60, 90, 1.0, paced(history, 0, 59.9, 4.0))
    return slowdown(history, 60, 90, 0), Course(TOTAL, last, 1, 0.0)


def test_a_slowness_that_costs_more_than_a_restart_is_acted_on_and_its_sum_said():
    slowed, course = slowed_4_to_1()
    assert (slowed.before, slowed.now, course.last_step) == (4.0, 1.0, 271)
    act, words = decide(SPARE, slowed, course, 271, 0.0, "h2")
    assert act
    assert words == ("the slowness costs 547 s by the job's end (729 steps left at 1 instead of 4 steps/s); a restart "
                     "without it 10 s (recovery 10.0 s + 0 steps redone): a restart without it costs less; stopping "
                     "the job to restart without h2 (restarts.on: slow)")


def test_on_fewer_nodes_the_restart_gets_back_their_share_of_the_pace():
    slowed, course = slowed_4_to_1()
    act, words = decide(SlowPolicy(60, True, None, lambda host: 2 / 3, 10.0), slowed, course, 271, 0.0, "h2")
    assert act and "(729 steps left at 1 instead of 2.67 steps/s)" in words, words


def test_without_a_spare_or_fewer_nodes_allowed_the_job_goes_on_and_the_line_says_why():
    slowed, course = slowed_4_to_1()
    why = "no spare host is left and restarts.min_nnodes (2) does not allow fewer than 2 nodes"
    act, words = decide(SlowPolicy(60, True, None, lambda host: why, 10.0), slowed, course, 271, 0.0, "h2")
    assert not act and words.endswith(f": a restart without it costs less; the job goes on: {why}"), words


def test_with_no_restart_left_the_job_goes_on_and_the_line_says_why():
    slowed, course = slowed_4_to_1()
    act, words = decide(SlowPolicy(60, True, "restarts.max: 2", lambda host: 1.0, 10.0), slowed, course, 271, 0.0,
                        "h2")
    assert not act and words.endswith("; the job goes on: no restart is left (restarts.max: 2)"), words


def test_slow_not_in_restarts_on_is_weighed_said_and_left():
    slowed, course = slowed_4_to_1()
    act, words = decide(SlowPolicy(60, False, None, lambda host: 1.0, 10.0), slowed, course, 271, 0.0, "h2")
    assert not act and words.endswith("; the job goes on: restarts.on does not name slow"), words


def test_a_restart_that_costs_more_than_the_steps_left_is_not_made():
    slowed, _ = slowed_4_to_1()
    act, words = decide(SPARE, slowed, Course(275, 271, 1, 0.0), 271, 0.0, "h2")
    assert not act and words.endswith("a restart without it 10 s (recovery 10.0 s + 0 steps redone): a restart costs "
                                      "more; the job goes on"), words


def test_the_steps_since_the_last_checkpoint_are_a_restart_s_cost_and_without_a_total_nothing_is_weighed():
    slowed, course = slowed_4_to_1()
    _, words = decide(SPARE, slowed, course, 251, 0.0, "h2")
    assert "a restart without it 15 s (recovery 10.0 s + 20 steps redone)" in words, words
    act, words = decide(SPARE, slowed, course._replace(total=None), 271, 0.0, "h2")
    assert not act and words.endswith("(4 -> 1 steps/s); the job goes on: the job's end is not known (its step lines "
                                      "give no total), so neither is what the slowness costs"), words


def test_a_rank_s_own_periodic_work_leaves_the_pace_as_it_was_and_is_not_acted_on():
    """Rank 0 evaluates for 3 s every 50 steps (or writes a checkpoint): its peers wait for it then, and the judge
    may name it, but the job's pace is the same before and since, so restarting without its host gains nothing."""
    history = PaceHistory()
    last = paced(history, 0, 180, 10.0, work_every=50, work_s=3.0)
    slowed = slowdown(history, 100, 160, 0)
    assert slowed.ratio is not None and 0.9 < slowed.ratio < 1.1, slowed
    act, words = decide(SPARE, slowed, Course(TOTAL, last, 1, 0.0), last, 0.0, "h1")
    assert not act and words.endswith("not below 0.8x; the job goes on"), words


class Watched:
    """The health loop of a 3-node attempt (a rank each) with a real judge, fed each rank's samples a second at a
    time (busy: the share of each second its main thread ran or waited for a CPU) and the job's step lines, its
    slowness weighed against a restart without the slow host (without: on a spare, unless said otherwise)."""

    def __init__(self, slow_for: float = 60, without: Callable[[str], float | str] = lambda host: 1.0) -> None:
        self.screen = io.StringIO()
        self.terminal = Terminal(self.screen)
        self.stopper = Stopper(0.0, [])
        self.judge = HealthJudge(stall=0, slow=20)
        self.loop = HealthLoop(self.judge, None, 0, [LiveNode(node, 0.0) for node in NODES[:3]], StackCapture([]),
                               Output(self.terminal), self.stopper,
                               slow_policy=SlowPolicy(slow_for, True, None, without, 10.0))
        self.loop.attempt_started_at = 0.0
        self.busy = {rank: 0.0 for rank in range(3)}
        self.step, self.t = 0, 0

    @property
    def said(self) -> list[str]:
        """What the health loop said on the terminal, without the harness's prefix, once its writer thread wrote it
        all (the run is over when it is read)."""
        self.terminal.close()
        return [line.removeprefix("harness: ") for line in self.screen.getvalue().splitlines()]

    def run(self, seconds: int, busy: dict[int, float], rate: float) -> None:
        for _ in range(seconds):
            self.t += 1
            for rank, share in busy.items():
                self.busy[rank] += share
                self.judge.observe(NODES[rank], self.t, {rank: RankSample(100 + rank, "S", self.busy[rank],
                                                                          self.busy[rank], 0)})
            self.step = paced(self.loop.paces, self.t, self.t + 0.999, rate, self.step)
            self.loop.progress = Progress(1, 0.0, self.step, float(self.t), total=TOTAL)
            self.loop._watch_slowness(float(self.t))

    def kinds(self) -> list[HealthEventKind]:
        return [event.kind for event in self.loop.events]


HEALTHY = {0: 0.5, 1: 0.5, 2: 0.5}
SLOW_1 = {0: 0.5, 1: 1.0, 2: 0.5}  # its peers wait for rank 1 half the time


def test_a_slowness_that_lasts_slow_for_is_weighed_once_and_acted_on():
    """The control of the two below: rank 1 slow from 30 s on and staying so is named, then weighed once, slow_for
    after the slowness began, and the job stopped to restart without h2."""
    watched = Watched()
    watched.run(30, HEALTHY, 4.0)
    watched.run(80, SLOW_1, 1.0)
    assert watched.kinds() == [HealthEventKind.SLOW, HealthEventKind.WEIGHED], watched.said
    weighed = watched.loop.events[1]
    assert weighed.at - weighed.since == 60 and weighed.acted and watched.stopper.since is not None, weighed
    assert watched.said[1].startswith("slow: rank 1 (node1 on h2) for 60 s: the slowness costs "), watched.said


def test_a_slowness_with_nowhere_to_restart_is_weighed_once_and_the_job_goes_on_to_its_end():
    """No spare and no fewer nodes allowed: said once, however long the slowness lasts; never a restart loop."""
    why = "no spare host is left and restarts.min_nnodes (3) does not allow fewer than 3 nodes"
    watched = Watched(without=lambda host: why)
    watched.run(30, HEALTHY, 4.0)
    watched.run(300, SLOW_1, 1.0)
    assert watched.kinds() == [HealthEventKind.SLOW, HealthEventKind.WEIGHED], watched.said
    assert watched.said[1].endswith(f"; the job goes on: {why}") and not watched.loop.events[1].acted, watched.said
    assert watched.stopper.since is None


def test_a_node_that_recovers_before_slow_for_is_not_weighed():
    watched = Watched()
    watched.run(30, HEALTHY, 4.0)
    watched.run(30, SLOW_1, 1.0)  # named ~28 s after the slowness began, well again 30 s after it
    watched.run(80, HEALTHY, 4.0)
    assert watched.kinds() == [HealthEventKind.SLOW, HealthEventKind.RECOVERED], watched.said
    assert watched.stopper.since is None


def test_every_rank_slow_alike_names_none_and_nothing_is_weighed():
    """Every rank's CPU throttled alike (or every rank waiting on one shared file system): each is busy all the time,
    the job's pace falls, and no rank is the one its peers wait for."""
    watched = Watched(slow_for=10)
    watched.run(30, HEALTHY, 4.0)
    watched.run(120, {0: 1.0, 1: 1.0, 2: 1.0}, 1.0)
    assert watched.said == [] and watched.loop.events == [] and watched.stopper.since is None
