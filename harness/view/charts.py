"""The charts of `harness report` as inline SVG, written by hand: lines over time (per-rank CPU, waiting,
step rate) and a run's attempts as bars on the same time axis, so that every chart of a page lines up.

Why not matplotlib: these charts are a few dozen elements each. matplotlib with `svg.fonttype: path`
(needed for a page that fetches no font) draws every glyph as a path, tens of KB a plot, costs a second
to import, and leaves text that cannot be searched or copied; plain <text> in the reader's own font is
smaller, selectable, and still fetches nothing. Every string given here is escaped."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 960
LEFT, RIGHT = 72, 16  # room for the y labels; the plot spans the rest
# Colors for lines, one per series in turn (matplotlib's tab10: told apart by most readers).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")

Segments = list[list[tuple[float, float]]]  # a series' points (x, y), broken where it was not measured


def color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def nice_step(extent: float, count: int) -> float:
    """A round step (1, 2 or 5 times a power of ten) that cuts extent into about count parts."""
    raw = max(extent, 1e-9) / count
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


@dataclass(frozen=True)
class TimeAxis:
    """x: seconds since the run started, from 0 to span."""

    span: float

    def x(self, t: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * min(max(t, 0.0), self.span) / self.span

    def grid(self, top: float, bottom: float) -> str:
        """Vertical lines at round times, labelled below bottom in s, min or h as the span suits."""
        unit, name = next((u, n) for u, n in ((3600, "h"), (60, "min"), (1, "s")) if self.span >= 5 * u or u == 1)
        step = nice_step(self.span / unit, 8) * unit
        parts = []
        for i in range(int(self.span / step) + 1):
            x = self.x(i * step)
            parts.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}"/>'
                         f'<text class="tick" x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">'
                         f'{i * step / unit:g} {name}</text>')
        return "".join(parts)


class StepAxis(TimeAxis):
    """x: the run's step, from 0 to span (the loss and throughput the ranks printed, over their steps)."""

    def grid(self, top: float, bottom: float) -> str:
        step = max(1.0, nice_step(self.span, 8))
        return "".join(f'<line class="grid" x1="{self.x(i * step):.1f}" y1="{top}" x2="{self.x(i * step):.1f}" '
                       f'y2="{bottom}"/><text class="tick" x="{self.x(i * step):.1f}" y="{bottom + 14}" '
                       f'text-anchor="middle">{"step " * (i == 0)}{i * step:g}</text>'
                       for i in range(int(self.span / step) + 1))


@dataclass(frozen=True)
class Mark:
    """A moment worth a vertical line across a chart: an attempt's start; css: its class (the harness's action: `act`);
    before: its label left of the line (one that comes just before another mark's)."""

    at: float
    label: str
    css: str = "mark"
    before: bool = False


def line_chart(axis: TimeAxis, series: Sequence[Segments], marks: Sequence[Mark], y_max: float,
               y_text: Callable[[float], str], height: int = 220, bands: Sequence[Span] = ()) -> str:
    """One line per series (colored in turn, as color(i)), y from 0 to y_max rounded up to a round step; a segment
    of one point (a short run's, or one between gaps) is a dot, big enough to be seen. bands: stretches shaded
    behind the lines, each in its CSS class, with a tooltip."""
    top, bottom = 18, height - 24
    step = nice_step(y_max, 4)
    y_top = step * max(1, math.ceil(y_max / step - 1e-9))

    def y(value: float) -> float:
        return bottom - (bottom - top) * min(value, y_top) / y_top

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img">',
             axis.grid(top, bottom)]
    for i in range(round(y_top / step) + 1):
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{y(i * step):.1f}" x2="{WIDTH - RIGHT}" '
                     f'y2="{y(i * step):.1f}"/><text class="tick" x="{LEFT - 6}" y="{y(i * step) + 4:.1f}" '
                     f'text-anchor="end">{escape(y_text(i * step))}</text>')
    parts += [f'<rect class="{escape(band.css)}" x="{axis.x(band.start):.1f}" y="{top}" '
              f'width="{max(axis.x(band.end) - axis.x(band.start), 1):.1f}" height="{bottom - top}">'
              f'<title>{escape(band.title)}</title></rect>' for band in bands]
    parts += _marks(axis, marks, top, bottom)
    for index, segments in enumerate(series):
        for points in segments:
            coords = " ".join(f"{axis.x(px):.1f},{y(py):.1f}" for px, py in points)
            parts.append(f'<polyline fill="none" stroke="{color(index)}" stroke-width="1.5" points="{coords}"/>'
                         if len(points) > 1 else
                         f'<circle fill="{color(index)}" r="3" cx="{axis.x(points[0][0]):.1f}" '
                         f'cy="{y(points[0][1]):.1f}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _marks(axis: TimeAxis, marks: Sequence[Mark], top: float, bottom: float) -> list[str]:
    parts = []
    for m in marks:
        x = axis.x(m.at)
        label = f'x="{x - 3:.1f}" y="{top - 8}" text-anchor="end"' if m.before else f'x="{x + 3:.1f}" y="{top - 8}"'
        parts.append(f'<line class="{escape(m.css)}" x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{bottom}"/>'
                     f'<text class="{escape(m.css)}" {label}>{escape(m.label)}</text>')
    return parts


@dataclass(frozen=True)
class Span:
    """A stretch of a row: start to end seconds, drawn in its CSS class, with a tooltip."""

    start: float
    end: float
    css: str
    title: str


@dataclass(frozen=True)
class Dot:
    """A moment in a row (a verdict, a failure), drawn by its CSS class, with a tooltip."""

    at: float
    css: str
    title: str


@dataclass(frozen=True)
class Row:
    label: str
    spans: Sequence[Span]
    dots: Sequence[Dot]


ROW_HEIGHT = 30


def rows_chart(axis: TimeAxis, rows: Sequence[Row]) -> str:
    """One row per attempt: its spans as bars, its moments as marks on them (a failure as a cross)."""
    top = 8
    bottom = top + ROW_HEIGHT * len(rows)
    height = bottom + 24
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img">',
             axis.grid(top, bottom)]
    for index, row in enumerate(rows):
        mid = top + ROW_HEIGHT * index + ROW_HEIGHT / 2
        parts.append(f'<text class="label" x="{LEFT - 6}" y="{mid + 4}" text-anchor="end">{escape(row.label)}</text>')
        for span in row.spans:
            x0, x1 = axis.x(span.start), axis.x(span.end)
            parts.append(f'<rect class="{escape(span.css)}" x="{x0:.1f}" y="{mid - 9}" width="{max(x1 - x0, 1):.1f}" '
                         f'height="18" rx="3"><title>{escape(span.title)}</title></rect>')
        for dot in row.dots:
            x = axis.x(dot.at)
            shape = (f'<path d="M{x - 5:.1f},{mid - 5} l10,10 m0,-10 l-10,10"/>' if dot.css == "failure" else
                     f'<circle cx="{x:.1f}" cy="{mid}" r="5"/>')
            parts.append(f'<g class="{escape(dot.css)}">{shape}<title>{escape(dot.title)}</title></g>')
    parts.append("</svg>")
    return "".join(parts)


def legend(labels: Mapping[int, str]) -> str:
    """An HTML legend of series colors: labels by series index."""
    return '<p class="legend">' + "".join(
        f'<span><i style="background:{color(i)}"></i>{escape(text)}</span>' for i, text in labels.items()) + "</p>"
