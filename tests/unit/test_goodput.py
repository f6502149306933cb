"""Where a run's time went: every second from the launch to the end in one bucket, and each restart phase by
phase, from the record alone (record/goodput.py), and the progress and time left that status shows
(view/status.py)."""

from __future__ import annotations

import pytest

from harness.record.goodput import AttemptTimes, restart_of, run_goodput, slowed_seconds, time_spent
from harness.record.schema import (
    GOODPUT_BUCKETS,
    RESTART_PHASES,
    Attempt,
    Failure,
    FailureKind,
    HealthEvent,
    HealthEventKind,
    LiveHealth,
    Progress,
    RunStatus,
    Slowed,
)
from harness.view.status import goodput_words, progress_words

T0 = 1_000_000.0


def _assert_adds_up(seconds: dict[str, float], wall: float) -> None:
    assert list(seconds) == list(GOODPUT_BUCKETS)
    assert sum(seconds.values()) == pytest.approx(wall, abs=0.01), seconds


def test_a_run_with_a_hang_and_a_restart_puts_every_second_in_one_bucket() -> None:
    """Launch at 0; attempt 0 starts at 5, first step at 12, last step 40 at 30, the hang's verdict at 45, its
    end at 48; attempt 1 starts at 52 (backoff, checks), resumes at step 32 at 60, passes step 40 at 64, its last
    step at 90, the run ends at 95."""
    first = AttemptTimes(T0 + 5, T0 + 48, Progress(4, T0 + 12, 40, T0 + 30, T0 + 12), hang_at=T0 + 45,
                         fault_at=T0 + 45)
    second = AttemptTimes(T0 + 52, T0 + 94, Progress(32, T0 + 60, 80, T0 + 90, T0 + 64))
    goodput = time_spent(T0, T0 + 95, [first, second])
    assert goodput.seconds == {"start-up": 12.0, "training": 18.0 + 26.0, "unwatched": 0.0, "checkpoint": 0.0, "slowed": 0.0, "redone": 4.0, "hung": 15.0,
                               "restarting": 3.0 + 4.0 + 8.0, "ending": 5.0}
    _assert_adds_up(goodput.seconds, 95.0)
    assert goodput.wall_s == 95.0 and goodput.goodput == round(44 / 95, 4)


def test_a_program_failure_trains_to_its_fault_and_restarts_from_there() -> None:
    """The steps after the last progress line are training until the fault; the next attempt that never
    reaches the furthest step again only redid work."""
    first = AttemptTimes(T0 + 1, T0 + 20, Progress(1, T0 + 3, 10, T0 + 10), fault_at=T0 + 15)
    second = AttemptTimes(T0 + 22, T0 + 30, Progress(6, T0 + 25, 9, T0 + 28), fault_at=T0 + 29)
    goodput = time_spent(T0, T0 + 31, [first, second])
    assert goodput.seconds == {"start-up": 3.0, "training": 12.0, "unwatched": 0.0, "checkpoint": 0.0, "slowed": 0.0, "redone": 4.0, "hung": 0.0,
                               "restarting": 5.0 + 2.0 + 3.0, "ending": 2.0}
    _assert_adds_up(goodput.seconds, 31.0)


def test_the_checkpoint_saves_the_lines_say_come_out_of_training() -> None:
    """Two attempts whose lines said 1.5 s and 0.5 s of saves: 2 s of checkpoint, 2 s less training."""
    first = AttemptTimes(T0 + 1, T0 + 20, Progress(1, T0 + 3, 10, T0 + 10, saving_s=1.5), fault_at=T0 + 15)
    second = AttemptTimes(T0 + 22, T0 + 30, Progress(11, T0 + 25, 20, T0 + 28, T0 + 25, saving_s=0.5))
    goodput = time_spent(T0, T0 + 31, [first, second])
    assert goodput.seconds["checkpoint"] == 2.0 and goodput.seconds["training"] == 12.0 + 3.0 - 2.0
    _assert_adds_up(goodput.seconds, 31.0)
    assert goodput.goodput == round(13 / 31, 4)


def test_a_running_run_trains_until_now_and_a_run_without_steps_never_trained() -> None:
    running = AttemptTimes(T0 + 2, T0 + 20, Progress(5, T0 + 6, 50, T0 + 18))
    goodput = time_spent(T0, T0 + 20, [running], running=True)
    assert goodput.seconds["start-up"] == 6.0 and goodput.seconds["training"] == 14.0 and goodput.goodput == 0.7
    silent = time_spent(T0, T0 + 10, [AttemptTimes(T0 + 1, T0 + 9, None)])
    assert silent.seconds["start-up"] == 9.0 and silent.seconds["ending"] == 1.0 and silent.goodput == 0.0
    nothing = time_spent(T0, T0 + 3, [])  # stopped before any attempt started
    assert nothing.seconds["start-up"] == 3.0
    hung_at_start = time_spent(T0, T0 + 30, [AttemptTimes(T0 + 1, T0 + 29, None, hang_at=T0 + 27, fault_at=T0 + 27)])
    assert hung_at_start.seconds == {"start-up": 1.0, "training": 0.0, "unwatched": 0.0, "checkpoint": 0.0, "slowed": 0.0, "redone": 0.0,
                                     "hung": 26.0,
                                     "restarting": 0.0, "ending": 3.0}


def test_what_a_slow_rank_cost_comes_out_of_training_once_however_many_said_it() -> None:
    """Rank 1 slowed the job to half its pace from 20 s to 40 s, when the harness stopped it (its WEIGHED event, with
    the later figure: a quarter); rank 2, slow at the same time, is not counted twice; a slowness that recovered
    counts to its recovery. The running attempt's health.json says the same of a slowness that goes on."""
    events = [HealthEvent(T0 + 25, HealthEventKind.SLOW, "", 1, 30.0, T0 + 20, 2.0, 1.0),
              HealthEvent(T0 + 26, HealthEventKind.SLOW, "", 2, 25.0, T0 + 21, 2.0, 1.0),
              HealthEvent(T0 + 40, HealthEventKind.WEIGHED, "", 1, None, T0 + 20, 2.0, 0.5, acted=True)]
    assert slowed_seconds(events, T0 + 50) == pytest.approx(20 * 0.75 + 10 * 0.5)
    recovered = [events[0], HealthEvent(T0 + 30, HealthEventKind.RECOVERED, "", 1)]
    assert slowed_seconds(recovered, T0 + 50) == pytest.approx(10 * 0.5)
    attempt = AttemptTimes(T0, T0 + 50, Progress(1, T0 + 5, 100, T0 + 49), slowed_s=slowed_seconds(events, T0 + 50))
    goodput = time_spent(T0, T0 + 50, [attempt])
    assert goodput.seconds["slowed"] == pytest.approx(20.0) and goodput.seconds["training"] == pytest.approx(24.0)
    _assert_adds_up(goodput.seconds, 50.0)
    health = LiveHealth(0, T0 + 30, started_at=T0, progress=Progress(1, T0 + 5, 60, T0 + 29),
                        slowed=Slowed(1, T0 + 20, 2.0, 1.0))
    assert run_goodput(T0, T0 + 30, [], health, T0 + 30).seconds["slowed"] == pytest.approx(5.0)


def test_the_time_no_controller_watched_is_training_all_the_same() -> None:
    """An attempt whose controller was lost 20 s into it and taken back 12 s later: 12 s of its training were
    unwatched, and the goodput counts them."""
    taken_back = AttemptTimes(T0 + 1, T0 + 40, Progress(1, T0 + 5, 30, T0 + 38), unwatched_s=12.0)
    goodput = time_spent(T0, T0 + 41, [taken_back])
    assert goodput.seconds["unwatched"] == 12.0 and goodput.seconds["training"] == 33.0 - 12.0
    _assert_adds_up(goodput.seconds, 41.0)
    assert goodput.goodput == round(33 / 41, 4)


def test_a_running_attempt_counts_from_health_json() -> None:
    from harness.record.goodput import run_goodput

    live = LiveHealth(attempt=0, t=T0 + 9, started_at=T0 + 1, progress=Progress(1, T0 + 4, 20, T0 + 9))
    goodput = run_goodput(T0, T0 + 10, [], live, T0 + 10)
    assert goodput.seconds["start-up"] == 4.0 and goodput.seconds["training"] == 6.0
    assert goodput_words(goodput) == "10.0 s, goodput 60%: start-up 4.0 s, training 6.0 s"


def test_status_says_the_step_out_of_the_total_the_rate_and_the_time_left() -> None:
    moving = Progress(1, T0, 120, T0 + 10, T0, total=312, rate=16.0)
    assert progress_words(moving, running=True) == "step 120/312 (38%), 16 steps/s, about 12 s left"
    assert progress_words(Progress(1, T0, 120, T0 + 10, T0, 3120, 0.5), True).endswith("about 1 h 40 min left")
    assert progress_words(Progress(1, T0, 120, T0 + 10, T0, 312, 0.0), True) == \
        "step 120/312 (38%), 0 steps/s, not moving: no time left can be told"
    assert progress_words(Progress(1, T0, 312, T0 + 10, T0, 312, 16.0), running=False) == "step 312/312 (100%)"
    assert progress_words(Progress(1, T0, 50, T0 + 10, T0), running=True) == "step 50"


def _failed(progress: Progress | None, backoff_s: float = 1.0) -> Attempt:
    """Attempt 0: started at 5, its node lost 20 s in (at 25), its last node ended at 26.5."""
    lost = Failure(node_rank=1, host="h2", ranks=[1], rank=None, rank_exit_code=None, exit_code=None,
                   description="lost its node agent", after_s=20.0, last_lines=[], kind=FailureKind.INFRA,
                   evidence="the agent's connection closed", host_down=True)
    return Attempt(attempt=0, hosts=["h1", "h2"], status=RunStatus.FAILED, started_at=T0 + 5, ended_at=T0 + 26.5,
                   nodes=[], failures=[lost], kind=FailureKind.INFRA, down=["h2"], preflight_s=0.2, backoff_s=backoff_s,
                   progress=progress)


def test_one_recovery_figure_from_the_fault_to_the_first_step_told_phase_by_phase_and_counted_as_restarting() -> None:
    """Last step 39 at 24.5; fault at 25, stop to 26.5, backoff 1 s, checks to 28.2 (the next attempt's start), ranks
    join at 30.0 and 30.4, the resume line (step 30, restored in 0.25 s) at 31.0, step 31's line at 31.2, past step 39
    at 33.0: recovered in 6.2 s, the seconds goodput's restarting holds too."""
    failed = _failed(Progress(1, T0 + 8, 39, T0 + 24.5))
    progress = Progress(31, T0 + 31.2, 45, T0 + 36, new_at=T0 + 33.0, resumed_step=30, resumed_at=T0 + 31.0,
                        restore_s=0.25)
    restart = restart_of(failed, T0 + 28.2, [T0 + 30.4, T0 + 30.0], progress, furthest=39)
    assert restart.phases == {"stop": 1.5, "backoff": 1.0, "preflight": 0.7, "start-up": 1.8, "rendezvous": 0.4,
                              "loading": 0.35, "restore": 0.25, "first step": 0.2}
    assert list(restart.phases) == list(RESTART_PHASES)
    assert restart.total_s == pytest.approx(sum(restart.phases.values())) and restart.total_s == 6.2
    assert (restart.steps_redone, restart.redone_s) == (9, 1.8)
    assert restart.describe() == (
        "recovered in 6.20 s (stop 1.50 s, backoff 1.00 s, preflight 0.70 s, start-up 1.80 s, rendezvous 0.40 s, "
        "loading 0.35 s, restore 0.25 s, first step 0.20 s); 9 step(s) redone in 1.80 s")
    second = Attempt(attempt=1, hosts=["h1", "h3"], status=RunStatus.SUCCEEDED, started_at=T0 + 28.2,
                     ended_at=T0 + 40, nodes=[], failures=[], kind=None, down=[], preflight_s=0.7, progress=progress,
                     restart=restart, recover_s=restart.total_s)
    assert run_goodput(T0, T0 + 41, [failed, second]).seconds["restarting"] == pytest.approx(restart.total_s)


def test_a_phase_the_record_cannot_see_is_left_out_and_its_time_falls_in_the_next() -> None:
    """Ranks not watched joining and no resume line (start-up, rendezvous, loading, restore: in the first step); a
    just-in-time resume redoes nothing; an attempt with no step yet has no recovery, only the seconds seen."""
    restart = restart_of(_failed(None, backoff_s=0.0), T0 + 27.0, [], Progress(40, T0 + 30.0, 40, T0 + 30.0),
                         furthest=39)
    assert restart.phases == {"stop": 1.5, "backoff": 0.0, "preflight": 0.5, "first step": 3.0}
    assert restart.total_s == 5.0 and restart.steps_redone == 0 and restart.redone_s is None
    unstepped = restart_of(_failed(None), T0 + 28.0, [], None, None)
    assert unstepped.steps_redone is None and not unstepped.stepped
    assert unstepped.describe() == "no first step: 3.00 s from the fault (stop 1.50 s, backoff 1.00 s, preflight 0.50 s)"
    late = restart_of(_failed(Progress(1, T0 + 8, 39, T0 + 25.1)), T0 + 28.0, [], None, None)
    assert late.total_s == 3.0, "a last line that arrived after the fault changes nothing: it counts from the fault"
