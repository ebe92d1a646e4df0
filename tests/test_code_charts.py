"""Matplotlib figures as charts (`e2b/chart`, agent/charts.py) in real sandboxes, read back with E2B's own parser.

Each test draws a figure in a code session (matplotlib 3.6 and numpy 1.24 of the default template), takes the
`e2b/chart` JSON from the figure's result, checks it, and parses it with the real `e2b_code_interpreter.charts`
(the SDK E2B's users have), so the format is proven against the parser that will read it. The kinds follow
E2B's chart tests (bar, box and whisker, line with dates and units, log scale, pie, datetime and categorical
scales, scatter, superchart, unknown), with plotting code of our own; then what E2B's tests leave open: figures
without data, a failing extractor, the size limit, box plots without patches, reference lines, error bars.
"""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

import pytest
from e2b_code_interpreter.charts import (
    BarChart,
    BoxAndWhiskerChart,
    Chart,
    ChartType,
    LineChart,
    PieChart,
    ScaleType,
    ScatterChart,
    SuperChart,
    _deserialize_chart,
)
from e2b_code_interpreter.models import Execution, Result

from corral.engine import RichResult, SandboxSession

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

CHART = "e2b/chart"


async def figures(sandbox: SandboxSession, code: str) -> list[RichResult]:
    """The results of the figures a cell leaves open (each has a PNG); the cell must not fail."""
    r = await sandbox.run_code(code, timeout=120)
    assert r.error is None, r.error
    found = [x for x in r.results if "image/png" in x.data]
    assert all(base64.b64decode(x.data["image/png"]).startswith(b"\x89PNG\r\n\x1a\n") for x in found)
    assert all(x.chart == (json.loads(x.data[CHART]) if CHART in x.data else None) for x in found)
    return found


def parse(result: RichResult) -> Chart:
    """A figure's chart as E2B's SDK parses it (a parse error fails the test)."""
    assert result.chart is not None
    parsed = _deserialize_chart(result.chart)
    assert parsed is not None
    return parsed


async def chart(sandbox: SandboxSession, code: str) -> tuple[dict[str, Any], Chart]:
    """The one figure's chart: as JSON, and as E2B's SDK parses it."""
    [figure] = await figures(sandbox, code)
    assert figure.chart is not None
    return figure.chart, parse(figure)


async def test_bar_chart(sandbox: SandboxSession) -> None:
    raw, parsed = await chart(sandbox, """
import matplotlib.pyplot as plt
fruit = ['apples', 'pears', 'plums']
plt.figure(figsize=(6, 4))
plt.bar(fruit, [12, 7, 30], label='Crates', color='green')
plt.title('Harvest'); plt.xlabel('Fruit'); plt.ylabel('Weight [kg]')
plt.show()
""")
    assert isinstance(parsed, BarChart) and parsed.type == ChartType.BAR and parsed.title == "Harvest"
    assert (parsed.x_label, parsed.y_label, parsed.x_unit, parsed.y_unit) == ("Fruit", "Weight [kg]", None, "kg")
    assert [(b.label, b.value, b.group) for b in parsed.elements] == [
        ("apples", 12, "Crates"), ("pears", 7, "Crates"), ("plums", 30, "Crates")]
    assert set(raw) == {"type", "title", "x_label", "y_label", "x_unit", "y_unit", "elements"}


async def test_box_and_whisker_chart(sandbox: SandboxSession) -> None:
    _, parsed = await chart(sandbox, """
import matplotlib.pyplot as plt
scores = {'North': [3, 9, 4, 7, 5], 'South': [20, 11, 12, 14, 13, 15], 'East': [1, 2, 3, 4, 5, 6, 7, 8, 9]}
fig, ax = plt.subplots()
ax.boxplot(list(scores.values()), labels=list(scores), patch_artist=True)
ax.set_title('Rainfall'); ax.set_xlabel('Region'); ax.set_ylabel('Rain (mm)')
""")
    assert isinstance(parsed, BoxAndWhiskerChart) and parsed.type == ChartType.BOX_AND_WHISKER
    assert (parsed.title, parsed.x_label, parsed.y_label, parsed.y_unit) == ("Rainfall", "Region", "Rain (mm)", "mm")
    stats = [(b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers)
             for b in parsed.elements]
    # numpy's percentiles, whiskers at 1.5 IQR: South's 20 is beyond 14.75 + 1.5 * 2.5 = 18.5, an outlier.
    assert stats == [("North", 3, 4, 5, 7, 9, []), ("South", 11, 12.25, 13.5, 14.75, 15, [20]),
                     ("East", 1, 3, 5, 7, 9, [])]


async def test_line_chart_with_dates_and_units(sandbox: SandboxSession) -> None:
    raw, parsed = await chart(sandbox, """
import datetime
import matplotlib.pyplot as plt
days = [datetime.datetime(2024, 2, 27) + datetime.timedelta(days=i) for i in range(5)]
plt.plot(days, [20.5, 21, 19.25, 22, 23], label='inside')
plt.plot(days, [3, 1, -12, 0.5, 4], label='outside')
plt.title('Temperatures'); plt.xlabel('Day (UTC)'); plt.ylabel('Temperature (°C)')
""")
    assert isinstance(parsed, LineChart) and parsed.type == ChartType.LINE and parsed.title == "Temperatures"
    assert (parsed.x_unit, parsed.y_unit) == ("UTC", "°C")
    assert (parsed.x_scale, parsed.y_scale) == (ScaleType.DATETIME, ScaleType.LINEAR)
    assert [line.label for line in parsed.elements] == ["inside", "outside"]
    inside = parsed.elements[0].points
    assert [datetime.datetime.fromisoformat(x) for x, _ in inside] == [
        datetime.datetime(2024, 2, 27 + i, tzinfo=datetime.UTC) if i < 3 else
        datetime.datetime(2024, 3, i - 2, tzinfo=datetime.UTC) for i in range(5)]  # 2024 is a leap year
    assert [y for _, y in inside] == [20.5, 21, 19.25, 22, 23]
    assert all(isinstance(t, str) and datetime.datetime.fromisoformat(t) for t in parsed.x_ticks)
    assert len(parsed.x_ticks) == len(parsed.x_tick_labels) > 1
    assert all(isinstance(t, float) for t in parsed.y_ticks) and "-10" in parsed.y_tick_labels
    assert "\u2212" not in json.dumps(raw, ensure_ascii=False)  # matplotlib's minus sign, made ASCII


async def test_log_scale(sandbox: SandboxSession) -> None:
    _, parsed = await chart(sandbox, """
import numpy as np
import matplotlib.pyplot as plt
n = np.arange(1, 41)
plt.plot(n, 2.0 ** n, label='doubling')
plt.yscale('log'); plt.grid(True); plt.legend()
plt.xlabel('Step'); plt.ylabel('Size (bytes)')
""")
    assert isinstance(parsed, LineChart)
    assert (parsed.x_scale, parsed.y_scale, parsed.y_unit) == (ScaleType.LINEAR, ScaleType.LOG, "bytes")
    assert [line.label for line in parsed.elements] == ["doubling"]  # the grid is no line of the chart
    assert parsed.elements[0].points[:3] == [(1, 2), (2, 4), (3, 8)] and parsed.elements[0].points[-1] == (40, 2**40)
    assert all(isinstance(t, float) for t in [*parsed.x_ticks, *parsed.y_ticks])
    assert all(t > 0 for t in parsed.y_ticks) and parsed.y_ticks == sorted(parsed.y_ticks)
    assert all(label.startswith("10^") for label in parsed.y_tick_labels), parsed.y_tick_labels  # no mathtext


async def test_pie_chart(sandbox: SandboxSession) -> None:
    raw, parsed = await chart(sandbox, """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.pie([70, 20, 10], labels=['rent', 'food', 'fun'], autopct='%.0f%%', startangle=90)
ax.set_title('Budget')
""")
    assert isinstance(parsed, PieChart) and parsed.title == "Budget"
    # pie() works in float32: 70 % is 251.99998 degrees there, given rounded.
    assert [(w.label, w.angle, w.radius) for w in parsed.elements] == [
        ("rent", 252, 1), ("food", 72, 1), ("fun", 36, 1)]
    assert set(raw) == {"type", "title", "elements"}


async def test_datetime_and_categorical_scales_two_figures_in_one_cell(sandbox: SandboxSession) -> None:
    first, second = await figures(sandbox, """
import numpy as np
import matplotlib.pyplot as plt
plt.figure()
plt.plot(np.arange('2024-01', '2024-07', dtype='datetime64[M]'), [5, 3, 6, 2, 7, 4])
plt.figure()
plt.plot([10, 20, 30], ['low', 'mid', 'high'], label='level')
""")
    dated, categorical = parse(first), parse(second)
    assert isinstance(dated, LineChart) and (dated.x_scale, dated.y_scale) == ("datetime", "linear")
    assert [x for x, _ in dated.elements[0].points] == [f"2024-0{m}-01T00:00:00+00:00" for m in range(1, 7)]
    assert dated.elements[0].label == "Line 0"  # unlabelled lines are numbered
    assert isinstance(categorical, LineChart) and (categorical.x_scale, categorical.y_scale) == ("linear",
                                                                                              "categorical")
    assert categorical.elements[0].points == [(10, "low"), (20, "mid"), (30, "high")]
    assert categorical.y_tick_labels == ["low", "mid", "high"]


async def test_scatter_chart_and_e2b_serialization(sandbox: SandboxSession) -> None:
    [figure] = await figures(sandbox, """
import matplotlib.pyplot as plt
plt.scatter([1, 2, 3], [4, 1, 3], label='early')
plt.scatter([4, 5, 6, 7], [2, 2, 5, 1], marker='x', label='late')
plt.axhline(2.5, linestyle='--')  # a reference line, not a series
plt.gca().add_artist(plt.legend(loc='upper left'))  # a kept legend is an artist, and no data either
plt.xlabel('Hour'); plt.ylabel('Load')
""")
    parsed = parse(figure)
    assert isinstance(parsed, ScatterChart) and parsed.title is None
    assert (parsed.x_label, parsed.y_label, parsed.x_scale, parsed.y_scale) == ("Hour", "Load", "linear", "linear")
    assert [(s.label, s.points) for s in parsed.elements] == [
        ("early", [(1, 4), (2, 1), (3, 3)]), ("late", [(4, 2), (5, 2), (6, 5), (7, 1)])]
    assert all(isinstance(t, float) for t in [*parsed.x_ticks, *parsed.y_ticks])
    # The SDK's own result objects, as its users get them (E2B's test_json): the chart survives to_json().
    result = Result(png=figure.data["image/png"], text=figure.data["text/plain"], chart=figure.chart)
    assert isinstance(result.chart, ScatterChart) and "chart" in result.formats()
    assert json.loads(Execution(results=[result]).to_json())["results"][0]["chart"]["type"] == "scatter"


async def test_superchart(sandbox: SandboxSession) -> None:
    _, parsed = await chart(sandbox, """
import numpy as np
import matplotlib.pyplot as plt
fig, (left, right, spare) = plt.subplots(1, 3)
fig.suptitle('Overview')
left.plot(np.linspace(0, 1, 50), np.linspace(0, 1, 50) ** 2); left.set_title('Curve'); left.grid(True)
right.scatter([1, 2], [2, 1]); right.set_title('Dots'); right.set_xlabel('X'); right.set_ylabel('Y')
spare.axis('off')  # drawn nothing: no chart of its own
""")
    assert isinstance(parsed, SuperChart) and parsed.type == ChartType.SUPERCHART and parsed.title == "Overview"
    curve, dots = parsed.elements
    assert isinstance(curve, LineChart) and curve.title == "Curve" and (curve.x_label, curve.y_label) == (None, None)
    assert len(curve.elements) == 1 and len(curve.elements[0].points) == 50
    assert isinstance(dots, ScatterChart) and (dots.title, dots.x_label, dots.y_label) == ("Dots", "X", "Y")
    assert dots.elements[0].points == [(1, 2), (2, 1)]


async def test_unknown_chart(sandbox: SandboxSession) -> None:
    raw, parsed = await chart(sandbox, """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.add_patch(plt.Rectangle((0, 0), 2, 1, fill=False))
ax.add_patch(plt.Circle((1, 0.5), 0.4))
ax.set_xlim(-1, 3); ax.set_ylim(-1, 2); ax.grid(True)
ax.set_title('Shapes')
""")
    assert type(parsed) is Chart and parsed.type == ChartType.UNKNOWN and parsed.title == "Shapes"
    assert raw == {"type": "unknown", "title": "Shapes", "elements": []}


async def test_figures_without_data_have_a_png_but_no_chart(sandbox: SandboxSession) -> None:
    found = await figures(sandbox, """
import matplotlib.pyplot as plt
plt.subplots()
fig = plt.figure(); fig.text(0.5, 0.5, 'only words')
""")
    assert len(found) == 2 and all(CHART not in x.data and x.chart is None for x in found)


async def test_a_failing_extractor_leaves_the_png_and_says_nothing(sandbox: SandboxSession) -> None:
    r = await sandbox.run_code("""
import logging, warnings
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3])

def has_data():
    warnings.warn('the extractor asked')
    logging.getLogger('matplotlib').warning('the extractor logged')
    return True

def get_title(loc='center'):
    raise RuntimeError('no title for you')

ax.has_data, ax.get_title = has_data, get_title
print('drawn')
""", timeout=120)
    assert r.error is None and (r.stdout, r.stderr) == ("drawn\n", "")
    [result] = r.results
    assert set(result.data) == {"image/png", "text/plain"} and result.data["text/plain"].startswith("<Figure")


async def test_too_many_points_give_no_chart(sandbox: SandboxSession) -> None:
    few, many = await figures(sandbox, """
import numpy as np
import matplotlib.pyplot as plt
plt.figure(); plt.plot(np.arange(9_000))
plt.figure(); plt.plot(np.arange(6_000)); plt.plot(np.arange(6_000))
""")
    parsed = parse(few)
    assert isinstance(parsed, LineChart) and parsed.elements[0].points[-1] == (8999, 8999)
    assert CHART not in many.data  # 12 000 points: past MAX_POINTS, the PNG alone


async def test_box_plot_lying_down_without_patches(sandbox: SandboxSession) -> None:
    _, parsed = await chart(sandbox, """
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.boxplot([[-30, 1, 2, 3, 4, 5, 6, 7, 8, 40], [10, 11, 12, 13, 14]], vert=False, notch=True, showmeans=True,
           labels=['old', 'new'])
ax.set_xlabel('Latency (ms)'); ax.set_ylabel('Build')
""")
    assert isinstance(parsed, BoxAndWhiskerChart)
    # Lying down, the categories are still x: the labels are swapped to say so.
    assert (parsed.x_label, parsed.y_label, parsed.y_unit) == ("Build", "Latency (ms)", "ms")
    stats = [(b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers)
             for b in parsed.elements]
    assert stats == [("old", 1, 2.25, 4.5, 6.75, 8, [-30, 40]), ("new", 10, 11, 12, 13, 14, [])]


async def test_grouped_stacked_and_horizontal_bars(sandbox: SandboxSession) -> None:
    grouped, lying = await figures(sandbox, """
import numpy as np
import matplotlib.pyplot as plt
x = np.arange(2)
fig, ax = plt.subplots()
ax.bar(x - 0.2, [5, 6], 0.4, yerr=[0.5, 0.5], label='2023')
ax.bar(x + 0.2, [7, 4], 0.4, label='2024')
ax.bar(x + 0.2, [1, 2], 0.4, bottom=[7, 4])
ax.set_xticks(x, ['Q1', 'Q2']); ax.axhline(5, color='k')
fig, ax = plt.subplots()
ax.barh(['cpu', 'disk'], [0.75, 0.5]); ax.set_xlabel('Share'); ax.set_ylabel('Resource')
""")
    bars = parse(grouped)
    assert isinstance(bars, BarChart)
    assert [(b.group, b.label, b.value) for b in bars.elements] == [
        ("2023", "Q1", 5), ("2023", "Q2", 6), ("2024", "Q1", 7), ("2024", "Q2", 4),
        ("Group 2", "Q1", 1), ("Group 2", "Q2", 2)]  # a stacked bar's own length, not where it ends
    horizontal = parse(lying)
    assert isinstance(horizontal, BarChart) and (horizontal.x_label, horizontal.y_label) == ("Resource", "Share")
    assert [(b.label, b.value) for b in horizontal.elements] == [("cpu", 0.75), ("disk", 0.5)]


async def test_an_object_may_give_its_own_chart(sandbox: SandboxSession) -> None:
    r = await sandbox.run_code("""
class Sales:
    def _repr_e2b_chart_(self):
        return {'type': 'pie', 'title': 'Mine', 'elements': [{'label': 'a', 'angle': 360, 'radius': 1}]}
Sales()
""")
    [main] = r.results
    parsed = parse(main)
    assert isinstance(parsed, PieChart) and parsed.title == "Mine" and parsed.elements[0].angle == 360


def test_a_result_without_a_chart_object_has_none() -> None:
    assert RichResult(False, {"text/plain": "1"}).chart is None
    assert RichResult(False, {CHART: "not json"}).chart is None
    assert RichResult(False, {CHART: "[1, 2]"}).chart is None
    assert RichResult(False, {CHART: '{"type": "unknown", "title": null, "elements": []}'}).chart == {
        "type": "unknown", "title": None, "elements": []}
