"""bench/stats.py: the interval of a comparison in rounds, and the goals judged on it (bench/report.py)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest

from bench import report, stats


def test_t_quantile_table_and_between_rows() -> None:
    assert stats.t_quantile(1) == 12.706
    assert stats.t_quantile(2) == 4.303
    assert stats.t_quantile(30) == 2.042
    assert stats.t_quantile(35) == 2.042  # between rows: the smaller df's, a wider interval
    assert stats.t_quantile(10_000) == 1.980
    with pytest.raises(ValueError):
        stats.t_quantile(0)


def test_interval_of_the_mean() -> None:
    found = stats.interval([1.0, 2.0, 3.0])  # mean 2, sd 1
    assert found.mean == 2.0 and found.n == 3
    assert found.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert found.low == pytest.approx(2.0 - 4.303 / math.sqrt(3))
    with pytest.raises(ValueError):
        stats.interval([1.0])


@pytest.mark.parametrize(("low", "high", "at_most", "met"), [
    (0.1, 0.25, True, True),  # all of it within +0.3
    (0.35, 0.6, True, False),  # none of it
    (0.2, 0.4, True, None),  # the interval holds the goal: undecided
    (0.992, 1.01, False, True),  # a ratio at least 0.99
    (0.95, 0.98, False, False),
    (0.985, 1.0, False, None),
])
def test_judge(low: float, high: float, at_most: bool, met: bool | None) -> None:
    goal = 0.3 if at_most else 0.99
    assert stats.judge(low, high, goal, at_most=at_most) is met


def test_compare_alternates_the_order_and_stops_on_a_narrow_interval() -> None:
    calls: list[str] = []
    first_values = iter([4.4, 4.5, 4.4, 4.5])
    second_values = iter([4.0, 4.1, 4.0, 4.1])

    def first() -> float:
        calls.append("first")
        return next(first_values)

    def second() -> float:
        calls.append("second")
        return next(second_values)

    found = stats.compare(first, second, half_width=0.1, max_rounds=10)
    assert calls == ["first", "second", "second", "first", "first", "second"]  # swapped every round
    assert found["rounds"] == 3 and found["stopped"] == "interval"
    assert found["estimate"] == pytest.approx(0.4)
    assert found["paired"] == pytest.approx([0.4, 0.4, 0.4])
    assert stats.describe(found) == "+0.40 s (95% interval [+0.40, +0.40], 3 rounds)"
    assert stats.stopped(found) == "stopped: the interval is within +-0.1 s"


def test_compare_says_when_the_round_limit_ended_it() -> None:
    noisy = itertools.cycle([1.0, 3.0, 2.0, 0.5])
    found = stats.compare(lambda: next(noisy), lambda: 1.0, half_width=0.1, max_rounds=4)
    assert found["rounds"] == 4 and found["stopped"] == "round limit"
    assert found["low"] < found["estimate"] < found["high"]
    assert stats.stopped(found).startswith("stopped: the round limit (4), the interval still +-")


def test_compare_ratio() -> None:
    found = stats.compare(lambda: 99.0, lambda: 100.0, half_width=0.005, max_rounds=3, statistic="ratio")
    assert found["estimate"] == pytest.approx(0.99) and found["stopped"] == "interval"
    assert stats.describe(found) == "0.990x (95% interval [0.990, 0.990], 3 rounds)"
    with pytest.raises(ValueError):
        stats.compare(lambda: 1.0, lambda: 1.0, half_width=0.1, max_rounds=1)


def _comparison(low: float, high: float, statistic: str = "difference") -> dict[str, object]:
    return {"statistic": statistic, "level": 0.95, "estimate": (low + high) / 2, "low": low, "high": high,
            "half_width": (high - low) / 2, "rounds": 5, "target_half_width": 0.1, "max_rounds": 5,
            "stopped": "round limit", "paired": [], "first": [], "second": []}


MACHINE = {"date": "2026-11-28T00:00:00+00:00", "host": "vm", "cpu": "cpu", "cores": 2, "memory_gib": 8, "gpus": [],
           "load_average_at_start": [0.1, 0.1, 0.1],
           "versions": {"python": "3.11", "torch": "2", "torchvision": "0", "harness": "0.1.0"},
           "git": {"commit": "0" * 40, "dirty": False}}
FIRST_STEP_OLD = {"job": "payload", "repeats": 1, "statistic": "median", "harness_render_s": 0.3, "rows": [
    {"name": "harness launch (2 nodes x 1 process)", "first_step_s": 4.4, "job_end_s": 5.2,
     "attempts_first_step_s": [4.4], "vs_torchrun_by_hand_s": 0.4},
    {"name": "torchrun by hand (2 agents x 1 process)", "first_step_s": 4.0, "job_end_s": 4.5,
     "attempts_first_step_s": [4.0], "vs_torchrun_by_hand_s": 0.0}]}
HARNESS_COST = {"job": "payload at its fast settings", "device": "cpu", "goal_ratio": 0.99,
                "ratio": _comparison(0.97, 1.01, "ratio"),
                "rows": [{"name": n, "images_per_s": 7000.0, "low": 6900.0, "high": 7100.0, "median": 7000.0,
                          "attempts_images_per_s": [6950.0, 7000.0, 7050.0]}
                         for n in ("harness launch (1 node x 1 process)", "torchrun (1 process)")]}


def _result(benchmarks: dict[str, object]) -> dict[str, object]:
    return {"profile": "quick", "machine": MACHINE, "duration_s": 60.0, "benchmarks": benchmarks}


def test_goals_judged_on_the_interval_and_old_results_still_render() -> None:
    new = copy.deepcopy(FIRST_STEP_OLD) | {"difference": _comparison(0.1, 0.25), "goal_s": 0.3}
    found = report.goals(_result({"first_step": new, "harness_cost": HARNESS_COST}))
    first = next(g for g in found if "first step" in g["goal"])
    assert first["met"] is True and first["value"].startswith("+0.17 s (95% interval [+0.10, +0.25], 5 rounds)")
    new["difference"] = _comparison(0.2, 0.4)
    first = next(g for g in report.goals(_result({"first_step": new})) if "first step" in g["goal"])
    assert first["met"] is None and report._mark(first).startswith("undecided")
    cost = next(g for g in found if "img/s on a GPU" in g["goal"])
    assert cost["met"] is None and "on this CPU the interval says undecided" in report._mark(cost)
    text = report.markdown({"quick": _result({"first_step": new, "harness_cost": HARNESS_COST})})
    assert "95% interval [+0.20, +0.40], 5 rounds" in text and "### 3b. " in text
    old = report.markdown({"quick": _result({"first_step": FIRST_STEP_OLD})})  # a result file from before rounds
    assert "| harness launch (2 nodes x 1 process) | 4.4 |" in old and "(95% interval [" not in old
    assert not [g for g in report.goals(_result({"first_step": FIRST_STEP_OLD})) if "first step" in g["goal"]]
