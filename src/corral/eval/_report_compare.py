"""Two runs compared, rendered (`render_compare_markdown`, `render_compare_html`, `render_compare_json`, format
`corral-eval-comparison/1`), columns labelled with each run's adapter and start time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._comparison import Comparison, Flip, _delta, _ratio
from ._formatting import (
    SAMPLE_IDS,
    _detail,
    _round,
    _sample,
    fmt_delta,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
)
from ._report_charts import _e, svg_compare_rates
from ._report_html import _card, _page, _section, _table
from ._report_markdown import _md, _md_table
from ._summary import Group, Spread, Summary, _interrupted_note, primary_mode

COMPARISON_FORMAT = "corral-eval-comparison/1"




def _compare_category_rows(c: Comparison) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, ga, gb in c.categories:
        ra, rb = (ga.rate if ga else None), (gb.rate if gb else None)
        rows.append((name, fmt_rate(ra), fmt_rate(rb), fmt_delta(_delta(ra, rb))))
    ta, tb = c.a.total.rate, c.b.total.rate
    rows.append(("all", fmt_rate(ta), fmt_rate(tb), fmt_delta(_delta(ta, tb))))
    return rows


def _compare_latency_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name, ga, gb in (*c.categories, ("all", c.a.total, c.b.total)):
        da, db = (ga.duration if ga else Spread.of(())), (gb.duration if gb else Spread.of(()))
        rows.append((name, fmt_seconds(da.p50), fmt_seconds(db.p50), fmt_ratio(_ratio(da.p50, db.p50)),
                     fmt_seconds(da.p95), fmt_seconds(db.p95), fmt_ratio(_ratio(da.p95, db.p95))))
    return rows


def _compare_headers(c: Comparison) -> dict[str, tuple[str, ...]]:
    la, lb = c.labels
    return {
        "totals": ("", la, lb),
        "categories": ("Category", la, lb, "Delta"),
        "modes": ("Mode", "Severity", la, lb, "Change"),
        "p2f": ("Task", "Category", f"Mode ({lb})", "First failure"),
        "f2p": ("Task", "Category", f"Mode ({la})"),
        "latency": ("Category", f"p50 {la}", f"p50 {lb}", "Ratio", f"p95 {la}", f"p95 {lb}", "Ratio"),
    }


def _compare_totals_rows(c: Comparison) -> list[tuple[str, str, str]]:
    a, b = c.a, c.b
    return [
        ("Pass rate", fmt_rate(a.total.rate), fmt_rate(b.total.rate)),
        ("Passed", str(a.total.passed), str(b.total.passed)),
        ("Failed", str(a.total.failed), str(b.total.failed)),
        ("Skipped", str(a.total.skipped), str(b.total.skipped)),
        ("Tasks", str(a.total.total), str(b.total.total)),
        ("Wall time", fmt_seconds(a.wall_seconds), fmt_seconds(b.wall_seconds)),
        ("Complete", "yes" if a.complete else "no (interrupted)", "yes" if b.complete else "no (interrupted)"),
    ]


def _mode_rows(c: Comparison) -> list[tuple[str, str, int, int, str]]:
    return [(m.title, m.severity, na, nb, f"{nb - na:+d}" if nb != na else "0") for m, na, nb in c.modes]


def _flip_rows(flips: Sequence[Flip], after: bool) -> list[tuple[str, ...]]:
    if after:
        return [(f.id, f.category, primary_mode(f.after), _detail(f.after)) for f in flips]
    return [(f.id, f.category, primary_mode(f.before)) for f in flips]


def _only_line(label: str, ids: Sequence[str]) -> str:
    if not ids:
        return f"Only in {label}: none"
    more = f", and {len(ids) - SAMPLE_IDS} more" if len(ids) > SAMPLE_IDS else ""
    return f"Only in {label}: {len(ids)} ({', '.join(_sample(ids))}{more})"


def render_compare_markdown(c: Comparison) -> str:
    """Two runs side by side, as Markdown."""
    la, lb = c.labels
    h = _compare_headers(c)
    lines = [f"# Corral eval comparison: {_md(la)} vs {_md(lb)}", ""]
    for s in (c.a, c.b):
        if not s.complete:
            lines += [f"> **{_md(s.label)}: {_md(_interrupted_note(s))}**", ""]
    lines += [*_md_table(h["totals"], _compare_totals_rows(c), (1, 2)), ""]
    lines += ["## Pass rate by category", "", *_md_table(h["categories"], _compare_category_rows(c), (1, 2, 3)), ""]
    lines += ["## Failure modes", ""]
    lines += _md_table(h["modes"], _mode_rows(c), (2, 3, 4)) if c.modes else ["No task failed in either run."]
    lines += ["", f"## Pass -> fail ({len(c.pass_to_fail)})", ""]
    lines += _md_table(h["p2f"], _flip_rows(c.pass_to_fail, True)) if c.pass_to_fail else ["None."]
    lines += ["", f"## Fail -> pass ({len(c.fail_to_pass)})", ""]
    lines += _md_table(h["f2p"], _flip_rows(c.fail_to_pass, False)) if c.fail_to_pass else ["None."]
    lines += ["", "## Tasks in one run only", "", f"- {_md(_only_line(la, c.only_a))}",
              f"- {_md(_only_line(lb, c.only_b))}", ""]
    lines += ["## Task duration", "", "Ratio is b/a: above 1 means the second run was slower.", "",
              *_md_table(h["latency"], _compare_latency_rows(c), range(1, 7))]
    return "\n".join(lines) + "\n"


def render_compare_html(c: Comparison) -> str:
    """Two runs side by side, as one self-contained HTML page."""
    la, lb = c.labels
    h = _compare_headers(c)
    banners = "".join(f'<div class="banner" role="alert">{_e(s.label)}: {_e(_interrupted_note(s))}</div>'
                      for s in (c.a, c.b) if not s.complete)
    delta = _delta(c.a.total.rate, c.b.total.rate)
    trend = "" if delta is None or abs(delta) < 0.0005 else ("up" if delta > 0 else "down")
    cards = ('<div class="cards">' + _card(la, _e(fmt_rate(c.a.total.rate))) + _card(lb, _e(fmt_rate(c.b.total.rate)))
             + _card("Change", f'<span class="{trend}">{_e(fmt_delta(delta))}</span>', "hero")
             + _card("Pass → fail", str(len(c.pass_to_fail))) + _card("Fail → pass", str(len(c.fail_to_pass)))
             + "</div>")
    body = [
        f"<header><h1>Corral eval comparison</h1><p>{_e(la)} vs {_e(lb)}</p></header>", banners, cards,
        _section("Totals", _table(h["totals"], _compare_totals_rows(c), (1, 2))),
        _section("Pass rate by category", svg_compare_rates(c.categories, c.labels),
                 _table(h["categories"], _compare_category_rows(c), (1, 2, 3), tone={3: 1})),
        _section("Failure modes", _table(h["modes"], _mode_rows(c), (2, 3, 4), tone={4: -1}) if c.modes
                 else '<p class="muted">No task failed in either run.</p>'),
        _section(f"Pass → fail ({len(c.pass_to_fail)})",
                 _table(h["p2f"], _flip_rows(c.pass_to_fail, True), cls="flips p2f") if c.pass_to_fail
                 else '<p class="muted">None.</p>'),
        _section(f"Fail → pass ({len(c.fail_to_pass)})",
                 _table(h["f2p"], _flip_rows(c.fail_to_pass, False), cls="flips f2p") if c.fail_to_pass
                 else '<p class="muted">None.</p>'),
        _section("Tasks in one run only",
                 f"<p>{_e(_only_line(la, c.only_a))}</p><p>{_e(_only_line(lb, c.only_b))}</p>"),
        _section("Task duration", '<p class="muted">Ratio is b/a: above 1 means the second run was slower.</p>',
                 _table(h["latency"], _compare_latency_rows(c), range(1, 7))),
    ]
    return _page(f"Corral eval comparison: {la} vs {lb}", body)


def render_compare_json(c: Comparison) -> dict[str, Any]:
    """Two runs compared, for machines."""
    return {
        "format": COMPARISON_FORMAT,
        "a": _run_json(c.a, c.labels[0]),
        "b": _run_json(c.b, c.labels[1]),
        "pass_rate": {"a": _round(c.a.total.rate, 6), "b": _round(c.b.total.rate, 6),
                      "delta": _round(_delta(c.a.total.rate, c.b.total.rate), 6)},
        "categories": {name: _category_compare_json(ga, gb) for name, ga, gb in c.categories},
        "modes": [{"name": m.name, "severity": m.severity, "title": m.title, "a": na, "b": nb}
                  for m, na, nb in c.modes],
        "pass_to_fail": [{"id": f.id, "category": f.category, "mode": primary_mode(f.after),
                          "detail": f.after.failures[0].detail if f.after.failures else ""}
                         for f in c.pass_to_fail],
        "fail_to_pass": [{"id": f.id, "category": f.category, "mode": primary_mode(f.before)}
                         for f in c.fail_to_pass],
        "only_in_a": list(c.only_a),
        "only_in_b": list(c.only_b),
    }


def _run_json(s: Summary, label: str) -> dict[str, Any]:
    return {"label": label, "adapter": s.adapter, "started": s.run.header.get("started"), "complete": s.complete,
            "wall_seconds": s.wall_seconds, "totals": s.total.to_json(latency=False)}


def _category_compare_json(ga: Group | None, gb: Group | None) -> dict[str, Any]:
    ra, rb = (ga.rate if ga else None), (gb.rate if gb else None)
    da, db = (ga.duration if ga else Spread.of(())), (gb.duration if gb else Spread.of(()))
    return {
        "pass_rate_a": _round(ra, 6), "pass_rate_b": _round(rb, 6), "delta": _round(_delta(ra, rb), 6),
        "p50_a": _round(da.p50), "p50_b": _round(db.p50), "p50_ratio": _round(_ratio(da.p50, db.p50)),
        "p95_a": _round(da.p95), "p95_b": _round(db.p95), "p95_ratio": _round(_ratio(da.p95, db.p95)),
    }
