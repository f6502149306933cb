"""What a slow rank costs the job, and whether a restart without its host costs less. Pure: the job's steps over
time in, paces and sums out (control/health_loop.py says them and acts; docs/health.md, "A slow node").

Under data parallelism every rank waits for the slowest, so the job's own step rate is the measure: its pace in
the minute before the slowness began against its pace since. The slowness costs, by the job's end, the steps
left at the slowed pace less the same steps at the pace a restart gets back (the healthy pace on a spare; a
share of it on fewer nodes); a restart costs the run's recovery (its own measured figure) plus the steps it
redoes at that pace. The harness acts only when the job runs measurably slower (below SLOWED_BELOW of its pace:
noise and a rank's own periodic work, an evaluation, a checkpoint, are in both paces alike) and the restart
costs less.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

BEFORE_SECONDS = 60.0  # how long before the slowness its healthy pace is measured over
MIN_SPAN = 5.0  # a pace needs steps at least this far apart, and three step lines
SLOWED_BELOW = 0.8  # the job must run below this share of its pace before for the slowness to be acted on
POINTS_KEPT = 4096


class Course(NamedTuple):
    """The attempt's steps as its progress lines say them: the run's total (None: not said), the furthest step, the
    attempt's first step and when it came."""

    total: int | None
    last_step: int
    first_step: int
    first_at: float


class StepPoint(NamedTuple):
    at: float
    step: int


@dataclass
class PaceHistory:
    """The job's furthest step over time (one point each time it moves), for its pace between two times."""

    points: deque[StepPoint]

    def __init__(self) -> None:
        self.points = deque(maxlen=POINTS_KEPT)

    def add(self, at: float, step: int) -> None:
        if not self.points or step > self.points[-1].step:
            self.points.append(StepPoint(at, step))

    def pace(self, since: float, until: float) -> float | None:
        """Steps per second between since and until, from the step lines in between (None: too few)."""
        inside = [p for p in self.points if since <= p.at <= until]
        if len(inside) < 3 or inside[-1].at - inside[0].at < MIN_SPAN:
            return None
        return (inside[-1].step - inside[0].step) / (inside[-1].at - inside[0].at)


@dataclass(frozen=True)
class Slowdown:
    """The job's pace before a rank's slowness began (since) and since: steps per second (None: not known)."""

    since: float
    before: float | None
    now: float | None

    @property
    def ratio(self) -> float | None:
        return self.now / self.before if self.before and self.now is not None else None

    def words(self) -> str:
        """`the job runs at 0.55x its pace before 12:03:10 (1.8 -> 1.0 steps/s)`."""
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        if self.ratio is None:
            return f"its pace before {when} is not known yet (too few step lines)"
        assert self.before is not None and self.now is not None
        return f"the job runs at {self.ratio:.2f}x its pace before {when} ({self.before:.3g} -> {self.now:.3g} steps/s)"


def slowdown(history: PaceHistory, since: float, now: float, started: float) -> Slowdown:
    """The pace in the BEFORE_SECONDS before since (from the attempt's start at the earliest) and since then."""
    return Slowdown(since, history.pace(max(started, since - BEFORE_SECONDS), since), history.pace(since, now))


@dataclass(frozen=True)
class Weighing:
    """What the slowness costs by the job's end against what a restart without the slow host costs, in seconds;
    act: the restart is worth it. words: the sum, as said."""

    cost_s: float
    restart_s: float
    act: bool
    words: str


def weigh(slowed: Slowdown, left_steps: int, recovery_s: float, redo_steps: int, share: float = 1.0) -> Weighing | None:
    """left_steps: steps to the job's end; recovery_s: the run's measured recovery; redo_steps: steps the restart
    redoes; share: the pace a restart gets back, as a share of the healthy one (fewer nodes: less). None: the
    paces are not known."""
    if slowed.before is None or slowed.now is None or slowed.before <= 0:
        return None
    after = slowed.before * share
    cost = left_steps / max(slowed.now, 1e-9) - left_steps / after
    restart = recovery_s + redo_steps / after
    measurable = slowed.now < SLOWED_BELOW * after
    act = measurable and restart < cost
    verdict = ("a restart without it costs less" if act else
               f"the job runs at {slowed.now / after:.2f}x the pace a restart gets back, not below {SLOWED_BELOW}x"
               if not measurable else "a restart costs more")
    words = (f"the slowness costs {cost:.0f} s by the job's end ({left_steps} steps left at {slowed.now:.3g} instead "
             f"of {after:.3g} steps/s); a restart without it {restart:.0f} s (recovery {recovery_s:.1f} s + "
             f"{redo_steps} steps redone): {verdict}")
    return Weighing(max(cost, 0.0), restart, act, words)


@dataclass(frozen=True)
class SlowPolicy:
    """What the controller knows of a restart without a slow host, for the health loop to weigh one: slow_for,
    the seconds a slowness lasts before it is weighed; acts: restarts.on names slow; no_restart: why no restart is
    left (None: one is); without: for a host, the share of the job's pace an attempt without it gets back (1: a
    spare takes its place; less: fewer nodes), or why there is no such attempt; recovery_s: the run's measured
    recovery (None: the attempt's own start to its first step stands for it)."""

    slow_for: float
    acts: bool
    no_restart: str | None
    without: Callable[[str], float | str]
    recovery_s: float | None = None


def decide(policy: SlowPolicy, slowed: Slowdown, progress: Course | None, saved_step: int | None, started_at: float,
           host: str) -> tuple[bool, str]:
    """Whether to restart without host, and the sum said either way: the cost by the job's end (its steps left,
    from its progress lines' total) against a restart (the run's recovery, else the attempt's own start to its first
    step; the steps since the job last said a checkpoint was saved, else since the attempt's first)."""
    share = policy.without(host)
    why_not, weighing = None, None
    if progress is None or progress.total is None:
        why_not = "the job's end is not known (its step lines give no total), so neither is what the slowness costs"
    else:
        recovery = policy.recovery_s if policy.recovery_s is not None else max(0.0, progress.first_at - started_at)
        redo = progress.last_step - (saved_step if saved_step is not None else progress.first_step)
        weighing = weigh(slowed, max(0, progress.total - progress.last_step), recovery, max(0, redo),
                         share if isinstance(share, float) else 1.0)
        if weighing is None:
            why_not = "the job's pace before and since is not known (too few step lines)"
    if why_not is None and weighing is not None and weighing.act:
        why_not = "restarts.on does not name slow" if not policy.acts else \
            f"no restart is left ({policy.no_restart})" if policy.no_restart is not None else \
            share if isinstance(share, str) else None
    act = why_not is None and weighing is not None and weighing.act
    then = (f"stopping the job to restart without {host} (restarts.on: slow)" if act else
            f"the job goes on: {why_not}" if why_not else "the job goes on")
    return act, f"{weighing.words if weighing else slowed.words()}; {then}"
