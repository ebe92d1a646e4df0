"""`corral bench checkpoints` at tiny sizes (real runc): every figure is there and the restores did their work.
The figures themselves are the benchmark's (README, docs/performance.md), never a test's bound."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.cli._bench import _load

from .conftest import DEV_ROOTFS, TEMPLATE_HOME


@pytest.mark.runc
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the benchmark needs a built template store")
def test_the_checkpoints_bench_runs_at_tiny_sizes() -> None:
    seen: set[str] = set()
    bench = _load("checkpoints")
    home = Path(tempfile.mkdtemp(prefix="cb-", dir="/var/tmp"))  # short: the agent sockets live below it
    try:
        results = bench.run(home=home, template_home=TEMPLATE_HOME, progress=lambda what, done, total: seen.add(what),
                            n=2, files=20, size_mib=1, sample=4, concurrency=4)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    engine = results["engine"]
    for key in ("checkpoint_unchanged", "checkpoint_after_change", "baseline_cp_a_of_the_change",
                "restore_after_change", "changes_after_change"):
        assert engine[key]["n"] == 2 and engine[key]["p50_ms"] > 0, (key, engine[key])
    assert engine["changes_after_change"]["paths"] >= 20  # the 20 files (and their directory)
    assert engine["checkpoint_after_change"]["bytes"] >= 1 << 20
    assert engine["checkpoint_after_change"]["ratio_to_cp_a"] is not None
    auto = results["auto_on_the_eval_corpus"]
    assert auto["tasks"] >= 3 and auto["passed_without"] == auto["passed_with_auto"] == auto["tasks"], auto
    assert auto["overhead"] is not None
    assert "checkpoint, unchanged" in seen and any("cp -a" in s for s in seen)


def test_the_bench_is_registered_with_its_options() -> None:
    r = CliRunner().invoke(app, ["bench", "checkpoints", "--help"])
    assert r.exit_code == 0 and "--size-mib" in r.output and "--sample" in r.output
