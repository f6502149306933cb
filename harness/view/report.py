"""`harness report RUN_ID`: one run as one self-contained HTML page, easier to look at than its JSON: the
header, the attempts on a time axis with the health watch's verdicts and the failures, every rank's CPU
use, waiting and step rate over time (timeline.jsonl; past DRAWN_RANKS, their spread and the ranks named), the
first failure and each node's end.

The page fetches nothing (CSS inline, charts inline SVG written by hand in view/charts.py, which says
why not matplotlib), so it can be mailed or attached to a ticket as one file. Every string from the
record is escaped. A run without a summary yet (still running, or its controller gone) gets what is
known so far; wording is view/status.py's, so the page and `harness status` say the same."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from html import escape

from harness.health.rank_stack import stack_groups
from harness.record.goodput import SlowSpan, goodput_of, live_slowness, slow_spans
from harness.record.liveness import live_status
from harness.record.rundir import RunDir
from harness.record.schema import (
    Attempt,
    Failure,
    FailureKind,
    HealthEvent,
    HealthEventKind,
    Progress,
    RecordedNode,
    RunState,
    RunStatus,
    RunSummary,
)
from harness.record.timeline import RankPoint, Sample, read_drawn
from harness.view.charts import Dot, Mark, Row, Segments, Span, StepAxis, TimeAxis, legend, line_chart, rows_chart
from harness.view.stacks import kept_stacks
from harness.view.status import (
    ended_after,
    ending_words,
    health_lines,
    node_failures,
    node_log,
    recorded_end,
    unrecorded_end,
)

MAX_SAMPLES = 600  # per plot: a long run's samples are thinned to about this many, so the page stays small
MAX_POINTS = 1_000_000  # ranks' points of the samples that hold every rank, read at most (about 100 MiB)
# Past this many ranks a chart draws their spread (least, median, most) and the ranks the health watch named, not a
# line each: a 16,384-rank run's page was hundreds of MB, and no one reads 16,384 lines; it is now a 32-rank one's.
DRAWN_RANKS = 32
NAMED_DRAWN = 8
VERDICT_ABOVE = "the verdict above"  # a hang's verdict is said once, in the header; elsewhere it is pointed at
# A rank's value at a sample, from its point, its point at the sample before in the same attempt (None:
# the first of the attempt) and the seconds between the two; None: not known there.
Measure = Callable[[RankPoint, RankPoint | None, float], float | None]

CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#1b1b1b;max-width:1000px;margin:24px auto;padding:0 16px}
h1{font-size:20px;margin:0 0 6px;word-break:break-all}h2{font-size:16px;margin:28px 0 8px;padding-bottom:4px;
border-bottom:1px solid #ddd}h3{font-size:14px;margin:16px 0 6px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}dt{color:#666}dd{margin:0}
.note{background:#fff7e0;border-left:4px solid #f0b400;padding:6px 10px}
.badge{display:inline-block;padding:0 8px;border-radius:10px;color:#fff;font-weight:600}
table{border-collapse:collapse;width:100%;margin:6px 0}th,td{text-align:left;padding:3px 8px;vertical-align:top;
border-bottom:1px solid #eee}th{color:#666;font-weight:600}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
svg.chart{display:block;max-width:100%;height:auto;font-size:11px}
.grid{stroke:#e8e8e8}.tick,.label{fill:#555}line.mark{stroke:#888;stroke-dasharray:4 3}text.mark{fill:#555}
.backoff{fill:#d9d9d9}.running{background:#1f77b4;fill:#1f77b4}.succeeded{background:#2e9e44;fill:#2e9e44}
.failed,.error{background:#d62728;fill:#d62728}.lost{background:#e08a00;fill:#e08a00}
.stopped,.interrupted,.unreadable{background:#7f7f7f;fill:#7f7f7f}
.slow circle{fill:#f0b400}.recovered circle{fill:#2e9e44}.hang circle{fill:#5a0000}g circle{stroke:#fff}
.failure path{stroke:#000;stroke-width:2.5}.legend .slow{color:#f0b400}.legend .recovered{color:#2e9e44}
.legend .hang{color:#5a0000}.weighed circle{fill:#8c564b}.legend .weighed{color:#8c564b}
rect.slowed{fill:#f0b400;fill-opacity:.22}.legend i.slowed{background:#f6d77a;height:10px}
line.act{stroke:#d62728;stroke-width:1.5}text.act{fill:#d62728}.legend i.act{background:#d62728;width:2px;height:12px}
.spent{display:flex;height:22px;border-radius:3px;overflow:hidden;margin:6px 0}.spent span{display:block}
.b-start-up{background:#6b8cae}.b-training{background:#2e9e44}.b-redone{background:#e08a00}.b-hung{background:#5a0000}
.b-restarting{background:#9467bd}.b-ending{background:#b0b0b0}.b-slowed{background:#f0b400}
.legend span{margin-right:14px;white-space:nowrap}.legend i{display:inline-block;width:14px;height:4px;
margin-right:4px;vertical-align:middle}
details{margin:8px 0}summary{cursor:pointer}details h3{font-size:13px;word-break:break-word}
"""


@dataclass(frozen=True)
class _Run:
    """What every part of the page reads: the record, its timeline, and the time axis all charts share."""

    run: RunDir
    state: RunState
    summary: RunSummary | None
    status: RunStatus
    axis: TimeAxis
    samples: Sequence[Sample]  # those drawn (timeline.read_drawn)
    samples_in_all: int

    def since(self, t: float) -> float:
        """Seconds since the run started: the charts' x."""
        return t - self.state.started_at

    @property
    def hangs(self) -> dict[int, str]:
        """Each hung attempt's verdict, by attempt: from the health watch's hang event, else (a record without
        one) from the hang's failure."""
        found: dict[int, str] = {}
        for a in self.summary.attempts if self.summary else []:
            said = [e.text.removeprefix("hang: ") for e in a.health if e.kind is HealthEventKind.HANG]
            said += [f.evidence for f in a.failures if f.kind is FailureKind.HANG]
            if said:
                found[a.attempt] = said[0]
        return found


def html_report(run: RunDir) -> str:
    """The page of run, from its record and timeline as they are now."""
    state, summary = run.read_state(), run.read_summary()
    samples, in_all = read_drawn(run.timeline, MAX_SAMPLES, MAX_POINTS)
    ended = summary.ended_at if summary else state.ended_at or max([time.time(), *(s.t for s in samples)])
    r = _Run(run, state, summary, live_status(state, run), TimeAxis(max(ended - state.started_at, 1.0)), samples,
             in_all)
    body = [_header(r), _time_spent(r), _attempts(r), _plots(r), _over_steps(r), _first_failure(r), _hang_stacks(r),
            _nodes(r),
            f"<footer><p>written by harness report on {escape(_clock(time.time()))} from "
            f"<code>{escape(str(run.path))}</code></p></footer>"]
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>harness report: '
            f"{escape(run.run_id)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t))


def _header(r: _Run) -> str:
    state, summary = r.state, r.summary
    sizes = (summary.world_sizes if summary else []) or [state.world_size]
    nnodes = list(dict.fromkeys(a.nnodes for a in summary.attempts if a.nnodes)) if summary else []
    duration = f"{summary.duration_s:.1f} s" if summary else f"{time.time() - state.started_at:.1f} s so far"
    facts = [("job", state.name),
             ("target", f"{state.mode} job {state.scheduler_job}" if state.scheduler_job else state.mode),
             ("nodes", " → ".join(map(str, nnodes or [state.nnodes]))),
             ("world size", " → ".join(map(str, sizes))),
             ("started", _clock(state.started_at)),
             ("duration", duration),
             *([("first step", first)] if (first := _first_steps(r)) else []),
             ("exit code", str(summary.exit_code) if summary else "none yet"),
             ("attempts", str(len(summary.attempts)) if summary else f"{state.attempt + 1} so far")]
    error = (summary.error if summary else None) or state.error
    hangs = r.hangs
    facts += [("error", error)] if error and error not in hangs.values() else []
    facts += [("hang" if summary and len(summary.attempts) == 1 else f"hang in attempt {attempt}", verdict)
              for attempt, verdict in hangs.items()]
    facts += [("not restarted", summary.reason)] if summary and summary.reason else []
    facts += [("warning", warning) for warning in (summary.warnings if summary else [])]
    parts = [f'<header><h1>{escape(r.run.run_id)}</h1><p><span class="badge {r.status.value}">{r.status.value}'
             f"</span></p>"]
    if summary is None:
        parts.append('<p class="note">' + escape(
            f"Still running (attempt {state.attempt}): this is what is known so far; `harness report "
            f"{r.run.run_id}` again shows more. Attempts, failures and the nodes' ends are recorded when it ends."
            if r.status is RunStatus.RUNNING else
            f"No end was recorded for this run (it is {r.status.value}; no summary.json): this is what was known "
            f"before.") + "</p>")
    parts.append("<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts) + "</dl></header>")
    return "".join(parts)


def _progress(r: _Run) -> dict[int, tuple[float, Progress]]:
    """Each attempt's start and steps, where `harness status` reads them: the attempts of the summary, or a running
    attempt's health.json. Not the timeline, which lacks what came while the record could not be written."""
    if r.summary is not None:
        return {a.attempt: (a.started_at, a.progress) for a in r.summary.attempts if a.progress is not None}
    health = r.run.read_health(r.state.attempt)
    if health is None or health.progress is None:
        return {}
    return {r.state.attempt: (health.started_at or r.state.started_at, health.progress)}


def _first_steps(r: _Run) -> str:
    """When each attempt's first step line came, in seconds after the run started (a later attempt's: after that
    attempt started); "": never."""
    return "; ".join(f"{progress.first_at - r.state.started_at:.1f} s after the run started" if attempt == 0 else
                     f"attempt {attempt}: {progress.first_at - started:.1f} s after it started"
                     for attempt, (started, progress) in _progress(r).items())


def _attempts(r: _Run) -> str:
    head = "<section><h2>Timeline</h2>"
    if r.summary is None:
        health = "".join(f"<li>{escape(line)}</li>" for line in health_lines(r.run.read_health(r.state.attempt)))
        return (head + f"<p>Attempt {r.state.attempt} runs on {escape(', '.join(r.state.hosts))}.</p>"
                + (f"<p>The health watch says:</p><ul>{health}</ul>" if health else "") + "</section>")
    attempts = r.summary.attempts
    if not attempts:
        return head + "<p>No attempt started.</p></section>"
    rows = [Row(f"attempt {a.attempt}", _spans(r, a), _dots(r, a)) for a in attempts]
    key = ('<p class="legend">bars: attempts, colored by how they ended (grey after one: the backoff); '
           '<span class="slow">● slow rank</span> <span class="recovered">● recovered</span> '
           '<span class="weighed">● slowness weighed against a restart</span> '
           '<span class="hang">● hang</span> ✕ failure; hover for details</p>')
    table = _table(["attempt", "hosts", "nodes", "world size", "status", "cause", "times"],
                   [[str(a.attempt), a.where(False), _known(a.nnodes), _known(a.world_size), a.status.value,
                     _cause(a), _timings(a)] for a in attempts])
    events = sorted(_events(r, attempts))
    listed = _table(["at", "attempt", "what", "who", "said"], [[f"+{at:.1f} s", *rest] for at, *rest in events])
    resized = len(r.summary.world_sizes) > 1
    return (head + rows_chart(r.axis, rows) + key + table
            + ("<p>The run went on with fewer nodes: its world size changed.</p>" if resized else "")
            + ("<h3>Verdicts and failures</h3>" + listed if events else "") + "</section>")


def _spans(r: _Run, a: Attempt) -> list[Span]:
    spans = [Span(r.since(a.started_at), r.since(a.ended_at), a.status.value,
                  f"attempt {a.attempt}: {a.status.value} after {a.ended_at - a.started_at:.1f} s on {a.where(True)}")]
    if a.backoff_s:
        spans.append(Span(r.since(a.ended_at), r.since(a.ended_at + a.backoff_s), "backoff",
                          f"backoff: {a.backoff_s} s before the next attempt"))
    return spans


def _dots(r: _Run, a: Attempt) -> list[Dot]:
    return ([Dot(r.since(e.at), e.kind.value, f"+{r.since(e.at):.1f} s {e.kind.value}: {_said(e)}") for e in a.health]
            + [Dot(r.since(a.started_at + f.after_s), "failure", f"failure: {f.describe(verdict_said=True)}")
               for f in a.failures])


def _said(event: HealthEvent) -> str:
    """What the health watch said; a hang's verdict pointed at (the header says it)."""
    return VERDICT_ABOVE if event.kind is HealthEventKind.HANG else event.text


def _events(r: _Run, attempts: Iterable[Attempt]) -> Iterable[tuple[float, str, str, str, str]]:
    """Every verdict and failure: seconds since the run started, attempt, what, who, what was said."""
    for a in attempts:
        yield from ((r.since(e.at), str(a.attempt), e.kind.value, "" if e.rank is None else f"rank {e.rank}",
                     _said(e)) for e in a.health)
        yield from ((r.since(a.started_at + f.after_s), str(a.attempt), f"{f.kind.value} failure",
                     f"node{f.node_rank} ({f.host})" + ("" if f.rank is None else f", rank {f.rank}"),
                     f"{f.description}: " + (VERDICT_ABOVE if f.kind is FailureKind.HANG else f.error or f.evidence))
                    for f in a.failures)


def _known(value: int | None) -> str:
    return "-" if value is None else str(value)


def _cause(a: Attempt) -> str:
    cause = a.failures[0].describe(verdict_said=True) if a.failures else ""
    if not a.down:
        return cause
    return cause + (f"; took {', '.join(a.down)} out" if a.kind is FailureKind.SLOW else f"; lost {', '.join(a.down)}")


def _timings(a: Attempt) -> str:
    times = [("preflight", a.preflight_s), ("teardown", a.teardown_s), ("backoff", a.backoff_s)]
    said = ", ".join(f"{name} {seconds} s" for name, seconds in times if seconds is not None)
    return said + (f"; {a.restart.describe()}" if a.restart is not None else "")


def _plots(r: _Run) -> str:
    head = "<section><h2>Ranks over time</h2>"
    samples = r.samples
    if not r.run.timeline.exists():
        return head + (f"<p>No plots: this run has no {r.run.timeline.name} (runs recorded before the harness kept "
                       f"one have none).</p>{_recorded_step_rate(r)}</section>")
    if not samples:
        return head + f"<p>No plots: {r.run.timeline.name} holds no sample yet.</p>{_recorded_step_rate(r)}</section>"
    ranks = sorted({rank for sample in samples for rank in sample.ranks})
    drawn = _drawn(r, ranks)
    key = legend(_labels(ranks, drawn))
    starts = {a.attempt: a.started_at for a in r.summary.attempts} if r.summary else {}
    if r.summary is None:
        for sample in samples:
            starts.setdefault(sample.attempt, sample.t)
    marks = [Mark(r.since(t), f"attempt {n}") for n, t in starts.items()] if len(starts) > 1 else []
    parts = [head]
    for plot in PLOTS:
        series = _series(r, samples, drawn, plot.measure, spread=len(ranks) > DRAWN_RANKS)
        values = [y for segments in series for points in segments for _, y in points]
        if values and plot.measure is _step_rate:
            bands, acts, said = _slowness(r)
            chart = line_chart(r.axis, series, [*marks, *acts], max(*values, plot.least), plot.y_text, bands=bands)
            parts.append(f'<div id="{plot.key}"><h3>{escape(plot.title)}</h3>{chart}{key}{said}</div>')
        elif values:
            chart = line_chart(r.axis, series, marks, plot.y_max or max(*values, plot.least), plot.y_text)
            parts.append(f'<div id="{plot.key}"><h3>{escape(plot.title)}</h3>{chart}{key}</div>')
        elif plot.measure is _step_rate and (recorded := _recorded_step_rate(r)):
            parts.append(recorded)
        elif plot.missing:
            parts.append(f"<p>No plot of {escape(plot.missing)}.</p>")
    if len(samples) < r.samples_in_all:
        parts.append(f"<p>{len(samples)} of {r.samples_in_all} samples drawn, evenly spread.</p>")
    return "".join(parts) + "</section>"


@dataclass(frozen=True)
class _Plot:
    """One line chart of PLOTS: a line per rank of measure's values over time."""

    key: str  # the chart's element id: report.html#cpu
    title: str
    measure: Measure
    y_text: Callable[[float], str]
    missing: str  # what the page says instead, when no rank has a value ("": nothing, e.g. a run without GPUs)
    y_max: float | None = None  # None: the largest value, and at least `least`
    least: float = 1.0  # the top of the y axis at least: a line of zeros (a hang's step rate) gets a scale


def _value(read: Callable[[RankPoint], float | None]) -> Measure:
    """A measure that is the point's own value (not a rate between samples)."""
    return lambda point, before, seconds: read(point)


def _step_rate(point: RankPoint, before: RankPoint | None, seconds: float) -> float | None:
    """Steps per second since the sample before; None across a restart or a step that went back (a resume)."""
    if before is None or point.step is None or before.step is None or seconds <= 0 or point.step < before.step:
        return None
    return (point.step - before.step) / seconds


def _recorded_step_rate(r: _Run) -> str:
    """The step rate chart where the timeline has none (its samples lost in a gap of the record): each attempt's mean,
    from its first step line to its last, as the attempts record them; "": none recorded either."""
    spans = [[(r.since(progress.first_at), rate), (r.since(progress.last_at), rate)]
             for _, progress in _progress(r).values() if progress.last_at > progress.first_at
             and (rate := (progress.last_step - progress.first_step) / (progress.last_at - progress.first_at)) >= 0]
    if not spans:
        return ""
    bands, acts, said = _slowness(r)
    chart = line_chart(r.axis, [spans], acts, max(1.0, *(rate for span in spans for _, rate in span)), "{:g}".format,
                       bands=bands)
    key = legend({0: "each attempt's mean, from its first step line to its last (the timeline has no step of it)"})
    return f'<div id="step-rate"><h3>Step rate (steps/s)</h3>{chart}{key}{said}</div>'


def _slowness(r: _Run) -> tuple[list[Span], list[Mark], str]:
    """What the step rate shows of slow ranks: each slowness shaded from its onset to its rank's recovery, the
    harness's stop for it, or its attempt's end (while it runs: now); the stop a line of its own, named by the host
    the restart goes without; and the legend that says so ("": no slowness)."""
    found: list[tuple[SlowSpan, str, str | None]] = []  # the slowness, its rank's node, the host restarted without
    for a in r.summary.attempts if r.summary else []:
        slow_host = next((f.host for f in a.failures if f.kind is FailureKind.SLOW), None)
        for span in slow_spans(a.health, a.ended_at):
            node = next((f"node{n.node_rank} on {n.host}" for n in a.nodes if span.rank in n.ranks), "")
            found.append((span, node, slow_host if span.acted else None))
    health = r.run.read_health(r.state.attempt) if r.summary is None else None
    if health is not None:
        for span in slow_spans(live_slowness(health), r.state.started_at + r.axis.span):
            row = health.ranks.get(span.rank)
            found.append((span, f"{row.node} on {row.host}" if row else "", None))
    if not found:
        return [], [], ""
    bands = []
    for span, node, _ in found:
        pace = "" if span.lost is None else f": the job at {1 - span.lost:.2f}x its pace before"
        bands.append(Span(r.since(span.since), r.since(span.until), "slowed",
                          f"rank {span.rank}" + (f" ({node})" if node else "") +
                          f" slow from +{r.since(span.since):.1f} s to +{r.since(span.until):.1f} s{pace}"))
    acts = [Mark(r.since(span.until), f"restart without {host}", "act", before=True)
            for span, _, host in found if host is not None]
    said = ['<span><i class="slowed"></i>shaded: a rank named slow, from the onset of its slowness to its recovery, '
            "the harness's stop for it or its attempt's end</span>"]
    said += ['<span><i class="act"></i>red line: the harness stopped the job to restart it without the slow host '
             "(restarts.on: slow; docs/health.md, A slow node)</span>"] if acts else []
    return bands, acts, '<p class="legend">' + "".join(said) + "</p>"


def _time_spent(r: _Run) -> str:
    """Where the run's time went as one bar, a bucket a color (record/goodput.py), with the seconds of each."""
    goodput = goodput_of(r.run, r.state, r.summary, time.time())
    spent = {bucket: seconds for bucket, seconds in goodput.seconds.items() if seconds > 0}
    wall = goodput.wall_s or 1.0
    bar = "".join(f'<span class="b-{bucket}" style="width:{100 * seconds / wall:.2f}%" '
                  f'title="{bucket} {seconds:.1f} s"></span>' for bucket, seconds in spent.items())
    key = "".join(f'<span><i class="b-{bucket}"></i>{bucket} {seconds:.1f} s ({100 * seconds / wall:.0f}%)</span>'
                  for bucket, seconds in spent.items())
    ending = ending_words(r.summary) if r.summary is not None else None
    return (f"<section><h2>Where the time went</h2><p>goodput {100 * goodput.goodput:.0f}%: the share of "
            f"{goodput.wall_s:.1f} s spent in training steps not done again (docs/metrics.md)</p>"
            f'<div class="spent">{bar}</div><div class="legend">{key}</div>'
            + (f"<p>ending: {escape(ending)}</p>" if ending else "") + "</section>")


def _over_steps(r: _Run) -> str:
    """The loss and throughput the ranks printed (health.progress's loss and throughput), over the run's steps;
    a restart's steps drawn again from where it resumed (a new segment)."""
    charts = []
    for key, title, read, y_text in STEP_PLOTS:
        ranks = sorted({rank for sample in r.samples for rank, point in sample.ranks.items()
                        if read(point) is not None and point.step is not None})
        drawn = _drawn(r, ranks)
        series = ([] if len(ranks) <= DRAWN_RANKS else _step_spread(r, read)) + _step_series(r, drawn, read)
        points = [point for segments in series for part in segments for point in part]
        if points:
            axis = StepAxis(max(1.0, *(step for step, _ in points)))
            chart = line_chart(axis, series, [], max(1e-9, *(value for _, value in points)), y_text)
            charts.append(f'<div id="{key}"><h3>{escape(title)}</h3>{chart}{legend(_labels(ranks, drawn))}</div>')
    if not charts:
        return ""
    return "<section><h2>Over the steps</h2>" + "".join(charts) + "</section>"


def _step_points(r: _Run, read: Callable[[RankPoint], float | None],
                 every_only: bool = False) -> Iterable[tuple[int, int, float, int]]:
    """(rank, attempt, value, step) of each sample's points with a step and a finite value, in the samples' order
    (every_only: of the samples that hold every rank)."""
    for sample in r.samples if not every_only else (sample for sample in r.samples if sample.every):
        for rank, point in sample.ranks.items():
            value = read(point)
            if point.step is not None and value is not None and math.isfinite(value):
                yield rank, sample.attempt, value, point.step


def _step_series(r: _Run, ranks: list[int], read: Callable[[RankPoint], float | None]) -> list[Segments]:
    """Each rank's values over the steps: a new segment at each attempt and where its step goes back (a resume)."""
    segments: dict[int, Segments] = {rank: [] for rank in ranks}
    attempts: dict[int, int] = {}
    for rank, attempt, value, step in _step_points(r, read):
        if (own := segments.get(rank)) is None:
            continue
        if attempts.get(rank) != attempt or step < own[-1][-1][0]:
            own.append([])
            attempts[rank] = attempt
        if not own[-1] or own[-1][-1][0] != step:
            own[-1].append((float(step), value))
    return [segments[rank] for rank in ranks]


def _step_spread(r: _Run, read: Callable[[RankPoint], float | None]) -> list[Segments]:
    """The ranks' least, median and most value at each step (each rank's first value of it), an attempt a segment."""
    by_attempt: dict[int, dict[int, dict[int, float]]] = {}  # attempt -> step -> rank -> value
    for rank, attempt, value, step in _step_points(r, read, every_only=True):
        by_attempt.setdefault(attempt, {}).setdefault(step, {}).setdefault(rank, value)
    return _spread_of([[(float(step), list(values.values())) for step, values in sorted(steps.items())]
                       for steps in by_attempt.values()])


def _drawn(r: _Run, ranks: list[int]) -> list[int]:
    """The ranks a chart draws a line of: each one, up to DRAWN_RANKS; past them (their spread is drawn instead), the
    ranks the health watch named or that failed first in an attempt, up to NAMED_DRAWN."""
    if len(ranks) <= DRAWN_RANKS:
        return ranks
    named: list[int] = []
    for a in r.summary.attempts if r.summary else []:
        named += [e.rank for e in a.health if e.rank is not None]
        named += [f.rank for f in a.failures[:1] if f.rank is not None]  # its first: the others followed from it
    if r.summary is None and (health := r.run.read_health(r.state.attempt)) is not None:
        named += sorted(health.slow)
    present = set(ranks)
    return [rank for rank in dict.fromkeys(named) if rank in present][:NAMED_DRAWN]


def _labels(ranks: list[int], drawn: list[int]) -> dict[int, str]:
    """The legend of a chart of the drawn ranks' lines, after the spread's three where there is one."""
    if len(ranks) <= DRAWN_RANKS:
        return {i: f"rank {rank}" for i, rank in enumerate(ranks)}
    return {0: f"least of the {len(ranks):,} ranks", 1: "their median", 2: "their most",
            **{3 + i: f"rank {rank}" for i, rank in enumerate(drawn)}}


_Measured = tuple[float | None, bool]  # a rank's value at a sample (None: not known); whether it goes on from before
PICKS: tuple[Callable[[list[float]], float], ...] = (min, statistics.median, max)


def _spread_of(runs: list[list[tuple[float, list[float]]]]) -> list[Segments]:
    """Each run of (x, values) as a segment of the least, of the median and of the most values."""
    found: list[Segments] = [[], [], []]
    for points in (run for run in runs if run):
        for segments, pick in zip(found, PICKS, strict=True):
            segments.append([(x, pick(values)) for x, values in points])
    return found


def _measured(samples: Sequence[Sample], measure: Measure) -> Iterable[tuple[Sample, dict[int, _Measured]]]:
    """Each sample with each of its ranks' value (None: not known there) and whether it goes on from the rank's sample
    before (the same attempt)."""
    last: dict[int, tuple[int, float, RankPoint]] = {}
    for sample in samples:
        values = {}
        for rank, point in sample.ranks.items():
            before = last.get(rank)
            last[rank] = (sample.attempt, sample.t, point)
            same = before if before is not None and before[0] == sample.attempt else None
            values[rank] = (measure(point, same[2] if same else None, sample.t - same[1] if same else 0.0),
                            same is not None)
        yield sample, values


def _series(r: _Run, samples: Sequence[Sample], ranks: list[int], measure: Measure,
            spread: bool = False) -> list[Segments]:
    """Each rank's points (in ranks' order), a new segment at every attempt and after each gap; with spread, first the
    least, median and most of every rank's value at each sample (a new segment at every attempt and after a sample
    where none has one; of the samples that hold every rank), from the same one pass over the samples."""
    segments: dict[int, Segments] = {rank: [] for rank in ranks}
    joined: set[int] = set()  # ranks whose last sample had a value: the next one continues its line
    runs: list[list[tuple[float, list[float]]]] = [[]]  # the spread's points, in runs without a gap
    attempt = None
    for sample, values in _measured(samples, measure):
        for rank, (value, same) in values.items():
            if rank not in segments:
                continue
            if value is None:
                joined.discard(rank)
                continue
            if rank not in joined or not same:
                segments[rank].append([])
                joined.add(rank)
            segments[rank][-1].append((r.since(sample.t), value))
        if spread and sample.every:  # a sample of the odd ranks alone says nothing of the others
            known = [value for value, _ in values.values() if value is not None]
            if runs[-1] and (not known or sample.attempt != attempt):
                runs.append([])
            if known:
                runs[-1].append((r.since(sample.t), known))
                attempt = sample.attempt
    return (_spread_of(runs) if spread else []) + [segments[rank] for rank in ranks]


def _first_failure(r: _Run) -> str:
    failure = r.summary.first_failure if r.summary else None
    if failure is None:
        return ""
    parts = [f"<section><h2>First failure</h2><p>{escape(failure.describe(verdict_said=True))}</p>"]
    if failure.error:
        parts.append(f"<p><strong>{escape(failure.error)}</strong></p>")
    if failure.error_at:
        parts.append(f"<p>at <code>{escape(failure.error_at)}</code></p>")
    if failure.error_source:
        parts.append(f"<pre>{escape(failure.error_source)}</pre>")
    if failure.hint:
        parts.append(f'<p class="note">hint: {escape(failure.hint)}</p>')
    if failure.last_lines:
        parts.append(f"<h3>Last lines of node{failure.node_rank}</h3><pre>{escape(chr(10).join(failure.last_lines))}"
                     f"</pre>")
    return "".join(parts) + "</section>"


def _hang_stacks(r: _Run) -> str:
    """Every hung attempt's stacks as the health watch kept them when it found the hang, worded as `harness stacks`
    words them (alike ranks once, each with the collective it waits in), folded: long, and read after the verdict."""
    attempts = [a.attempt for a in r.summary.attempts] if r.summary else list(range(r.state.attempt + 1))
    parts = []
    for attempt in attempts:
        where = r.run.hang_stacks(attempt)
        if not where.is_dir():
            continue
        try:
            stacks = kept_stacks(where)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parts.append(f"<p>attempt {attempt}: the stacks kept in <code>{escape(str(where))}</code> cannot be read "
                         f"({escape(str(exc))}).</p>")
            continue
        groups = stack_groups(stacks)
        told = (f"attempt {attempt}: {len(stacks)} rank(s), {len(groups)} different stack(s), read when the hang was "
                f"found (kept in {where}/)")
        body = "".join(f"<h3>{escape(group.head)}</h3><pre>{escape(group.body)}</pre>" for group in groups)
        parts.append(f"<details><summary>{escape(told)}</summary>{body or '<p>No rank answered.</p>'}</details>")
    return "<section><h2>Stacks at the hang</h2>" + "".join(parts) + "</section>" if parts else ""


def _nodes(r: _Run) -> str:
    parts = ["<section><h2>Nodes</h2>"]
    state, summary = r.state, r.summary
    if summary is None:
        parts.append(_table(["node", "host", "end", "log"],
                            [[f"node{rank}", host, unrecorded_end(state, r.status, rank),
                              str(r.run.log_file(rank, state.attempt))] for rank, host in enumerate(state.hosts)]))
    elif not summary.attempts:
        first = [summary.first_failure] if summary.first_failure else []
        parts.append(_node_table(r, summary.nodes, first, summary.status))
    for a in summary.attempts if summary else []:
        parts.append(f"<h3>attempt {a.attempt}: {escape(a.status.value)} on {escape(a.where(False))}</h3>"
                     + _node_table(r, a.nodes, a.failures, a.status))
    return "".join(parts) + "</section>"


def _node_table(r: _Run, nodes: Sequence[RecordedNode], failures: list[Failure], status: RunStatus) -> str:
    failed = node_failures(failures)
    return _table(["node", "host", "ranks", "end", "after", "log"],
                  [[f"node{n.node_rank}", n.host, ", ".join(map(str, n.ranks)),
                    recorded_end(n, failed.get(n.node_rank), status), f"{ended_after(n, failed.get(n.node_rank))} s",
                    str(node_log(r.run, n))]
                   for n in nodes])


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Plain text cells, every one escaped."""
    return ("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
            + "</tbody></table>")


PLOTS = (
    _Plot("cpu", "CPU use (CPUs)", _value(lambda p: p.cpu), "{:g}".format, "CPU use: no rank was sampled"),
    _Plot("waiting", "Waiting (% of the time a rank's main thread did not run: for its peers, or for I/O)",
          _value(lambda p: None if p.busy is None else 100.0 * (1.0 - p.busy)), "{:.0f}%".format,
          "waiting: no rank's busy share was measured", 100.0),
    _Plot("step-rate", "Step rate (steps/s)", _step_rate, "{:g}".format, "the step rate: no rank's step is known"),
    _Plot("gpu", "GPU use (% of the SMs' time running the rank's kernels, by the NVIDIA driver)",
          _value(lambda p: p.gpu), "{:.0f}%".format, "", 100.0),
)
# The charts over steps: (element id, title, the point's value, its tick text).
STEP_PLOTS: tuple[tuple[str, str, Callable[[RankPoint], float | None], Callable[[float], str]], ...] = (
    ("loss", "Loss (as the ranks' progress lines said it)", lambda p: p.loss, "{:.3g}".format),
    ("throughput", "Throughput (items per second, as the lines said it: the payload's img/s)", lambda p: p.throughput,
     "{:g}".format),
)
