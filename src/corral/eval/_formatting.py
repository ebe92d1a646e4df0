"""Formatting shared by the report's renderers: one-line details, rates, seconds, deltas and ratios as text, and
the small pieces (where a task failed, sample ids, the interrupted-run note) every format shows alike."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime

from ._result import TaskResult

DETAIL_CHARS = 160  # failure details are shortened to one line of this many characters
SAMPLE_IDS = 5  # task ids listed inline for a group (skip reason, tasks in one run only)




_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def oneline(text: str, limit: int = DETAIL_CHARS) -> str:
    """`text` on one line: control characters shown as escapes (a sandbox may print terminal escapes),
    whitespace runs collapsed, cut to `limit` characters with an ellipsis."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def fmt_rate(rate: float | None) -> str:
    """A pass rate as a percentage; 99.96% is shown as 99.9%, never as a 100.0% that has failures."""
    if rate is None:
        return "-"
    text = f"{rate * 100:.1f}%"
    return "99.9%" if rate < 1 and text == "100.0%" else text


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def fmt_delta(delta: float | None) -> str:
    """A change of pass rate in percentage points."""
    if delta is None:
        return "-"
    points = delta * 100
    return "±0.0 pp" if abs(points) < 0.05 else f"{points:+.1f} pp"


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _format_time(value: object) -> str:
    """An ISO timestamp as `YYYY-MM-DD HH:MM UTC`; anything else as it is (it is escaped where shown)."""
    if not isinstance(value, str) or not value:
        return "?"
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return oneline(value, 40)
    if when.tzinfo is None:
        return when.strftime("%Y-%m-%d %H:%M")
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _where(r: TaskResult) -> str:
    if not r.failures:
        return ""
    step = r.failures[0].step
    return "setup" if step < 0 else f"step {step}"


def _detail(r: TaskResult) -> str:
    return oneline(r.failures[0].detail) if r.failures else ""


def _sample(ids: Sequence[str], n: int = SAMPLE_IDS) -> list[str]:
    return [oneline(i, 80) for i in ids[:n]]
