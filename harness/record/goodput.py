"""Where a run's time went, second by second, from its record alone: each second from the launch to the end
is in one bucket, so the buckets add up to the wall time, and the goodput is the share spent in training
steps that were not done again:

- start-up: from the launch to the first attempt's first step (planning, checks, start, rendezvous, loading);
- training: from an attempt's first new step to its last step (and on to its fault: steps not yet reported);
- unwatched: training while no controller watched (from the nodes' agents' loss of it to `harness attach`),
  taken out of training: training all the same, counted in the goodput;
- checkpoint: the seconds the job's lines say its checkpoint saves took (health.checkpoint), taken out of the
  bucket they fell in (training, most likely);
- slowed: what a slow rank cost while it was named slow, taken out of training: its seconds times the share of the
  job's pace it lost (1 - pace since / pace before, health/slowdown.py);
- redone: after a restart, the steps until the run is past the furthest step an earlier attempt reached;
- hung: from the last progress (or the attempt's start, without any) to the hang's verdict;
- restarting: from a fault (or the verdict) to the next attempt's first step: teardown, backoff, checks, start-up;
- ending: from the last attempt's last step (or its fault) to the run's end: the last save, teardown, summary.

A step is known from the job's progress lines (health.progress): a job that prints none has no training and
a goodput of 0, which is what the record can prove.

A restart's own phases (restart_of), from the fault to the next attempt's first step (the seconds `restarting`
counts), are kept in that attempt's record: the run's one recovery figure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from harness.record.rundir import RunDir
from harness.record.schema import (
    GOODPUT_BUCKETS,
    Attempt,
    Goodput,
    HealthEvent,
    HealthEventKind,
    LiveHealth,
    Progress,
    Restart,
    RunState,
    RunSummary,
)


@dataclass(frozen=True)
class AttemptTimes:
    """What the buckets need of an attempt: its start and end, its steps, its hang's verdict and its fault."""

    started_at: float
    ended_at: float
    progress: Progress | None
    hang_at: float | None = None
    fault_at: float | None = None
    unwatched_s: float = 0.0  # seconds it ran without a controller
    slowed_s: float = 0.0  # what its slow ranks cost: seconds times the share of the pace lost

    @classmethod
    def of(cls, attempt: Attempt) -> AttemptTimes:
        hang = next((event.at for event in attempt.health if event.kind is HealthEventKind.HANG), None)
        fault = attempt.started_at + attempt.failures[0].after_s if attempt.failures else None
        unwatched = sum(max(0.0, u.attached_at - u.lost_at) for u in attempt.unwatched if u.lost_at is not None)
        return cls(attempt.started_at, attempt.ended_at, attempt.progress, hang, fault, unwatched,
                   slowed_seconds(attempt.health, fault or attempt.ended_at))

    @classmethod
    def running(cls, health: LiveHealth, now: float) -> AttemptTimes | None:
        """The running attempt, as health.json says it (None: a file without the attempt's start)."""
        return None if health.started_at is None else cls(health.started_at, now, health.progress,
                                                          slowed_s=slowed_seconds(live_slowness(health), now))


def live_slowness(health: LiveHealth) -> list[HealthEvent]:
    """The running attempt's slowness as health.json says it, as the health event its record keeps of it."""
    slowed = health.slowed
    return [] if slowed is None else [HealthEvent(slowed.since, HealthEventKind.SLOW, "", slowed.rank, None,
                                                  slowed.since, slowed.pace_before, slowed.pace_now)]


class SlowSpan(NamedTuple):
    """A rank's slowness: from its onset to its recovery, the harness's stop for it (acted), or the attempt's end;
    lost: the share of the job's pace it cost, by the latest figures said of it (None: not known)."""

    rank: int
    since: float
    until: float
    lost: float | None
    acted: bool = False


def slow_spans(events: Sequence[HealthEvent], end: float) -> list[SlowSpan]:
    """Each slowness of an attempt, from its health events, by its onset (those without one, older records', left
    out): for the goodput's slowed bucket and the report's step rate."""
    episodes: dict[int, HealthEvent] = {}
    spans: list[SlowSpan] = []

    def close(rank: int, at: float, acted: bool = False) -> None:
        said = episodes.pop(rank)
        assert said.since is not None
        before, now = said.pace_before, said.pace_now
        spans.append(SlowSpan(rank, said.since, at, max(0.0, 1 - now / before) if before and now is not None else None,
                              acted))

    for event in sorted(events, key=lambda e: e.at):
        if event.rank is None:
            continue
        if event.kind is HealthEventKind.SLOW and event.since is not None:
            episodes[event.rank] = event
        elif event.kind is HealthEventKind.WEIGHED and event.rank in episodes:
            if event.pace_now is not None:
                episodes[event.rank] = replace(episodes[event.rank], pace_before=event.pace_before,
                                               pace_now=event.pace_now)
            if event.acted:
                close(event.rank, event.at, acted=True)
        elif event.kind is HealthEventKind.RECOVERED and event.rank in episodes:
            close(event.rank, event.at)
    for rank in list(episodes):
        close(rank, end)
    return sorted(spans, key=lambda span: (span.since, span.until))


def slowed_seconds(events: Sequence[HealthEvent], end: float) -> float:
    """What the attempt's slow ranks cost: each slowness (slow_spans) times the share of the pace it lost;
    overlapping ones counted once."""
    total, covered = 0.0, float("-inf")
    for span in slow_spans(events, end):
        begin = max(span.since, covered)
        if span.lost is not None and span.until > begin:
            total += (span.until - begin) * span.lost
            covered = span.until
    return total


def time_spent(started_at: float, ended_at: float, attempts: Sequence[AttemptTimes], running: bool = False) -> Goodput:
    """The buckets of a run from started_at to ended_at (now, for a running run: its last attempt goes on)."""
    cuts: list[tuple[float, str]] = [(started_at, "start-up")]  # each bucket holds from its time to the next cut
    furthest: int | None = None
    for index, attempt in enumerate(attempts):
        last = index == len(attempts) - 1
        cuts.append((attempt.started_at, "start-up" if index == 0 else "restarting"))
        progress = attempt.progress
        if progress is not None:
            redone = furthest is not None and progress.new_at != progress.first_at
            cuts.append((progress.first_at, "redone" if redone else "training"))
            if redone and progress.new_at is not None:
                cuts.append((progress.new_at, "training"))
            furthest = max(progress.last_step, furthest if furthest is not None else progress.last_step)
        moved = progress.last_at if progress is not None else attempt.started_at
        after = "ending" if last else "restarting"
        if attempt.hang_at is not None:
            cuts += [(moved, "hung"), (attempt.hang_at, after)]
        elif progress is None:  # no step: starting (or restarting) went on to the fault, or the end
            cuts.append((attempt.fault_at or attempt.ended_at, after))
        elif not (last and running):
            cuts.append((max(moved, attempt.fault_at or moved), after))
    seconds = _summed(cuts, started_at, ended_at)
    unwatched = min(sum(attempt.unwatched_s for attempt in attempts), seconds["training"])
    seconds["training"] -= unwatched
    seconds["unwatched"] += unwatched
    slowed = min(sum(attempt.slowed_s for attempt in attempts), seconds["training"])
    seconds["training"] -= slowed
    seconds["slowed"] += slowed
    saving = sum(attempt.progress.saving_s for attempt in attempts if attempt.progress is not None)
    for bucket in ("training", "redone", "ending", "restarting"):  # where the saves happened, most likely first
        moved = min(saving, seconds[bucket])
        seconds[bucket] -= moved
        seconds["checkpoint"] += moved
        saving -= moved
    wall = ended_at - started_at
    return Goodput(round(wall, 3), {bucket: round(value, 3) for bucket, value in seconds.items()},
                   round((seconds["training"] + seconds["unwatched"]) / wall, 4) if wall > 0 else 0.0)


def _summed(cuts: list[tuple[float, str]], started_at: float, ended_at: float) -> dict[str, float]:
    """The seconds of each bucket; a cut out of order (clocks, or a bucket that did not happen) is moved up to
    the one before it, so that every second is counted once."""
    seconds = dict.fromkeys(GOODPUT_BUCKETS, 0.0)
    at = started_at
    for (cut, bucket), (end, _) in zip(cuts, [*cuts[1:], (ended_at, "")], strict=True):
        begin = min(max(cut, at), ended_at)
        at = min(max(end, begin), ended_at)
        seconds[bucket] += at - begin
    return seconds


def run_goodput(started_at: float, ended_at: float, attempts: Sequence[Attempt], live: LiveHealth | None = None,
                now: float | None = None) -> Goodput:
    """A run's buckets from its record: its ended attempts, and the running one's health.json when it runs."""
    times = [AttemptTimes.of(attempt) for attempt in attempts]
    current = AttemptTimes.running(live, now) if live is not None and now is not None else None
    if current is not None and live is not None and all(attempt.attempt != live.attempt for attempt in attempts):
        times.append(current)
        return time_spent(started_at, ended_at, times, running=True)
    return time_spent(started_at, ended_at, times)


def goodput_of(run: RunDir, state: RunState, summary: RunSummary | None, now: float,
               health: LiveHealth | None = None) -> Goodput:
    """A run's buckets as its record says them now, for every view: the summary's once it has ended, else its
    ended attempts (attempts.json) and the running one (health: its health.json, read here when not given)."""
    if summary is not None:
        return summary.goodput or run_goodput(summary.started_at, summary.ended_at, summary.attempts)
    live = health if health is not None else run.read_health(state.attempt)
    return run_goodput(state.started_at, state.ended_at or now, run.read_attempts(), live, now)


def ending_parts(summary: RunSummary) -> tuple[float, float] | None:
    """The run's `ending` split where the record can: the seconds its last attempt's nodes ran after their last
    step line (the job's last save, evaluation and exit; or, after a failure, their stop), and the seconds after
    the last node ended (the harness's sweep and record). None: no attempt, or no step line."""
    last = summary.attempts[-1] if summary.attempts else None
    if last is None or last.progress is None:
        return None
    times = AttemptTimes.of(last)
    began = max(last.progress.last_at, times.hang_at or times.fault_at or last.progress.last_at)
    return round(max(0.0, last.ended_at - began), 3), round(max(0.0, summary.ended_at - last.ended_at), 3)


def restart_of(failed: Attempt, started_at: float, joined: Sequence[float], progress: Progress | None,
               furthest: int | None) -> Restart:
    """How the attempt that started at started_at came to its first step after failed, from failed's fault (the
    failure noticed, or the hang's verdict): stop (to its last node's end), backoff, preflight (the plan and checks,
    to this attempt's start), start-up (to the first rank joining the process group: processes, imports),
    rendezvous (to the last rank joining), loading (to the resume line, less the restore it says), restore (the
    seconds the resume line says the restore took), first step (to the first step line). joined: when each rank
    joined; furthest: the furthest step of the attempts before."""
    times = AttemptTimes.of(failed)
    fault = times.hang_at or times.fault_at or failed.ended_at
    backoff_end = failed.ended_at + (failed.backoff_s or 0.0)
    resumed = progress.resumed_at if progress is not None else None
    restore = progress.restore_s if progress is not None and resumed is not None else None
    ends = [("stop", failed.ended_at), ("backoff", backoff_end), ("preflight", started_at),
            ("start-up", min(joined) if joined else None), ("rendezvous", max(joined) if joined else None),
            ("loading", resumed - (restore or 0.0) if resumed is not None else None),
            ("restore", resumed if restore is not None else None),
            ("first step", progress.first_at if progress is not None else None)]
    at = fault
    phases: dict[str, float] = {}
    for phase, end in ends:
        if end is not None:
            phases[phase] = round(max(0.0, end - at), 3)
            at = max(at, end)
    redone = redone_s = None
    if progress is not None and furthest is not None:
        redone = max(0, furthest - (progress.resumed_step if progress.resumed_step is not None else
                                    progress.first_step))
        redone_s = round(progress.new_at - progress.first_at, 3) if redone and progress.new_at is not None else None
    return Restart(phases, round(at - fault, 3), redone, redone_s, stepped=progress is not None)
