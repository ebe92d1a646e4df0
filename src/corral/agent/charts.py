"""Matplotlib figures as structured charts: the `e2b/chart` result of a code cell (docs/code.md, "Charts").

Runs in a Python code session's own process (agent/kernel.py), for each figure the kernel renders after a cell;
never in the agent. Only the standard library is imported here: matplotlib and numpy come through `_lib`, inside
the functions, and the kernel calls them only once the cell has imported pyplot itself.

`figure_chart(fig)` is the one entry point: the figure as a dict in E2B's chart format, or None when no axes of
it draws data. `chart_json(fig)` is what the kernel puts in a result: the same as JSON text, or None on any
failure or beyond the size limits; it never raises and never warns.

How an Axes is read (what it draws, not how it was called):
- Not data: text, legends, grids, and lines or spans placed in axes coordinates on one axis (`axhline`,
  `axvspan`, ...); on bars or points, a straight two-point line along an axis too (a mean, a threshold).
- lines only -> "line"; point collections only -> "scatter"; bars of `bar`/`barh`/`hist` -> "bar"; wedges only
  -> "pie"; boxes with whiskers (`boxplot`, with or without `patch_artist`) -> "box_and_whisker"; anything
  else (images, polygons, error bars, circles, mixed kinds) -> "unknown" (type and title only).
- A figure with one Axes holding data is that Axes' chart; with several, a "superchart" of them, titled by the
  suptitle. Colorbars are not charts.
"""

from __future__ import annotations

import json
import math
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

MAX_POINTS = 10_000  # data points, bars and wedges of a figure; beyond, no chart (its JSON would be megabytes)
MAX_AXES = 50  # Axes with data in a figure; beyond, no chart (reading each one's ticks takes time)
MAX_JSON = 768 * 1024  # bytes of chart JSON (as an escaped string) unless the caller says how much room it has
SIGNIFICANT = 10  # digits kept of numbers matplotlib computes (ticks, angles, box stats): no float noise
_UNIT = re.compile(r"\s\(([^()]*)\)|\[([^\[\]]*)\]")  # "Time (s)" -> "s", "Speed [m/s]" -> "m/s"
_MATHDEFAULT = re.compile(r"\\mathdefault\{(.*?)\}")


def chart_json(fig: Any, max_bytes: int = MAX_JSON) -> str | None:
    """`figure_chart(fig)` as compact JSON text, or None: when there is no chart, when the text would take more
    than `max_bytes` as a JSON string (escaped, as the kernel's result event carries it), and when anything
    fails: a figure the extractor does not understand must never break the cell, nor write to its output."""
    import logging
    import warnings

    muted = logging.root.manager.disable
    try:
        logging.disable(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chart = figure_chart(fig)
        text = json.dumps(chart, separators=(",", ":"), allow_nan=False) if chart is not None else None
    except Exception:
        return None
    finally:
        logging.disable(muted)
    return text if text is not None and len(json.dumps(text)) <= max_bytes else None


def figure_chart(fig: Any) -> dict[str, Any] | None:
    """The chart of a matplotlib Figure (E2B's format, documented in docs/code.md), or None without data."""
    axes = [ax for ax in fig.get_axes() if _charted(ax)]
    if not axes or len(axes) > MAX_AXES or sum(_size(ax) for ax in axes) > MAX_POINTS:
        return None
    suptitle = _suptitle(fig)
    if len(axes) > 1:
        return {"type": "superchart", "title": suptitle, "elements": [axes_chart(ax) for ax in axes]}
    chart = axes_chart(axes[0])
    if chart["title"] is None:
        chart["title"] = suptitle
    return chart


def _lib(name: str) -> ModuleType:
    """matplotlib or numpy, imported when first used (the agent never loads them); typed Any: the host's own
    environment, where this module is type-checked, has neither."""
    import importlib

    return importlib.import_module(name)


def _charted(ax: Any) -> bool:
    return bool(ax.get_visible() and ax.has_data() and getattr(ax, "_colorbar", None) is None)


def _size(ax: Any) -> int:
    lines = sum(len(line.get_xydata()) for line in ax.lines)
    return lines + sum(len(c.get_offsets()) for c in ax.collections) + len(ax.patches)


def _suptitle(fig: Any) -> str | None:
    text = getattr(fig, "_suptitle", None)  # Figure.get_suptitle() is matplotlib 3.8+; bookworm has 3.6
    return (text.get_text() or None) if text is not None else None


# -- one Axes ---------------------------------------------------------------------------------------------


def axes_chart(ax: Any) -> dict[str, Any]:
    """The chart of one Axes: its kind decided by what it draws as data."""
    lines, patches, collections, others = _data_artists(ax)
    title = _title(ax)
    if others:
        return _unknown(title)
    if (boxes := _boxes(ax, lines, patches, collections)) is not None:
        return boxes
    if patches and not lines and not collections and all(_is(p, "patches", "Wedge") for p in patches):
        return _pie(title, patches)
    decorations_only = all(_straight(line) for line in lines)
    if patches and not collections and decorations_only and _all_bars(ax, patches):
        return _bars(ax)
    if lines and not patches and not collections:
        return _points(ax, "line", [(line.get_label(), line.get_xydata()) for line in lines])
    if collections and not patches and decorations_only and all(_is_scatter(c, ax) for c in collections):
        return _points(ax, "scatter", [(c.get_label(), c.get_offsets()) for c in collections])
    return _unknown(title)


def _data_artists(ax: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """(lines, patches, collections, others) that the Axes draws as data, in the order they were added."""
    errorbars = {id(a) for c in _bar_containers(ax) if c.errorbar is not None for a in _flatten(c.errorbar)}
    lines = [a for a in ax.lines if a.get_transform() is ax.transData and id(a) not in errorbars]
    patches = [p for p in ax.patches if p.get_data_transform() is ax.transData and not _is(p, "patches", "Shadow")]
    collections = [c for c in ax.collections if id(c) not in errorbars]
    others = [*ax.images, *ax.tables, *(a for a in ax.artists if not _is_note(a))]
    return lines, patches, collections, others


def _is_note(artist: Any) -> bool:
    """A legend or a boxed annotation added as an artist (a second legend is `ax.add_artist(legend)`)."""
    offsetbox = _lib("matplotlib.offsetbox")
    return _is(artist, "legend", "Legend") or isinstance(artist, offsetbox.OffsetBox | offsetbox.AnnotationBbox)


def _flatten(container: Any) -> list[Any]:
    out: list[Any] = []
    for item in container:
        if isinstance(item, tuple | list):
            out.extend(_flatten(item))
        elif item is not None:
            out.append(item)
    return out


def _is(obj: Any, module: str, name: str) -> bool:
    return isinstance(obj, getattr(_lib(f"matplotlib.{module}"), name))


def _straight(line: Any) -> bool:
    """A two-point line along an axis: over bars or points, a marker (a mean, a threshold), not a series."""
    xy = line.get_xydata()
    return len(xy) == 2 and (xy[0][0] == xy[1][0] or xy[0][1] == xy[1][1])


def _is_scatter(collection: Any, ax: Any) -> bool:
    return _is(collection, "collections", "PathCollection") and collection.get_offset_transform() is ax.transData


def _title(ax: Any) -> str | None:
    return next((t for loc in ("center", "left", "right") if (t := ax.get_title(loc))), None)


def _unknown(title: str | None) -> dict[str, Any]:
    return {"type": "unknown", "title": title, "elements": []}


def _labels(ax: Any, *, swap: bool = False) -> dict[str, Any]:
    """title, axis labels and their units; `swap` for bars and boxes laid along y, so that x is the categories."""
    x, y = ax.get_xlabel() or None, ax.get_ylabel() or None
    if swap:
        x, y = y, x
    return {"title": _title(ax), "x_label": x, "y_label": y, "x_unit": _unit(x), "y_unit": _unit(y)}


def _unit(label: str | None) -> str | None:
    """The last "(unit)" after a space or "[unit]" of an axis label."""
    found = list(_UNIT.finditer(label or ""))
    return ((found[-1].group(1) or found[-1].group(2) or "").strip() or None) if found else None


# -- numbers and axes -------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN: a gap in a line, a masked point)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _rounded(value: Any, digits: int = SIGNIFICANT) -> float | None:
    number = _number(value)
    return float(f"{number:.{digits}g}") if number is not None else None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _plain(label: Any) -> str:
    """A tick label as text: mathtext markup ("$\\mathdefault{10^{2}}$") and the Unicode minus removed."""
    text = str(label)
    if "$" in text:
        text = _MATHDEFAULT.sub(r"\1", text).replace("$", "").replace("{", "").replace("}", "")
    return text.replace("\u2212", "-")


class _Axis:
    """One axis as the chart shows it: its scale, its visible ticks and their labels, data values as JSON."""

    def __init__(self, axis: Any) -> None:
        self.axis = axis
        self.dates = _is_date_axis(axis)
        formatter = axis.get_major_formatter()
        # Ticks the code placed (`set_xticks`, `tick_label=`, pandas) or categories: they name what sits there.
        self.named = type(axis.get_major_locator()).__name__ in ("FixedLocator", "StrCategoryLocator") or \
            type(formatter).__name__ in ("FixedFormatter", "StrCategoryFormatter")
        self.locs, self.labels = _visible_ticks(axis, formatter)
        self.scale = self._scale()

    def _scale(self) -> str:
        if self.dates:
            return "datetime"
        scale = str(self.axis.get_scale())
        if scale == "linear" and (type(_converter(self.axis)).__name__ == "StrCategoryConverter" or self._indexed()):
            return "categorical"
        return scale

    def _indexed(self) -> bool:
        """Ticks at 0, 1, ... n-1 named by text, not by their numbers: categories however they were set."""
        return bool(self.locs) and all(
            loc == i and _number(label) != i
            for i, (loc, label) in enumerate(zip(self.locs, self.labels, strict=True)))

    def ticks(self) -> list[Any]:
        return [self.value(loc) for loc in self.locs] if self.dates else [_rounded(loc) for loc in self.locs]

    def value(self, number: Any) -> Any:
        """A data coordinate as the chart gives it: an ISO date, a category's name, or a number."""
        x = _number(number)
        if x is None:
            return None
        if self.dates:
            return _lib("matplotlib.dates").num2date(x).isoformat()
        if self.scale == "categorical" and x.is_integer() and x in self.locs:
            return self.labels[self.locs.index(x)]
        return x

    def name_at(self, position: float) -> str:
        """What a bar or box at `position` is called: its tick's label where the ticks name things."""
        if self.named and self.locs:
            nearest = min(range(len(self.locs)), key=lambda i: abs(self.locs[i] - position))
            return self.labels[nearest]
        value = self.value(position)
        return value if isinstance(value, str) else f"{position:.6g}"  # a histogram's bin: its middle


def _converter(axis: Any) -> Any:
    get = getattr(axis, "get_converter", None)  # matplotlib 3.10+; before, the attribute
    return get() if get is not None else getattr(axis, "converter", None)


def _is_date_axis(axis: Any) -> bool:
    # matplotlib's converters (and pandas' DatetimeConverter) are named *DateConverter or derive from DateConverter.
    converter = _converter(axis)
    if converter is None:
        return False
    return type(converter).__name__.endswith("DateConverter") or _is(converter, "dates", "DateConverter")


def _visible_ticks(axis: Any, formatter: Any) -> tuple[list[float], list[str]]:
    """The major ticks inside the view, with the labels they are drawn with (formatted together, as in a draw)."""
    locs = [float(loc) for loc in axis.get_majorticklocs()]
    labels = [_plain(label) for label in formatter.format_ticks(locs)]
    low, high = sorted(float(v) for v in axis.get_view_interval())
    kept = [(loc, label) for loc, label in zip(locs, labels, strict=True)
            if low <= loc <= high or _close(loc, low) or _close(loc, high)]
    return [loc for loc, _ in kept], [label for _, label in kept]


# -- the kinds --------------------------------------------------------------------------------------------


def _points(ax: Any, kind: str, series: list[tuple[str, Any]]) -> dict[str, Any]:
    """A line or scatter chart: each series' points in the axes' own terms (dates, categories, numbers)."""
    np = _lib("numpy")
    x, y = _Axis(ax.xaxis), _Axis(ax.yaxis)
    elements = []
    for i, (label, data) in enumerate(series):
        xy = np.ma.filled(np.ma.asarray(data, dtype=float).reshape(-1, 2), np.nan)
        name = f"{'Line' if kind == 'line' else 'Series'} {i}" if str(label).startswith("_") else str(label)
        elements.append({"label": name, "points": [[x.value(a), y.value(b)] for a, b in xy.tolist()]})
    return {"type": kind, **_labels(ax),
            "x_ticks": x.ticks(), "x_tick_labels": x.labels, "x_scale": x.scale,
            "y_ticks": y.ticks(), "y_tick_labels": y.labels, "y_scale": y.scale, "elements": elements}


def _pie(title: str | None, wedges: list[Any]) -> dict[str, Any]:
    # pie() computes its fractions in float32: 90 of 100 is 323.9999914 degrees, seven digits make it 324.
    elements = [{"label": str(w.get_label()), "angle": _rounded(abs(w.theta2 - w.theta1), 7), "radius": _rounded(w.r)}
                for w in wedges]
    return {"type": "pie", "title": title, "elements": elements}


def _bar_containers(ax: Any) -> list[Any]:
    return [c for c in ax.containers if _is(c, "container", "BarContainer")]


def _all_bars(ax: Any, patches: list[Any]) -> bool:
    bars = {id(p) for c in _bar_containers(ax) for p in c.patches}
    return all(id(p) in bars for p in patches)


def _bars(ax: Any) -> dict[str, Any]:
    """Each bar: its category (x), its value (the bar's own length, not where a stacked bar ends) and group."""
    containers = _bar_containers(ax)
    across_y = [c.orientation == "horizontal" for c in containers]
    categories = {False: _Axis(ax.xaxis), True: _Axis(ax.yaxis)}
    elements = []
    for i, (container, horizontal) in enumerate(zip(containers, across_y, strict=True)):
        group = container.get_label()
        group = f"Group {i}" if not group or group.startswith("_") else str(group)
        names = categories[horizontal]
        values = container.datavalues
        for j, bar in enumerate(container.patches):
            middle = bar.get_y() + bar.get_height() / 2 if horizontal else bar.get_x() + bar.get_width() / 2
            value = values[j] if values is not None else (bar.get_width() if horizontal else bar.get_height())
            elements.append({"label": names.name_at(middle), "group": group, "value": _number(value)})
    return {"type": "bar", **_labels(ax, swap=bool(across_y) and across_y[0]), "elements": elements}


# -- box and whisker --------------------------------------------------------------------------------------

# One box, in the box plot's own terms: position across the boxes (low, high), the quartiles and whisker ends.
_Box = tuple[float, float, float, float, float, float]


def _boxes(ax: Any, lines: list[Any], patches: list[Any], collections: list[Any]) -> dict[str, Any] | None:
    """A box plot read from its shapes: boxes (patches, or closed outlines without `patch_artist`), whiskers
    and caps (straight two-point lines), medians, and fliers (markers without a line). None if it is not one."""
    if collections or not all(_is(p, "patches", "PathPatch") for p in patches):
        return None
    outlines = [p.get_path().vertices.tolist() for p in patches]
    outlines += [line.get_xydata().tolist() for line in lines if _closed(line)]
    rest = [line for line in lines if not _closed(line)]
    if not outlines or not all(_straight(line) or _markers_only(line) for line in rest):
        return None
    segments = [line.get_xydata().tolist() for line in rest if not _markers_only(line)]
    markers = [p for line in rest if _markers_only(line) for p in line.get_xydata().tolist()]
    for along_y in (True, False):  # boxes standing up (the default), then lying along x
        boxes = [_box(_oriented(outline, along_y), segments, along_y) for outline in outlines]
        if all(box is not None for box in boxes):
            return _box_chart(ax, [b for b in boxes if b is not None], segments, markers, along_y)
    return None


def _closed(line: Any) -> bool:
    xy = line.get_xydata()
    return len(xy) >= 5 and bool((xy[0] == xy[-1]).all())


def _markers_only(line: Any) -> bool:
    return line.get_linestyle() in ("None", "none", "", " ") and line.get_marker() not in (None, "None", "none", "")


def _oriented(points: list[list[float]], along_y: bool) -> list[tuple[float, float]]:
    """Points as (position, value): position across the boxes, value along them."""
    return [(p[0], p[1]) if along_y else (p[1], p[0]) for p in points]


def _box(outline: list[tuple[float, float]], segments: list[list[list[float]]], along_y: bool) -> _Box | None:
    """One box from its outline and the whiskers that leave its edges outwards, along its middle; None if it
    has none. The quartiles are the outline's values at its sides that are also whisker ends: a notch's
    corners (which may reach past the quartiles) are not."""
    p0, p1 = min(p for p, _ in outline), max(p for p, _ in outline)
    middle = (p0 + p1) / 2
    along = [[v for _, v in _oriented(s, along_y)] for s in segments
             if all(_close(p, middle) for p, _ in _oriented(s, along_y))]
    sides = [v for p, v in outline if _close(p, p0) or _close(p, p1)]
    quartiles = [v for v in sides if any(_close(v, end) for seg in along for end in seg)]
    if not quartiles:
        return None
    q1, q3 = min(quartiles), max(quartiles)
    ends = [end for seg in along if max(seg) <= q1 or min(seg) >= q3 for end in seg]
    return (p0, p1, q1, q3, min([q1, *ends]), max([q3, *ends])) if ends else None


def _box_chart(ax: Any, boxes: list[_Box], segments: list[list[list[float]]], markers: list[list[float]],
               along_y: bool) -> dict[str, Any]:
    names = _Axis(ax.xaxis if along_y else ax.yaxis)
    elements = []
    for p0, p1, q1, q3, low, high in sorted(boxes):
        outliers = [v for p, v in _oriented(markers, along_y) if p0 <= p <= p1 and (v < low or v > high)]
        median = _median((p0, p1, q1, q3), segments, along_y, (low, high))
        elements.append({"label": names.name_at((p0 + p1) / 2), "min": _rounded(low), "first_quartile": _rounded(q1),
                         "median": _rounded(median), "third_quartile": _rounded(q3), "max": _rounded(high),
                         "outliers": [_rounded(v) for v in outliers]})
    return {"type": "box_and_whisker", **_labels(ax, swap=not along_y), "elements": elements}


def _median(box: tuple[float, float, float, float], segments: list[list[list[float]]], along_y: bool,
            whisker_ends: tuple[float, float]) -> float | None:
    """The line across the box inside its quartiles. Caps sit at the whisker ends, and a median line spans the
    box's full width (caps half of it): those break ties when a whisker has no length."""
    p0, p1, q1, q3 = box
    candidates = []
    for segment in segments:
        (a, u), (b, v) = _oriented(segment, along_y)
        inside = p0 - 1e-12 <= min(a, b) and max(a, b) <= p1 + 1e-12
        if u == v and a != b and inside and q1 <= u <= q3:
            candidates.append((u in whisker_ends, -abs(b - a), u))
    return min(candidates)[2] if candidates else None
