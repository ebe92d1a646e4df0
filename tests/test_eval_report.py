"""Reports of evaluation runs, from synthetic results with known numbers (no sandboxes)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from corral.eval._formatting import fmt_rate, oneline
from corral.eval._report import (
    compare,
    percentile,
    render_compare_html,
    render_compare_json,
    render_compare_markdown,
    render_html,
    render_json,
    render_markdown,
    summarize,
    write_comparison,
    write_report,
)
from corral.eval._result import RunResults, TaskFailure, TaskResult
from corral.eval._taxonomy import MODES

HOSTILE_ID = "file_io.evil/<script>alert(1)</script>"
HOSTILE_DETAIL = 'got <img src=x onerror=alert(1)> " onmouseover="x | next\ncell \x1b[31mred'


def task(tid: str, status: str = "pass", *, category: str = "file_io", duration: float = 1.0,
         mode: str | None = None, detail: str = "", create: float | None = 0.2, reason: str = "",
         family: str | None = None, step: int = 1) -> TaskResult:
    failures = (TaskFailure(step, mode, detail or f"{mode} in {tid}"),) if mode else ()
    return TaskResult(id=tid, family=family or tid.split("/")[0], category=category, severity="high",
                      status=status, duration=duration, mode=mode, failures=failures,  # type: ignore[arg-type]
                      create_seconds=create if status != "skip" else None, skip_reason=reason)


def run_of(results: list[TaskResult], *, adapter: str = "corral", started: str = "2025-06-01T10:00:00+00:00",
           complete: bool = True, planned: int | None = None) -> RunResults:
    header = {"type": "run", "adapter": adapter, "started": started, "tasks": planned or len(results),
              "concurrency": 4, "seed": 1}
    end = {"type": "end", "finished": "2025-06-01T10:05:00+00:00", "wall_seconds": 301.5,
           "counts": {"pass": 0, "fail": 0, "skip": 0}} if complete else None
    return RunResults(header, results, end)


def sample_run() -> RunResults:
    """file_io: 3 pass, 1 fail, 2 skip; packages: 1 pass, 3 fail; security: 2 skip only.
    Modes: wrong_result (medium) x2, lost_state (high) x1, binary_corruption (critical) x1."""
    return run_of([
        task("f.a/1", duration=1.0, create=0.1),
        task("f.a/2", duration=2.0, create=0.2),
        task("f.a/3", duration=3.0, create=None),
        task("f.b/1", "fail", duration=4.0, create=0.4, mode="binary_corruption", detail="sha256 differs"),
        task("f.b/2", "skip", reason="adapter lacks 'archive'"),
        task("f.b/3", "skip", reason="adapter lacks 'archive'"),
        task("p.a/1", category="packages", duration=10.0, create=0.3),
        task("p.a/2", "fail", category="packages", duration=20.0, create=0.3, mode="wrong_result"),
        task("p.a/3", "fail", category="packages", duration=30.0, create=0.3, mode="wrong_result"),
        task("p.b/1", "fail", category="packages", duration=40.0, create=0.3, mode="lost_state"),
        task("s.a/1", "skip", category="security", reason="adapter lacks 'pause'"),
        task("s.a/2", "skip", category="security", reason=""),
    ])


# --------------------------------------------------------------------------------------------------------------
# Numbers


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 21)), 95) == pytest.approx(19.05)
    assert percentile([7.0], 95) == 7.0
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_pass_rate_counts_only_tasks_that_ran() -> None:
    s = summarize(sample_run())
    assert (s.total.passed, s.total.failed, s.total.skipped) == (4, 4, 4)
    assert s.total.rate == pytest.approx(0.5)
    cats = {g.name: g for g in s.categories}
    assert [g.name for g in s.categories] == ["file_io", "packages", "security"]  # CATEGORIES order
    assert cats["file_io"].rate == pytest.approx(0.75)
    assert cats["packages"].rate == pytest.approx(0.25)
    assert cats["security"].rate is None  # all skipped: no rate, not 0%

    # Skipping more tasks changes nothing.
    more = sample_run()
    more.results += [task(f"f.c/{n}", "skip", reason="x") for n in range(10)]
    assert summarize(more).total.rate == pytest.approx(0.5)
    assert render_json(more)["totals"]["pass_rate"] == pytest.approx(0.5)


def test_latency_percentiles_per_category() -> None:
    s = summarize(sample_run())
    packages = next(g for g in s.categories if g.name == "packages")
    assert packages.duration.p50 == pytest.approx(25.0)
    assert packages.duration.p95 == pytest.approx(38.5)  # rank 2.85 between 30 and 40
    assert packages.duration.max == 40.0
    file_io = next(g for g in s.categories if g.name == "file_io")
    assert file_io.duration.n == 4  # skipped tasks have no duration to count
    assert file_io.create.n == 3  # one task reported no create time
    assert file_io.create.p50 == pytest.approx(0.2)
    security = next(g for g in s.categories if g.name == "security")
    assert security.duration.p50 is None

    data = render_json(sample_run())
    assert data["categories"]["packages"]["duration"] == {"n": 4, "p50": 25.0, "p95": 38.5, "max": 40.0}
    assert data["categories"]["security"]["duration"]["p95"] is None

    md = render_markdown(sample_run())
    latency = md.split("## Latency")[1]
    assert re.search(r"\| packages \| 4 \| 25\.0 s \| 38\.5 s \| 40\.0 s \| 300 ms \| 300 ms \| 300 ms \|", latency)
    assert re.search(r"\| security \| 0 \| - \| - \| - \| - \| - \| - \|", latency)


def test_rates_never_round_up_to_a_perfect_score() -> None:
    assert fmt_rate(1999 / 2000) == "99.9%"
    assert fmt_rate(2 / 3) == "66.7%"
    assert fmt_rate(1.0) == "100.0%" and fmt_rate(None) == "-"


# --------------------------------------------------------------------------------------------------------------
# Markdown


def test_markdown_has_the_numbers() -> None:
    md = render_markdown(sample_run())
    assert md.startswith("# Corral eval: corral, 2025-06-01 10:00 UTC")
    assert "Tasks: 12; wall time 5m 02s" in md
    assert "**Pass rate: 50.0%** (4 passed of 8 ran; 4 failed, 4 skipped and not counted)" in md
    assert "| file_io | 3 | 1 | 2 | 75.0% | 2.50 s | 3.85 s |" in md
    assert "| security | 0 | 0 | 2 | - | - | - |" in md
    assert "Interrupted" not in md


def test_modes_ranked_by_severity_then_count() -> None:
    results = ([task(f"m/{n}", "fail", mode="wrong_result") for n in range(5)]  # medium, 5
               + [task("c/1", "fail", mode="binary_corruption")]  # critical, 1
               + [task(f"h/{n}", "fail", mode="lost_state") for n in range(2)]  # high, 2
               + [task(f"t/{n}", "fail", mode="timeout_not_enforced") for n in range(3)]  # high, 3
               + [task("l/1", "fail", mode="unclear_error")])  # low, 1
    run = run_of(results)
    expected = ["binary_corruption", "timeout_not_enforced", "lost_state", "wrong_result", "unclear_error"]
    assert [m.mode.name for m in summarize(run).modes] == expected
    assert [m["name"] for m in render_json(run)["modes"]] == expected
    md = render_markdown(run)
    positions = [md.index(f"**{MODES[name].title}**") for name in expected]
    assert positions == sorted(positions)
    assert f"The user saw: {MODES['wrong_result'].seen}" in md
    # The failed-tasks table follows the same order.
    failed_rows = [line.split(" | ")[1] for line in md.split("## Failed tasks")[1].split("##")[0].splitlines()
                   if line.startswith("| ") and not line.startswith("| Task")]
    assert [n for n in dict.fromkeys(failed_rows)] == expected


def test_a_failed_task_counts_once_under_its_first_failure() -> None:
    r = TaskResult("x/1", "x", "file_io", "high", "fail", 1.0, None,
                   (TaskFailure(0, "nul_truncation", "a"), TaskFailure(1, "lost_state", "b")))
    data = render_json(run_of([r, task("x/2", "fail", mode="lost_state")]))
    assert {m["name"]: m["tasks"] for m in data["modes"]} == {"nul_truncation": ["x/1"], "lost_state": ["x/2"]}


def test_unknown_mode_still_reported() -> None:
    data = render_json(run_of([task("x/1", "fail", mode="from_the_future")]))
    assert data["modes"][0]["name"] == "from_the_future"
    assert data["modes"][0]["count"] == 1


def test_skipped_tasks_grouped_by_reason() -> None:
    md = render_markdown(sample_run())
    skipped = md.split("## Skipped tasks (4)")[1]
    assert "- adapter lacks 'archive': 2 (f.b/2, f.b/3)" in skipped
    assert "- adapter lacks 'pause': 1 (s.a/1)" in skipped
    assert "- (no reason given): 1 (s.a/2)" in skipped
    assert render_json(sample_run())["skipped"] == {
        "adapter lacks 'archive'": ["f.b/2", "f.b/3"], "(no reason given)": ["s.a/2"],
        "adapter lacks 'pause'": ["s.a/1"],
    }


def test_interrupted_run_says_so() -> None:
    run = run_of(sample_run().results[:5], complete=False, planned=1000)
    md = render_markdown(run)
    assert "Interrupted: the results file has no end line. 5 of 1000 planned tasks were recorded" in md
    assert "wall time -" in md
    page = parse(render_html(run))
    assert any("Interrupted" in text for text in page.texts_in("div"))
    data = render_json(run)
    assert data["complete"] is False and data["wall_seconds"] is None and data["planned"] == 1000


def test_markdown_escapes_hostile_text() -> None:
    run = run_of([task(HOSTILE_ID, "fail", mode="binary_corruption", detail=HOSTILE_DETAIL)])
    md = render_markdown(run)
    assert "<script>" not in md and "<img" not in md and "\x1b" not in md
    row = next(line for line in md.splitlines() if "alert(1)" in line and "onerror" in line)
    # The | and the newline of the detail neither split nor end the row: 4 columns, 5 unescaped pipes.
    assert len(re.findall(r"(?<!\\)\|", row)) == 5
    assert "\\x1b" in row


def test_long_details_are_shortened_to_one_line() -> None:
    text = oneline("a\nb\tc" + "x" * 500, 50)
    assert len(text) == 50 and text.startswith("a b c") and text.endswith("…")


# --------------------------------------------------------------------------------------------------------------
# HTML


class Page(HTMLParser):
    """Every element (tag, attributes, the tags open around it) and text, and whether tags balance."""

    VOID = frozenset({"meta", "br", "hr", "img", "input", "link"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str], tuple[str, ...]]] = []
        self.text: list[tuple[tuple[str, ...], str]] = []
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, tuple(self.stack)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, tuple(self.stack)))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append((tuple(self.stack), data))

    def find(self, tag: str, cls: str | None = None, inside: str | None = None) -> list[dict[str, str]]:
        return [a for t, a, around in self.elements
                if t == tag and (cls is None or cls in a.get("class", "").split())
                and (inside is None or inside in around)]

    def texts_in(self, tag: str) -> list[str]:
        return [data for around, data in self.text if tag in around]

    def charts(self) -> dict[str, list[dict[str, str]]]:
        """Bars of each chart, keyed by the chart's aria-label."""
        out: dict[str, list[dict[str, str]]] = {}
        label = None
        for t, a, around in self.elements:
            if t == "svg":
                label = a.get("aria-label", "")
                out[label] = []
            elif label is not None and "svg" in around and "bar" in a.get("class", "").split():
                out[label].append(a)
        return out


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    assert not page.errors, page.errors[:5]
    assert page.stack == [], page.stack
    return page


def test_html_is_self_contained_and_well_formed() -> None:
    text = render_html(sample_run())
    page = parse(text)
    assert text.startswith("<!DOCTYPE html>")
    assert not page.find("script") and not page.find("link")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched from elsewhere
    assert "url(" not in text and "@import" not in text
    assert len(page.find("svg")) == 3
    assert len(page.find("table")) >= 4  # categories, failed, skipped, latency (+ families)


def test_html_bars_match_the_data() -> None:
    charts = parse(render_html(sample_run())).charts()
    rates = {a["data-label"]: float(a["data-value"]) for a in charts["Pass rate by category"]}
    assert rates == {"file_io": pytest.approx(0.75), "packages": pytest.approx(0.25)}  # security: all skipped
    modes = charts["Failure modes by severity and count"]
    assert [(a["data-label"], int(a["data-value"]), a["data-severity"]) for a in modes] == [
        ("binary_corruption", 1, "critical"), ("lost_state", 1, "high"), ("wrong_result", 2, "medium")]
    # Bar widths are proportional to the values.
    widths = {a["data-label"]: float(a["width"]) for a in modes}
    assert widths["wrong_result"] == pytest.approx(2 * widths["lost_state"], rel=0.01)


def test_html_latency_marks_match_the_data() -> None:
    page = parse(render_html(sample_run()))
    marks = {(a["data-label"], a["data-series"]): a for a in page.find("g", "lat")}
    assert set(marks) == {("file_io", "duration"), ("file_io", "create"),
                          ("packages", "duration"), ("packages", "create")}
    p = marks[("packages", "duration")]
    assert (float(p["data-p50"]), float(p["data-p95"]), float(p["data-max"])) == (25.0, 38.5, 40.0)


def test_html_escapes_hostile_ids_and_details() -> None:
    hostile_category = '"><img src=x onerror=alert(2)>'
    run = run_of([
        task(HOSTILE_ID, "fail", mode="binary_corruption", detail=HOSTILE_DETAIL),
        task("x/1", "fail", category=hostile_category, mode="wrong_result"),
        task("x/2", "skip", reason="<b>bold</b> reason"),
    ], adapter="<i>adapter</i>")
    text = render_html(run)
    page = parse(text)
    assert not page.find("script") and not page.find("img") and not page.find("b") and not page.find("i")
    assert "<script>" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    cells = page.texts_in("td")
    assert HOSTILE_ID in cells  # shown as text, exactly
    assert any("onerror=alert(1)" in c and "\\x1b[31m" in c for c in cells)
    # An attribute value stays one attribute: the category is the bar's label, nothing more.
    labels = [a["data-label"] for a in page.find("rect", "bar")]
    assert hostile_category in labels
    assert all(set(a) <= {"class", "data-label", "data-value", "data-severity", "x", "y", "width", "height",
                          "rx", "fill"} for a in page.find("rect", "bar"))


# --------------------------------------------------------------------------------------------------------------
# JSON and files


def test_json_round_trips_with_stable_keys() -> None:
    data = render_json(sample_run())
    assert json.loads(json.dumps(data)) == data
    assert list(data) == ["format", "adapter", "started", "finished", "complete", "wall_seconds", "planned",
                          "totals", "categories", "families", "modes", "failed", "skipped"]
    assert data["totals"] == {"tasks": 12, "passed": 4, "failed": 4, "skipped": 4, "ran": 8, "pass_rate": 0.5,
                              "duration": data["totals"]["duration"], "create": data["totals"]["create"]}
    assert data["families"]["p.a"] == {"tasks": 3, "passed": 1, "failed": 2, "skipped": 0, "ran": 3,
                                       "pass_rate": pytest.approx(1 / 3)}
    mode = next(m for m in data["modes"] if m["name"] == "wrong_result")
    assert mode == {"name": "wrong_result", "severity": "medium", "title": MODES["wrong_result"].title,
                    "seen": MODES["wrong_result"].seen, "count": 2, "tasks": ["p.a/2", "p.a/3"]}
    assert data["failed"][0] == {"id": "f.b/1", "family": "f.b", "category": "file_io",
                                 "mode": "binary_corruption", "step": 1, "detail": "sha256 differs"}


def write_jsonl(path: Path, run: RunResults) -> None:
    """As the runner writes it: a header line, a line per task, an end line (unless interrupted)."""
    lines = [run.header, *(r.to_json() for r in run.results)]
    if run.end is not None:
        lines.append(run.end)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


@pytest.mark.parametrize("complete", [True, False])
def test_report_of_a_results_file(tmp_path: Path, complete: bool) -> None:
    hostile = task(HOSTILE_ID, "fail", mode="lost_state", detail=HOSTILE_DETAIL)
    original = run_of([*sample_run().results, hostile], complete=complete)
    write_jsonl(tmp_path / "results.jsonl", original)
    loaded = RunResults.load(tmp_path / "results.jsonl")
    assert loaded.complete is complete
    assert render_json(loaded) == render_json(original)
    assert render_markdown(loaded) == render_markdown(original)
    assert ("Interrupted" in render_markdown(loaded)) is not complete

    paths = write_report(loaded, tmp_path / "out")
    assert [p.name for p in paths] == ["report.md", "report.html", "report.json"]
    assert json.loads(paths[2].read_text())["totals"]["failed"] == 5
    parse(paths[1].read_text())


def test_write_report_refuses_an_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pdf"):
        write_report(sample_run(), tmp_path / "out", formats=("md", "pdf"))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in write_report(sample_run(), tmp_path / "out", formats=("json",))] == ["report.json"]


def test_empty_run_renders() -> None:
    run = run_of([])
    assert "**Pass rate: -**" in render_markdown(run)
    assert render_json(run)["totals"]["pass_rate"] is None
    page = parse(render_html(run))
    assert not page.find("rect", "bar")


# --------------------------------------------------------------------------------------------------------------
# Comparison


def before_after() -> tuple[RunResults, RunResults]:
    a = run_of([
        task("f/1"), task("f/2"), task("f/3", "fail", mode="lost_state"), task("f/4", "fail", mode="lost_state"),
        task("p/1", category="packages", duration=2.0), task("p/2", category="packages", duration=4.0),
        task("s/1", "skip", category="security", reason="no pause"),
        task("gone/1"),
    ], adapter="corral", started="2025-06-01T10:00:00+00:00")
    b = run_of([
        task("f/1", "fail", mode="binary_corruption", detail="bytes differ"),  # pass -> fail
        task("f/2"),
        task("f/3"),  # fail -> pass
        task("f/4", "fail", mode="wrong_result"),  # fail -> fail: not a flip
        task("p/1", category="packages", duration=3.0), task("p/2", category="packages", duration=6.0),
        task("s/1", "fail", category="security", mode="privilege_escalation"),  # skip -> fail: not a flip
        task("new/1", "fail", mode="hang"),
    ], adapter="e2b", started="2025-06-02T09:30:00+00:00")
    return a, b


def test_comparison_finds_exactly_the_flips() -> None:
    c = compare(*before_after())
    assert [f.id for f in c.pass_to_fail] == ["f/1"]
    assert [f.id for f in c.fail_to_pass] == ["f/3"]
    assert c.only_a == ("gone/1",) and c.only_b == ("new/1",)
    assert c.labels == ("corral 2025-06-01 10:00 UTC", "e2b 2025-06-02 09:30 UTC")


def test_comparison_deltas_and_ratios() -> None:
    data = render_compare_json(compare(*before_after()))
    assert json.loads(json.dumps(data)) == data
    cats = data["categories"]
    assert cats["file_io"]["pass_rate_a"] == pytest.approx(0.6)  # f/1, f/2, gone/1 of 5
    assert cats["file_io"]["pass_rate_b"] == pytest.approx(0.4)  # f/2, f/3 of 5
    assert cats["file_io"]["delta"] == pytest.approx(-0.2)
    assert cats["security"]["pass_rate_a"] is None and cats["security"]["delta"] is None
    assert cats["packages"]["p50_a"] == 3.0 and cats["packages"]["p50_b"] == 4.5
    assert cats["packages"]["p50_ratio"] == pytest.approx(1.5)
    modes = {m["name"]: (m["a"], m["b"]) for m in data["modes"]}
    assert modes == {"lost_state": (2, 0), "binary_corruption": (0, 1), "wrong_result": (0, 1),
                     "privilege_escalation": (0, 1), "hang": (0, 1)}
    assert [m["name"] for m in data["modes"]][:2] == ["binary_corruption", "privilege_escalation"]  # critical
    assert data["pass_to_fail"] == [{"id": "f/1", "category": "file_io", "mode": "binary_corruption",
                                     "detail": "bytes differ"}]
    assert data["fail_to_pass"] == [{"id": "f/3", "category": "file_io", "mode": "lost_state"}]
    assert data["only_in_a"] == ["gone/1"] and data["only_in_b"] == ["new/1"]


def test_comparison_markdown_and_html() -> None:
    a, b = before_after()
    c = compare(a, b)
    md = render_compare_markdown(c)
    assert "| Category | corral 2025-06-01 10:00 UTC | e2b 2025-06-02 09:30 UTC | Delta |" in md
    assert "| file_io | 60.0% | 40.0% | -20.0 pp |" in md
    assert "| packages | 3.00 s | 4.50 s | 1.50x |" in md
    assert "## Pass -> fail (1)" in md and "| f/1 | file_io | binary_corruption | bytes differ |" in md
    assert "## Fail -> pass (1)" in md and "| f/3 | file_io | lost_state |" in md
    assert "Only in corral 2025-06-01 10:00 UTC: 1 (gone/1)" in md

    page = parse(render_compare_html(c))
    bars = page.charts()["Pass rate by category, both runs"]
    got = {(x["data-run"], x["data-label"]): float(x["data-value"]) for x in bars}
    assert got == {("a", "file_io"): pytest.approx(0.6), ("b", "file_io"): pytest.approx(0.4),
                   ("a", "packages"): 1.0, ("b", "packages"): 1.0, ("b", "security"): 0.0}
    flipped = [row for t, row, _ in page.elements if t == "table" and "p2f" in row.get("class", "")]
    assert len(flipped) == 1
    assert "f/1" in page.texts_in("td") and "f/3" in page.texts_in("td")


def test_comparison_of_one_run_with_itself_labels_columns_apart(tmp_path: Path) -> None:
    a = sample_run()
    c = compare(a, a)
    assert c.labels[0] != c.labels[1]
    assert not c.pass_to_fail and not c.fail_to_pass and not c.only_a
    paths = write_comparison(a, a, tmp_path)
    assert [p.name for p in paths] == ["comparison.md", "comparison.html", "comparison.json"]
    data: dict[str, Any] = json.loads(paths[2].read_text())
    assert data["pass_rate"]["delta"] == 0


def test_comparison_escapes_hostile_text() -> None:
    a = run_of([task(HOSTILE_ID)])
    b = run_of([task(HOSTILE_ID, "fail", mode="binary_corruption", detail=HOSTILE_DETAIL)], adapter="<b>x</b>")
    c = compare(a, b)
    text = render_compare_html(c)
    page = parse(text)
    assert not page.find("script") and not page.find("img") and not page.find("b")
    assert HOSTILE_ID in page.texts_in("td")
    md = render_compare_markdown(c)
    assert "<script>" not in md and "<img" not in md and "<b>" not in md
