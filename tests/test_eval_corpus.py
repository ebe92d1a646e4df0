"""The corpus itself: big enough, every category and family present, valid, and CI's seeded sample covering
every family. Running it against real sandboxes is tests/test_eval_live.py."""

from __future__ import annotations

from collections import Counter

import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.eval import CATEGORIES, load_corpus, select
from corral.eval.corpus import validate

from .test_eval_live import CI_SAMPLE, CI_SEED


@pytest.mark.slow  # generates the whole corpus (~4 s)
def test_at_least_1000_tasks_in_every_category():
    corpus = load_corpus()
    assert len(corpus) >= 1000
    per_category = Counter(t.category for t in corpus)
    assert set(per_category) == set(CATEGORIES)
    assert min(per_category.values()) >= 50, per_category
    validate(corpus)


def test_families_mean_something_and_ids_are_stable():
    corpus = load_corpus()
    families = Counter(t.family for t in corpus)
    assert len(families) >= 50
    for t in corpus:
        assert t.family.split(".")[0] in {t.category, *t.category.split("_"), t.category.split("_")[0]} \
            or t.family.startswith(t.category[:4]), f"{t.id}: family {t.family} does not name its category"
        assert t.id == t.id.strip() and " " not in t.id, t.id
    # Loading twice gives the same tasks in the same order (sampling and result comparison rely on it).
    assert [t.id for t in load_corpus()] == [t.id for t in corpus]


def test_ci_sample_covers_every_family_with_at_least_150_tasks():
    corpus = load_corpus()
    sample = select(corpus, sample=CI_SAMPLE, seed=CI_SEED)
    assert len(sample) >= 150
    assert {t.family for t in sample} == {t.family for t in corpus}


def test_security_tasks_carry_their_checklist_items():
    corpus = load_corpus()
    items = {n for t in corpus for n in t.checklist}
    # The in-sandbox items of CHECKLIST.md; the rest are `corral check`'s API and host probes.
    assert {1, 3, 4, 5, 6, 7, 8, 12, 14, 15, 16, 17, 18, 20, 21, 22, 24, 25, 26, 27, 28, 29, 30} <= items


def test_ls_lists_families_and_tasks_as_json():
    runner = CliRunner()
    r = runner.invoke(app, ["eval", "ls", "--category", "security", "--json"])
    assert r.exit_code == 0, r.output
    import json

    tasks = json.loads(r.stdout)
    assert tasks and all(t["category"] == "security" for t in tasks)
    bad = runner.invoke(app, ["eval", "ls", "--category", "nonsense"])
    assert bad.exit_code == 2 and "unknown category 'nonsense'" in bad.output
