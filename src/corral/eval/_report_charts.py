"""The HTML report's charts, drawn here as inline SVG (no external resources): pass rate by category, failure
modes coloured by severity, latency on a log axis, and two runs' pass rates side by side; every text escaped."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from ._formatting import fmt_rate, fmt_seconds, oneline
from ._summary import Group, ModeCount, Spread


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


SEVERITY_COLORS = {"critical": "#b4232c", "high": "#e8590c", "medium": "#d49a00", "low": "#7a8594"}
_CHART_WIDTH = 760


def _rate_class(rate: float | None) -> str:
    if rate is None:
        return "none"
    return "good" if rate >= 0.99 else "fair" if rate >= 0.9 else "poor"


def _svg(height: int, body: list[str], label: str) -> str:
    return (f'<svg class="chart" role="img" aria-label="{_e(label)}" viewBox="0 0 {_CHART_WIDTH} {height}" '
            f'width="100%" preserveAspectRatio="xMinYMin meet" xmlns="http://www.w3.org/2000/svg">'
            f'<title>{_e(label)}</title>{"".join(body)}</svg>')


def _svg_text(x: float, y: float, text: str, cls: str = "", anchor: str = "start") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}" '
            f'dominant-baseline="middle">{_e(text)}</text>')


def svg_pass_rates(groups: Sequence[Group]) -> str:
    """Horizontal bars, one per category that ran, on a 0..100% axis; a category whose tasks were all
    skipped gets a label and no bar."""
    left, width, row = 150, 460, 30
    top = 22
    height = top + row * len(groups) + 8
    body = [_axis_percent(left, width, top, height - 6)]
    for n, g in enumerate(groups):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, g.name, "label", "end"))
        body.append(f'<rect class="track" x="{left}" y="{y + 6}" width="{width}" height="{row - 12}" rx="3"/>')
        if g.rate is not None:
            tip = f"{g.name}: {fmt_rate(g.rate)} ({g.passed} of {g.ran} passed)"
            body.append(f'<rect class="bar rate-{_rate_class(g.rate)}" data-label="{_e(g.name)}" '
                        f'data-value="{g.rate:.6f}" x="{left}" y="{y + 6}" width="{g.rate * width:.1f}" '
                        f'height="{row - 12}" rx="3"><title>{_e(tip)}</title></rect>')
        value = f"{fmt_rate(g.rate)}  {g.passed}/{g.ran}" if g.rate is not None else "all skipped"
        body.append(_svg_text(left + width + 10, y + row / 2, value, "value"))
    return _svg(height, body, "Pass rate by category")


def _axis_percent(left: int, width: int, top: int, bottom: int) -> str:
    parts = []
    for pct in (0, 25, 50, 75, 100):
        x = left + width * pct / 100
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}"/>')
        parts.append(_svg_text(x, top - 10, f"{pct}%", "tick", "middle"))
    return "".join(parts)


def svg_modes(modes: Sequence[ModeCount]) -> str:
    """Horizontal bars, one per failure mode, as long as its count and coloured by its severity."""
    left, width, row = 290, 380, 28
    top = 8
    height = top + row * len(modes) + 8
    most = max((m.count for m in modes), default=1)
    body: list[str] = []
    for n, m in enumerate(modes):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, oneline(m.mode.title, 42), "label", "end"))
        tip = f"{m.mode.title} ({m.mode.severity}): {m.count}. The user saw: {m.mode.seen}"
        body.append(f'<rect class="bar sev-{_e(m.mode.severity)}" data-label="{_e(m.mode.name)}" '
                    f'data-value="{m.count}" data-severity="{_e(m.mode.severity)}" x="{left}" y="{y + 5}" '
                    f'width="{max(2.0, width * m.count / most):.1f}" height="{row - 10}" rx="3" '
                    f'fill="{SEVERITY_COLORS.get(m.mode.severity, "#888")}"><title>{_e(tip)}</title></rect>')
        body.append(_svg_text(left + width * m.count / most + 8, y + row / 2, str(m.count), "value"))
    return _svg(height, body, "Failure modes by severity and count")


def _log_domain(groups: Sequence[Group]) -> tuple[float, float] | None:
    """Powers of ten that hold every positive timing, or None when there is none."""
    values = [v for g in groups for sp in (g.duration, g.create) for v in (sp.p50, sp.p95, sp.max)
              if v is not None and v > 0]
    if not values:
        return None
    lo = 10.0 ** math.floor(math.log10(max(min(values), 0.001)))
    hi = 10.0 ** math.ceil(math.log10(max(values)))
    return (lo, hi if hi > lo else lo * 10)


def svg_latency(groups: Sequence[Group]) -> str:
    """Per category, task duration and sandbox create time on a log axis: a box from p50 to p95, a whisker
    to the max, a tick at p50."""
    domain = _log_domain(groups)
    if domain is None:
        return '<p class="muted">No timings recorded.</p>'
    left, width, row, top = 150, 330, 40, 26
    height = top + row * len(groups) + 10

    def x(v: float) -> float:
        lo, hi = domain
        return left + width * (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    body = [_axis_log(domain, x, top, height - 6)]
    for n, g in enumerate(groups):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, g.name, "label", "end"))
        for series, spread, dy in (("duration", g.duration, 12), ("create", g.create, 28)):
            body.append(_latency_marks(g.name, series, spread, x, y + dy))
        d = g.duration
        text = f"p50 {fmt_seconds(d.p50)} · p95 {fmt_seconds(d.p95)} · max {fmt_seconds(d.max)}"
        body.append(_svg_text(left + width + 16, y + 12, text, "value small"))
        text = f"create p50 {fmt_seconds(g.create.p50)} · p95 {fmt_seconds(g.create.p95)}"
        body.append(_svg_text(left + width + 16, y + 28, text, "value small muted"))
    return _svg(height, body, "Latency by category (log scale)")


def _axis_log(domain: tuple[float, float], x: Callable[[float], float], top: int, bottom: int) -> str:
    parts = []
    decade = domain[0]
    while decade <= domain[1] * 1.0001:
        parts.append(f'<line class="grid" x1="{x(decade):.1f}" y1="{top}" x2="{x(decade):.1f}" y2="{bottom}"/>')
        parts.append(_svg_text(x(decade), top - 12, _decade_label(decade), "tick", "middle"))
        decade *= 10
    return "".join(parts)


def _decade_label(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.0f} s"


def _latency_marks(name: str, series: str, sp: Spread, x: Callable[[float], float], y: float) -> str:
    if sp.p50 is None or sp.p95 is None or sp.max is None:
        return ""
    half = 5 if series == "duration" else 3.5
    tip = f"{name} {series}: p50 {fmt_seconds(sp.p50)}, p95 {fmt_seconds(sp.p95)}, max {fmt_seconds(sp.max)} (n={sp.n})"
    return (f'<g class="lat lat-{series}" data-label="{_e(name)}" data-series="{series}" data-p50="{sp.p50:.6f}" '
            f'data-p95="{sp.p95:.6f}" data-max="{sp.max:.6f}"><title>{_e(tip)}</title>'
            f'<line class="whisker" x1="{x(sp.p95):.1f}" y1="{y:.1f}" x2="{x(sp.max):.1f}" y2="{y:.1f}"/>'
            f'<line class="cap" x1="{x(sp.max):.1f}" y1="{y - half:.1f}" x2="{x(sp.max):.1f}" y2="{y + half:.1f}"/>'
            f'<rect class="box" x="{x(sp.p50):.1f}" y="{y - half:.1f}" width="{max(2.0, x(sp.p95) - x(sp.p50)):.1f}" '
            f'height="{2 * half:.1f}" rx="2"/>'
            f'<line class="median" x1="{x(sp.p50):.1f}" y1="{y - half - 2:.1f}" x2="{x(sp.p50):.1f}" '
            f'y2="{y + half + 2:.1f}"/></g>')


def svg_compare_rates(rows: Sequence[tuple[str, Group | None, Group | None]], labels: tuple[str, str]) -> str:
    """Per category, the pass rate of run A and of run B as two bars, one above the other."""
    left, width, row, top = 150, 440, 40, 40
    height = top + row * len(rows) + 8
    body = [_axis_percent(left, width, top, height - 6), _legend(labels, left)]
    for n, (name, ga, gb) in enumerate(rows):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, name, "label", "end"))
        for run, g, dy in (("a", ga, 6), ("b", gb, 21)):
            rate = g.rate if g is not None else None
            if rate is not None:
                body.append(f'<rect class="bar run-{run}" data-run="{run}" data-label="{_e(name)}" '
                            f'data-value="{rate:.6f}" x="{left}" y="{y + dy}" width="{rate * width:.1f}" '
                            f'height="13" rx="2"><title>{_e(labels[run == "b"])}: {_e(fmt_rate(rate))}</title></rect>')
            body.append(_svg_text(left + width + 10, y + dy + 6.5, fmt_rate(rate), f"value run-{run}-text"))
    return _svg(height, body, "Pass rate by category, both runs")


def _legend(labels: tuple[str, str], left: int) -> str:
    return (f'<rect class="run-a" x="{left}" y="2" width="12" height="12" rx="2"/>'
            + _svg_text(left + 18, 8, labels[0], "legend")
            + f'<rect class="run-b" x="{left + 330}" y="2" width="12" height="12" rx="2"/>'
            + _svg_text(left + 348, 8, labels[1], "legend"))
