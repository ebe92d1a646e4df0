"""Choosing tasks: filters by family, category, tag and id, and a seeded sample that covers every family.

The sample first takes one task of each family (so a 150-task sample of a 1,000-task corpus still touches every
family), then fills the rest uniformly at random; the same seed gives the same tasks. The result keeps corpus
order.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from ._task import Task

__all__ = ["select"]


def select(
    tasks: Iterable[Task],
    *,
    families: Sequence[str] = (),
    categories: Sequence[str] = (),
    tags: Sequence[str] = (),
    ids: Sequence[str] = (),
    checklist: bool = False,
    sample: int | None = None,
    seed: int = 0,
) -> list[Task]:
    """Tasks matching every filter given (a family matches by prefix: `file_io` selects `file_io.*`)."""
    chosen = [t for t in tasks if _matches(t, families, categories, tags, ids, checklist)]
    if sample is None or sample >= len(chosen):
        return chosen
    if sample < 1:
        raise ValueError("the sample size must be at least 1")
    return _sample(chosen, sample, seed)


def _matches(t: Task, families: Sequence[str], categories: Sequence[str], tags: Sequence[str],
             ids: Sequence[str], checklist: bool) -> bool:
    if families and not any(t.family == f or t.family.startswith(f + ".") or t.family.startswith(f + "_")
                            for f in families):
        return False
    if categories and t.category not in categories:
        return False
    if tags and not set(tags) & set(t.tags):
        return False
    if ids and t.id not in ids and not any(t.id.startswith(i.rstrip("*")) for i in ids if i.endswith("*")):
        return False
    return not checklist or bool(t.checklist)


def _sample(chosen: list[Task], size: int, seed: int) -> list[Task]:
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    by_family: dict[str, list[int]] = {}
    for i, t in enumerate(chosen):
        by_family.setdefault(t.family, []).append(i)
    families = sorted(by_family)
    picked: set[int] = set()
    if size >= len(families):
        picked = {rng.choice(by_family[f]) for f in families}
    else:
        picked = {rng.choice(by_family[f]) for f in rng.sample(families, size)}
    rest = [i for i in range(len(chosen)) if i not in picked]
    picked.update(rng.sample(rest, size - len(picked)))
    return [chosen[i] for i in sorted(picked)]
