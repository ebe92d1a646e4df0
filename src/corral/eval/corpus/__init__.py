"""The corpus: every task, from the family modules of this package, loaded and validated once.

Each module has `tasks() -> Iterable[Task]`; families are parametrised where each variant tests something
different (a size, an encoding, a byte pattern, a language, a policy, a limit). `load_corpus()` refuses a corpus
with a duplicate id, an unknown category, severity or capability, or a check naming an unknown failure mode.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable

from .._task import CAPABILITIES, CATEGORIES, SEVERITIES, Task
from .._taxonomy import MODES

__all__ = ["MODULES", "load_corpus", "validate"]

MODULES = (
    "files",
    "data",
    "ml",
    "languages",
    "long_running",
    "packages",
    "downloads",
    "security",
    "abuse",
    "undo",
)


@functools.cache
def load_corpus() -> tuple[Task, ...]:
    """Every task of the corpus, in a stable order."""
    tasks: list[Task] = []
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        tasks.extend(module.tasks())
    validate(tasks)
    return tuple(tasks)


def validate(tasks: Iterable[Task]) -> None:
    """Raise ValueError naming every problem of a corpus."""
    problems: list[str] = []
    seen: set[str] = set()
    for t in tasks:
        if t.id in seen:
            problems.append(f"{t.id}: duplicate id")
        seen.add(t.id)
        if not t.id.startswith(t.family + "/"):
            problems.append(f"{t.id}: id must start with its family {t.family!r} and a slash")
        if t.category not in CATEGORIES:
            problems.append(f"{t.id}: unknown category {t.category!r}")
        if t.severity not in SEVERITIES:
            problems.append(f"{t.id}: unknown severity {t.severity!r}")
        if unknown := t.needs() - CAPABILITIES:
            problems.append(f"{t.id}: unknown capabilities {sorted(unknown)}")
        if not t.steps:
            problems.append(f"{t.id}: no steps")
        for step in t.steps:
            for check in step.checks:
                if check.mode not in MODES and check.mode != "":
                    problems.append(f"{t.id}: check {type(check).__name__} names unknown mode {check.mode!r}")
        if not any(step.checks for step in t.steps):
            problems.append(f"{t.id}: no checks: a task that cannot fail proves nothing")
    if problems:
        raise ValueError("invalid corpus:\n  " + "\n  ".join(problems))
