"""What a check found: one `Verdict` per probe (a task or an item function), combined into one `ItemResult` per
item, and the `CheckReport` of the whole run.

An item is PASS only when something really probed it and nothing failed; N/A always carries its reason; an item
that nothing probed is a FAIL (a checklist that silently skips an item proves nothing about it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._catalog import ITEMS

__all__ = ["CheckReport", "ItemFailed", "ItemResult", "NotApplicable", "Status", "Verdict", "combine"]

Status = Literal["PASS", "FAIL", "N/A"]
STATUSES: tuple[Status, ...] = ("PASS", "FAIL", "N/A")

_DETAIL_MAX = 1500


class ItemFailed(Exception):
    """Raised by an item function: the property does not hold (`detail` says what was observed)."""

    def __init__(self, detail: str, *, fix: str = "") -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


class NotApplicable(Exception):
    """Raised by an item function: the item cannot be probed on this deployment (`reason` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Verdict:
    """What one probe of one item concluded."""

    status: Status
    detail: str
    fix: str = ""  # more specific than the item's own fix, when the probe knows better
    tasks: tuple[str, ...] = ()  # the eval tasks behind it
    seconds: float = 0.0


@dataclass(frozen=True)
class ItemResult:
    number: int
    title: str
    status: Status
    detail: str
    fix: str  # empty unless the item failed
    tasks: tuple[str, ...] = ()
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "title": self.title, "status": self.status, "detail": self.detail,
                "fix": self.fix, "tasks": list(self.tasks), "seconds": round(self.seconds, 2)}


def _clip(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[:_DETAIL_MAX - 3] + "..."


def combine(number: int, verdicts: Iterable[Verdict], fixes: Mapping[int, str] | None = None) -> ItemResult:
    """One item's result from all its probes: any FAIL fails it; PASS needs at least one PASS (parts that were
    not applicable are named in its detail); N/A only when every probe was N/A, with their reasons."""
    item = ITEMS[number]
    found = list(verdicts)
    tasks = tuple(t for v in found for t in v.tasks)
    seconds = sum(v.seconds for v in found)
    by_status = {s: [v for v in found if v.status == s] for s in STATUSES}
    fix = (fixes or {}).get(number) or item.fix
    if not found:
        return ItemResult(number, item.title, "FAIL", "nothing probed this item: this build of `corral check` "
                          "has no probe for it", "report this as a bug of Corral's checklist")
    if failed := by_status["FAIL"]:
        detail = "; ".join(v.detail for v in failed)
        return ItemResult(number, item.title, "FAIL", _clip(detail), failed[0].fix or fix, tasks, seconds)
    if passed := by_status["PASS"]:
        detail = "; ".join(v.detail for v in passed)
        if skipped := by_status["N/A"]:
            detail += "; not applicable here: " + "; ".join(dict.fromkeys(v.detail for v in skipped))
        return ItemResult(number, item.title, "PASS", _clip(detail), "", tasks, seconds)
    detail = "; ".join(dict.fromkeys(v.detail for v in by_status["N/A"]))  # the same reason once
    return ItemResult(number, item.title, "N/A", _clip(detail), "", tasks, seconds)


@dataclass
class CheckReport:
    """The whole run: every item's result, and whatever the clean-up could not undo."""

    url: str
    started: str
    seconds: float = 0.0
    tenant: str = ""
    backend: str = ""  # the server's, as `GET /v1/info` named it
    items: list[ItemResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the backend cannot give that no item shows
    cleanup_problems: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = Counter(i.status for i in self.items)
        return {s: found.get(s, 0) for s in STATUSES}

    @property
    def ok(self) -> bool:
        """No item failed and nothing was left behind."""
        return not self.counts()["FAIL"] and not self.cleanup_problems

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "started": self.started, "seconds": round(self.seconds, 2), "tenant": self.tenant,
                "backend": self.backend, "ok": self.ok, "counts": self.counts(),
                "items": [i.to_json() for i in self.items], "notes": list(self.notes),
                "cleanup_problems": list(self.cleanup_problems)}
