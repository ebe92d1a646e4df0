"""A run's report as one self-contained HTML page (`render_html`): inline CSS, the charts of `_report_charts.py`,
tables, and every string from a results file escaped (it comes from untrusted sandboxes)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._formatting import SAMPLE_IDS, _detail, _sample, _where, fmt_rate, fmt_seconds
from ._report_charts import SEVERITY_COLORS, _e, _rate_class, svg_latency, svg_modes, svg_pass_rates
from ._result import RunResults
from ._summary import Summary, _interrupted_note, primary_mode, summarize


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = (),
           cls: str = "", tone: dict[int, int] | None = None) -> str:
    """An HTML table; every cell is escaped. Columns whose index is in `right` are numbers; a column in `tone`
    is a change, coloured as better or worse by its sign (+1: a rise is better, -1: a rise is worse)."""
    right, tone = set(right), tone or {}

    def cell(tag: str, n: int, value: object) -> str:
        classes = " ".join(c for c in ("num" if n in right else "", _tone(value, tone.get(n, 0))) if c)
        return f'<{tag} class="{classes}">{_e(value)}</{tag}>' if classes else f"<{tag}>{_e(value)}</{tag}>"

    head = "".join(cell("th", n, h) for n, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", n, v) for n, v in enumerate(row)) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_CSS = """
:root{--bg:#f6f7f9;--card:#fff;--ink:#1d2330;--muted:#667085;--line:#e4e7ec;--track:#eef0f4;
--good:#1f9d55;--fair:#d49a00;--poor:#c92a2a;--a:#5b6b8c;--b:#2f6fed;--accent:#2f6fed}
@media (prefers-color-scheme:dark){:root{--bg:#12151b;--card:#1b1f27;--ink:#e6e9ef;--muted:#98a2b3;
--line:#2c323d;--track:#262b35;--a:#8b98b3;--b:#5b8cff}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif}
main{max-width:1100px;margin:0 auto;padding:32px 24px 64px}
header h1{font-size:28px;margin:0 0 4px;letter-spacing:-.01em}
header p{margin:0;color:var(--muted)}
h2{font-size:19px;margin:0 0 12px}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:20px 22px;margin:20px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:12px;margin:22px 0}
.card{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:14px 16px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.06em}
.card .v{font-size:26px;font-weight:650;font-variant-numeric:tabular-nums}
.card.hero .v{font-size:34px}
.rate-good{color:var(--good);fill:var(--good)}.rate-fair{color:var(--fair);fill:var(--fair)}
.rate-poor{color:var(--poor);fill:var(--poor)}
.banner{background:#fff4e5;color:#7a4100;border:1px solid #f5c27a;border-radius:10px;padding:12px 16px;
margin:18px 0;font-weight:600}
table{width:100%;border-collapse:collapse;font-size:14px}
th,td{text-align:left;padding:7px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--muted);font-weight:600;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:hover{background:var(--track)}
td{overflow-wrap:anywhere}table.failed td:nth-child(2),table.failed td:nth-child(3){white-space:nowrap}
.muted{color:var(--muted)}
.chart{display:block;max-width:100%;height:auto;margin:4px 0 14px}
.chart text{font-size:12px;fill:var(--ink)}.chart .tick,.chart .muted{fill:var(--muted);font-size:11px}
.chart .value{font-variant-numeric:tabular-nums}.chart .small{font-size:11px}
.chart .track{fill:var(--track)}.chart .grid{stroke:var(--line);stroke-width:1}
.chart .lat-duration .box{fill:var(--accent);opacity:.85}.chart .lat-create .box{fill:#8e6bd6;opacity:.85}
.chart .whisker,.chart .cap{stroke:var(--muted);stroke-width:1.5}.chart .median{stroke:var(--ink);stroke-width:2}
.chart .run-a{fill:var(--a)}.chart .run-b{fill:var(--b)}
.sev{display:inline-block;padding:1px 8px;border-radius:99px;color:#fff;font-size:12px;font-weight:600}
.modes li{margin:0 0 10px;list-style:none}.modes{padding:0;margin:0}
.modes .seen{color:var(--muted)}
.up{color:var(--good)}.down{color:var(--poor)}
details summary{cursor:pointer;color:var(--muted)}
footer{color:var(--muted);font-size:13px;text-align:center;margin-top:28px}
"""


def _tone(value: object, sign: int) -> str:
    text = str(value)
    if not sign or not text.startswith(("+", "-")):  # "0" and "±0.0 pp" are no change
        return ""
    return "up" if (text.startswith("+")) == (sign > 0) else "down"


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
            + "".join(body)
            + "<footer>Generated by corral eval report.</footer></main></body></html>\n")


def _section(title: str, *parts: str) -> str:
    return f"<section><h2>{_e(title)}</h2>{''.join(parts)}</section>"


def _card(key: str, value: str, cls: str = "") -> str:
    return f'<div class="card {cls}"><div class="k">{_e(key)}</div><div class="v">{value}</div></div>'


def _severity_badge(severity: str) -> str:
    color = SEVERITY_COLORS.get(severity, "#888")
    return f'<span class="sev" style="background:{color}">{_e(severity)}</span>'


def render_html(run: RunResults) -> str:
    """The report of one run as one self-contained HTML page."""
    s = summarize(run)
    body = [_html_header(s), _html_overview(s), _html_modes(s), _html_failed(s), _html_skipped(s),
            _html_latency(s), _html_families(s)]
    return _page(f"Corral eval: {s.adapter}, {s.started}", body)


def _html_header(s: Summary) -> str:
    t = s.total
    head = (f"<header><h1>Corral eval: {_e(s.adapter)}</h1><p>Started {_e(s.started)} · {t.total} tasks"
            + (f" of {s.planned} planned" if s.planned is not None and s.planned != t.total else "")
            + f" · wall time {_e(fmt_seconds(s.wall_seconds))}</p></header>")
    banner = "" if s.complete else f'<div class="banner" role="alert">{_e(_interrupted_note(s))}</div>'
    cards = ('<div class="cards">'
             + _card("Pass rate", f'<span class="rate-{_rate_class(t.rate)}">{_e(fmt_rate(t.rate))}</span>', "hero")
             + _card("Passed", str(t.passed)) + _card("Failed", str(t.failed))
             + _card("Skipped (not counted)", str(t.skipped))
             + _card("Wall time", _e(fmt_seconds(s.wall_seconds))) + "</div>")
    return head + banner + cards


def _html_overview(s: Summary) -> str:
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate), fmt_seconds(g.duration.p50),
             fmt_seconds(g.duration.p95)) for g in (*s.categories, s.total)]
    table = _table(("Category", "Passed", "Failed", "Skipped", "Rate", "p50", "p95"), rows, range(1, 7))
    return _section("Pass rate by category", svg_pass_rates(s.categories), table)


def _html_modes(s: Summary) -> str:
    if not s.modes:
        return _section("Failure modes", '<p class="muted">No task failed.</p>')
    items = "".join(
        f"<li>{_severity_badge(m.mode.severity)} <strong>{_e(m.mode.title)}</strong> "
        f'<span class="muted">({_e(m.mode.name)})</span> · {m.count} {"task" if m.count == 1 else "tasks"}'
        f'<br><span class="seen">The user saw: {_e(m.mode.seen)}.</span></li>'
        for m in s.modes)
    return _section("Failure modes", '<p class="muted">Ranked by severity, then by count.</p>',
                    svg_modes(s.modes), f'<ul class="modes">{items}</ul>')


def _html_failed(s: Summary) -> str:
    if not s.failed:
        return ""
    rows = [(r.id, primary_mode(r), _where(r), _detail(r)) for r in s.failed]
    return _section(f"Failed tasks ({len(s.failed)})",
                    _table(("Task", "Mode", "Where", "First failure"), rows, cls="failed"))


def _html_skipped(s: Summary) -> str:
    if not s.skipped:
        return ""
    rows = [(reason, len(ids), ", ".join(_sample(ids)) + (" …" if len(ids) > SAMPLE_IDS else ""))
            for reason, ids in s.skipped]
    return _section(f"Skipped tasks ({s.total.skipped})", _table(("Reason", "Tasks", "Examples"), rows, (1,)))


def _html_latency(s: Summary) -> str:
    rows = [(g.name, g.ran, *(fmt_seconds(v) for v in (g.duration.p50, g.duration.p95, g.duration.max,
                                                       g.create.p50, g.create.p95, g.create.max)))
            for g in (*s.categories, s.total)]
    headers = ("Category", "Ran", "Task p50", "Task p95", "Task max", "Create p50", "Create p95", "Create max")
    note = ('<p class="muted">Task duration (blue) is sandbox create to destroy; create (purple) is the create '
            "call alone. Box: p50 to p95; whisker: to the max; log scale.</p>")
    return _section("Latency", note, svg_latency(s.categories), _table(headers, rows, range(1, 8)))


def _html_families(s: Summary) -> str:
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate))
            for g in sorted(s.families, key=lambda g: (g.rate if g.rate is not None else 2.0, g.name))]
    table = _table(("Family", "Passed", "Failed", "Skipped", "Rate"), rows, range(1, 5))
    return _section(f"Families ({len(s.families)})",
                    f"<details><summary>Pass rate of every family, lowest first</summary>{table}</details>")
