"""The fast tier's guard (tests/conftest.py): a test without a runtime marker cannot start a real sandbox
unnoticed, and `./scripts/test --fast` selects exactly the tests the guard watches."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from corral.backends.local import LocalBackend

from .conftest import CGROUP_PARENT, REAL_MARKERS, FastTierGuard

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


async def test_a_real_sandbox_started_in_the_fast_tier_fails_the_test(
        _fast_tier_guard: FastTierGuard | None, tmp_path: Path) -> None:
    guard = _fast_tier_guard
    assert guard is not None  # this test has no marker: it is in the fast tier
    backend = LocalBackend(tmp_path, cgroup_parent=CGROUP_PARENT)
    with pytest.raises(pytest.fail.Exception, match="no runc/runsc/docker marker"):
        await backend.create("sb-guard", None, None)  # type: ignore[arg-type]  # refused before it reads them
    assert guard.calls() == ["a real runc (LocalBackend) sandbox"]  # failed at teardown too, were it not for:
    guard.forget()


def test_a_runtime_run_by_any_process_of_a_fast_tier_test_fails_it(_fast_tier_guard: FastTierGuard | None) -> None:
    guard = _fast_tier_guard
    assert guard is not None
    for runtime in ("runc", "runsc", "docker"):
        ran = subprocess.run(["sh", "-c", f"{runtime} list"], capture_output=True, text=True)
        assert ran.returncode == 97, ran
        assert "mark it runc, runsc or docker" in ran.stderr
    assert guard.calls() == ["runc list", "runsc list", "docker list"]
    guard.forget()


@pytest.mark.runc
def test_a_marked_test_sees_the_real_runtime(_fast_tier_guard: FastTierGuard | None) -> None:
    assert _fast_tier_guard is None
    runc = shutil.which("runc")
    assert runc is not None and "fast-tier-shims" not in runc


def test_scripts_test_fast_selects_the_tests_the_guard_watches() -> None:
    script = (ROOT / "scripts" / "test").read_text()
    (expression,) = re.findall(r'^FAST_TIER="([^"]+)"$', script, re.M)
    assert sorted(re.findall(r"not (\w+)", expression)) == sorted(REAL_MARKERS)
    assert expression == " and ".join(f"not {m}" for m in re.findall(r"not (\w+)", expression))
