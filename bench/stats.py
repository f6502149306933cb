"""Comparisons that say their spread: two launchers in interleaved rounds, and a 95% interval of what
separates them, so that a goal is judged only where the interval can judge it.

`compare(first, second, ...)` runs rounds of one `first` and one `second` measurement each, the order
swapped every round (first, second, second, first, ...: neither always starts on a machine the other
warmed), and after each round takes the Student t interval (95%, two-sided) of the rounds' paired
differences (first - second) or ratios (first / second). It stops when that interval is within
+-half_width of its mean, or at max_rounds, and says which. Pairing takes out what a round shares
(load that comes and goes, a warm page cache), so the interval is that of the launchers' difference.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

LEVEL = 0.95
# Student's t quantile at 0.975 (a two-sided 95% interval) by degrees of freedom; between rows, the
# smaller df's (a slightly wider interval, never a narrower one).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
STATISTICS = ("difference", "ratio")


def t_quantile(df: int) -> float:
    """Student's t at 0.975 with df degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return T_975[max(k for k in T_975 if k <= df)]


@dataclass(frozen=True)
class Interval:
    """The mean of n values and its 95% t interval."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def interval(values: Sequence[float]) -> Interval:
    """The 95% Student t interval of the mean of values (at least 2)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    mean = statistics.fmean(values)
    half = t_quantile(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def judge(low: float, high: float, goal: float, *, at_most: bool = True) -> bool | None:
    """A goal (`value <= goal`, or `>= goal` with at_most=False) met when the whole interval meets it,
    missed when none of it does, and None (undecided) when the interval holds the goal."""
    good, bad = (high <= goal, low > goal) if at_most else (low >= goal, high < goal)
    return True if good else False if bad else None


def compare(first: Callable[[], float], second: Callable[[], float], *, half_width: float, max_rounds: int,
            min_rounds: int = 3, statistic: str = "difference",
            after_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Interleaved rounds of first() and second() until the interval of their difference (or ratio) is within
    +-half_width or max_rounds were run; after_round(i) runs after round i (other variants, a progress line)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic {statistic!r}: expected one of {', '.join(STATISTICS)}")
    if not 2 <= min_rounds <= max_rounds:
        raise ValueError(f"rounds: need 2 <= min_rounds ({min_rounds}) <= max_rounds ({max_rounds})")
    firsts: list[float] = []
    seconds: list[float] = []
    paired: list[float] = []
    reached = False
    for i in range(max_rounds):
        order = ((first, firsts), (second, seconds))
        for measure, into in order if i % 2 == 0 else reversed(order):
            into.append(measure())
        paired.append(firsts[-1] - seconds[-1] if statistic == "difference" else firsts[-1] / seconds[-1])
        if after_round is not None:
            after_round(i)
        if len(paired) >= min_rounds and interval(paired).half_width <= half_width:
            reached = True
            break
    found = interval(paired)
    return {"statistic": statistic, "level": LEVEL, "estimate": found.mean, "low": found.low, "high": found.high,
            "half_width": found.half_width, "rounds": found.n, "target_half_width": half_width,
            "max_rounds": max_rounds, "stopped": "interval" if reached else "round limit",
            "paired": paired, "first": firsts, "second": seconds}


def rounded(found: dict[str, Any], digits: int) -> dict[str, Any]:
    """compare()'s answer with its figures rounded for a result file."""
    figures = ("estimate", "low", "high", "half_width")
    return found | {k: round(found[k], digits) for k in figures} | {
        k: [round(v, digits) for v in found[k]] for k in ("paired", "first", "second")}


def describe(found: dict[str, Any], unit: str = "s") -> str:
    """`+0.41 s (95% interval [+0.22, +0.60], 12 rounds)` for a difference, `1.012x (95% interval [0.998,
    1.026], 3 rounds)` for a ratio."""
    level = f"{found.get('level', LEVEL):.0%}"
    if found["statistic"] == "ratio":
        return (f"{found['estimate']:.3f}x ({level} interval [{found['low']:.3f}, {found['high']:.3f}], "
                f"{found['rounds']} rounds)")
    return (f"{found['estimate']:+.2f} {unit} ({level} interval [{found['low']:+.2f}, {found['high']:+.2f}], "
            f"{found['rounds']} rounds)")


def stopped(found: dict[str, Any], unit: str = "s") -> str:
    """Why the rounds ended: the interval narrow enough, or the round limit with the interval still wider."""
    target = f"+-{found['target_half_width']:g}{'' if found['statistic'] == 'ratio' else ' ' + unit}"
    if found["stopped"] == "interval":
        return f"stopped: the interval is within {target}"
    width = f"{found['half_width']:.3f}" if found["statistic"] == "ratio" else f"{found['half_width']:.2f} {unit}"
    return f"stopped: the round limit ({found['max_rounds']}), the interval still +-{width} (target {target})"
