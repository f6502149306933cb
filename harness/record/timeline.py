"""timeline.jsonl: how every rank ran over time -- its CPU use, how busy its main thread was (the rest
of the time it waited, e.g. for its peers in a collective), the step it was at (with its loss and
throughput, where it prints them) and how busy it kept its GPU -- one line per health sample, appended
while the run runs, for `harness report`'s plots. Past schema.SUMMED_PAST ranks a line holds every rank while the
attempt is young (its first 30 s, a sample a second: a short run's course), then only as often as health-ranks.json
does (health_summary.TABLE_SECONDS), and the odd ranks alone between (those health.json lists): every rank every 5 s
was 8 bytes per rank per second, 11 GB a day at 16,384 ranks, all of it read by `harness report`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from harness.record.atomic import file_mode

ODD_ONLY = b'"odd_only":true'  # in a line of the odd ranks alone (sample_line)
RANK_POINT = b'"cpu":'  # once in each rank's point of a line


@dataclass(frozen=True, slots=True)
class RankPoint:
    """cpu: CPUs the rank (with its children) used over the interval before t (1.0: one CPU all the time; None:
    not measured yet: its step was known before the health watch's first two samples of it); busy: the share
    of that interval its main thread ran (None: not measured); step: its progress, where the job prints it
    (None: not known); gpu: the percentage of the SMs' time it ran kernels (None: no GPU the driver reports);
    loss and throughput (items per second): as its last progress line said them (None: not said)."""

    cpu: float | None
    busy: float | None = None
    step: int | None = None
    gpu: float | None = None
    loss: float | None = None
    throughput: float | None = None


@dataclass(frozen=True)
class Sample:
    """every: ranks holds every rank's point; False: only the odd ranks' (a line between a large job's full ones)."""

    t: float
    attempt: int
    ranks: Mapping[int, RankPoint]
    every: bool = True


def append_sample(path: Path, sample: Sample) -> None:
    """One line, in one write: a reader sees whole lines, or a last one cut short by a crash. A new file is as
    private as its run's folder (file_mode), whatever the umask."""
    with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode(path.parent)), "a",
              encoding="utf-8") as file:
        file.write(sample_line(sample))


def sample_line(sample: Sample) -> str:
    """A sample as its line of timeline.jsonl."""
    ranks = {str(rank): {"cpu": _rounded(p.cpu), "busy": _rounded(p.busy), "step": p.step,
                         **{key: value for key, value in (("gpu", p.gpu), ("loss", p.loss),
                                                           ("throughput", p.throughput)) if value is not None}}
             for rank, p in sorted(sample.ranks.items())}
    head = {"t": round(sample.t, 3), "attempt": sample.attempt, **({} if sample.every else {"odd_only": True})}
    return json.dumps({**head, "ranks": ranks}, separators=(",", ":")) + "\n"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def read_timeline(path: Path) -> list[Sample]:
    """Every sample that can be read, in order; a damaged or cut line is skipped, a missing file is none."""
    try:
        with open(path, "rb") as file:
            return [sample for line in file if (sample := _sample_of(line)) is not None]
    except FileNotFoundError:
        return []


class Drawn(NamedTuple):
    """The samples a report draws, and how many the timeline holds in all."""

    samples: list[Sample]
    total: int


def read_drawn(path: Path, most: int, most_points: int) -> Drawn:
    """At most about `most` of the samples that hold every rank, evenly spread, and of those at most as many as
    hold `most_points` ranks' points in all; and as many of those between that hold the odd ranks alone: a long run
    of many ranks is drawn from a part of its timeline (a day at 16,384 ranks is gigabytes), read a line at a time
    (the kinds counted first, without parsing), so that the report's memory does not grow with the run. Thinned
    together, the few samples that hold every rank could all be left out."""
    counts, ranks = [0, 0], 1  # lines of every rank, of the odd ranks alone; the most ranks a line holds
    try:
        with open(path, "rb") as file:
            for line in file:
                every = ODD_ONLY not in line
                counts[every] += 1
                if every:
                    ranks = max(ranks, line.count(RANK_POINT))
    except FileNotFoundError:
        return Drawn([], 0)
    strides = [math.ceil(counts[0] / most) or 1, math.ceil(counts[1] / max(1, min(most, most_points // ranks))) or 1]
    seen, samples = [0, 0], []
    with open(path, "rb") as file:
        for line in file:
            every = ODD_ONLY not in line
            if seen[every] % strides[every] == 0 and (sample := _sample_of(line)) is not None:
                samples.append(sample)
            seen[every] += 1
    return Drawn(samples, sum(counts))


def _sample_of(line: bytes) -> Sample | None:
    """A line's sample (None: damaged or cut)."""
    try:
        data = json.loads(line)
        return Sample(float(data["t"]), int(data["attempt"]), {
            int(rank): RankPoint(_number(p, "cpu"), _number(p, "busy"),
                                 None if p.get("step") is None else int(p["step"]), _number(p, "gpu"),
                                 _number(p, "loss"), _number(p, "throughput"))
            for rank, p in data["ranks"].items()}, not data.get("odd_only", False))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _number(point: Mapping[str, Any], key: str) -> float | None:
    """A point's value, None where it is left out or null."""
    return None if point.get(key) is None else float(point[key])
