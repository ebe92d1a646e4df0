"""The eval's `undo` category (issue 26): its checks fail when a restore leaves anything out, the corpus holds what
the issue asks for, and the whole category passes on real runc sandboxes, through Corral's SDK and through E2B's
SDK against Corral's E2B API (the restore through Corral's SDK); the seed's story (a SQLite database's data deleted
by a command, every row back after the restore) and `corral check` item 45, which fails when a restore does not
bring everything back. The category on Docker: tests/test_docker_live.py's sample covers its families."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest

from corral import Sandbox
from corral.check import CheckOptions, Target, run_check
from corral.check._undo import item_45_destructive_command_undone
from corral.eval import Outcome, load_corpus, select
from corral.eval._deployment import local_capabilities, run_on_corral
from corral.eval._e2b import CORRAL_CAPABILITIES, E2BAdapter
from corral.eval._task import Checkpoint, Fingerprint, Restore
from corral.eval._undo import AutoCheckpointed, Broken, Restored, differences
from corral.eval.corpus.undo import ROWS, ROWS_BACK, SQLITE, SQLITE_ROWS
from corral.server import ServerProcess

from .test_check import needs_store
from .test_check import server as server  # the fixture: a real `corral serve` (runc) in a temporary home
from .test_check_items import Tampering, _live, _probe

BEFORE = {"/w/a": "file 3 abc 644 1000:1000", "/w/d": "dir 755 1000:1000", "/w/l": "link a 777 1000:1000"}


def test_restored_names_every_entry_that_is_not_back() -> None:
    assert Restored().verify(Outcome("fingerprint", fingerprint=dict(BEFORE), recorded=BEFORE)) is None
    after = {"/w/a": "file 3 abc 600 1000:1000", "/w/l": "link b 777 1000:1000", "/w/new": "dir 755 1000:1000"}
    failure = Restored().verify(Outcome("fingerprint", fingerprint=after, recorded=BEFORE))
    assert failure is not None and failure.mode == "restore_incomplete"
    assert "4 of 3 entries are not as they were" in failure.detail
    assert "/w/d is missing (was dir 755 1000:1000)" in failure.detail
    assert "/w/a: file 3 abc 600 1000:1000, was file 3 abc 644 1000:1000" in failure.detail
    assert "/w/new was not there before" in failure.detail and "/w/l: link b" in failure.detail
    assert len(differences(BEFORE, after)) == 4


def test_broken_fails_when_the_damage_did_nothing_and_auto_needs_the_checkpoint() -> None:
    same = Outcome("fingerprint", fingerprint=dict(BEFORE), recorded=BEFORE)
    assert (f := Broken().verify(same)) is not None and "changed nothing" in f.detail
    assert Broken().verify(Outcome("fingerprint", fingerprint={}, recorded=BEFORE)) is None
    assert Restored().verify(Outcome("fingerprint", fingerprint={})) is not None  # nothing recorded: malformed
    assert (f := AutoCheckpointed().verify(Outcome("exec", exit_code=0))) is not None
    assert f.mode == "checkpoint_missing"
    assert AutoCheckpointed().verify(Outcome("exec", exit_code=0, checkpoint="ckpt-0123456789abcdef")) is None


def test_the_category_holds_what_the_issue_asks_for() -> None:
    tasks = select(load_corpus(), categories=["undo"])
    assert len(tasks) >= 30
    families = Counter(t.family for t in tasks)
    for family in ("undo.rm_rf", "undo.sqlite", "undo.git", "undo.pip", "undo.data", "undo.modes", "undo.links",
                   "undo.rename", "undo.template", "undo.paths"):
        assert families[family] >= 2, families
    for t in tasks:
        kinds = [type(s) for s in t.steps]
        assert Restore in kinds and Fingerprint in kinds, t.id
        last_checks = [c for s in t.steps if isinstance(s, Fingerprint) and s.compare for c in s.checks]
        assert any(isinstance(c, Restored) for c in last_checks) and any(isinstance(c, Broken) for c in last_checks)
        if t.setup.checkpoints == "auto":
            assert Checkpoint not in kinds and "auto_checkpoints" in t.needs(), t.id
            assert any(isinstance(c, AutoCheckpointed) for s in t.steps for c in s.checks), t.id
        else:
            assert Checkpoint in kinds and "auto_checkpoints" not in t.needs(), t.id
    assert sum(t.setup.checkpoints == "auto" for t in tasks) >= 30


def _failed(run: Any) -> list[str]:
    return [f"{r.id}: {r.mode}: {r.failures[0].detail}" for r in run.results if r.status == "fail"]


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_store
def test_the_undo_category_passes_on_runc(server: ServerProcess) -> None:
    tasks = select(load_corpus(), categories=["undo"])
    run = asyncio.run(run_on_corral(tasks, base_url=server.url, admin_key=server.admin_key, concurrency=6,
                                    capabilities=local_capabilities()))
    assert _failed(run) == [] and run.counts().get("pass") == len(tasks), run.counts()
    assert list((server.home / "sandboxes").iterdir()) == []


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_store
def test_the_undo_category_through_e2bs_sdk_restores_through_corrals(server: ServerProcess) -> None:
    pytest.importorskip("e2b_code_interpreter")
    tasks = select(load_corpus(), categories=["undo"])
    run = asyncio.run(run_on_corral(tasks, base_url=server.url, admin_key=server.admin_key, concurrency=6,
                                    capabilities=local_capabilities() & CORRAL_CAPABILITIES,
                                    adapter_type=E2BAdapter))
    assert _failed(run) == [], "\n".join(_failed(run))
    skipped = [r for r in run.results if r.status == "skip"]
    # E2B's create cannot ask for automatic checkpoints: those tasks, and only those, are skipped, saying why.
    assert {r.id for r in skipped} == {t.id for t in tasks if t.setup.checkpoints == "auto"}
    assert all("auto_checkpoints" in r.skip_reason for r in skipped)
    assert run.counts().get("pass", 0) >= 30


@pytest.mark.runc
@pytest.mark.timeout(300)
@needs_store
def test_the_seed_story_every_row_is_back(server: ServerProcess) -> None:
    # The story this issue began with: a database with its rows, its data deleted by a command, the sandbox
    # restored to the checkpoint before it, the database opened again, every row back.
    with Sandbox.create(api_key=server.admin_key, base_url=server.url) as sb:
        assert sb.commands.run(SQLITE.format(rows=ROWS), timeout=120).exit_code == 0
        before = sb.commands.run(SQLITE_ROWS, timeout=60)
        assert ROWS_BACK in before.stdout, before
        every_row = sb.commands.run(EVERY_ROW, timeout=60)
        assert every_row.exit_code == 0 and len(every_row.stdout.strip()) == 64, every_row
        cp = sb.checkpoint(name="before-the-freeze")
        assert sb.commands.run("rm -rf /workspace/db", timeout=60).exit_code == 0
        gone = sb.commands.run(SQLITE_ROWS, timeout=60)
        assert gone.exit_code != 0 and ROWS_BACK not in gone.stdout  # the data really is gone
        result = sb.restore(cp)
        assert result.checkpoint.id == cp.id and result.paths is None
        after = sb.commands.run(SQLITE_ROWS, timeout=60)
        assert (after.exit_code, after.stdout) == (0, before.stdout), after
        assert sb.commands.run(EVERY_ROW, timeout=60).stdout == every_row.stdout  # each row, each byte
        assert sb.get_info().id == sb.id and sb.get_info().state == "running"  # the same sandbox


EVERY_ROW = ("python3 -c \"import sqlite3, hashlib; c = sqlite3.connect('/workspace/db/app.db'); "
             "print(hashlib.sha256(repr(c.execute('select * from users order by id').fetchall()).encode())"
             ".hexdigest())\"")


@pytest.mark.runc
@pytest.mark.timeout(300)
@needs_store
def test_item_45_passes_on_a_local_deployment(server: ServerProcess) -> None:
    target = Target(url=server.url, admin_key=server.admin_key, home=server.home)
    report = asyncio.run(run_check(target, CheckOptions(items=frozenset({45}))))
    [item] = report.items
    assert (item.number, item.status) == (45, "PASS"), item
    assert "byte for byte" in item.detail and "the audit trail names key" in item.detail
    assert report.exit_code == 0 and report.cleanup_problems == []


def _restore_nothing(request: httpx.Request, body: dict[str, Any]) -> httpx.Request | None:
    """A restore that puts back only a path the probe never touched: the project and the database stay broken."""
    if not request.url.path.endswith("/restore"):
        return None
    from .test_check_items import _rebuilt

    return _rebuilt(request, body={**body, "paths": ["/workspace/untouched"]})


@pytest.mark.runc
@pytest.mark.anyio
@pytest.mark.timeout(300)
@needs_store
async def test_item_45_fails_when_the_restore_does_not_bring_everything_back(server: ServerProcess) -> None:
    async with _live(server) as ctx:
        found = await _probe(ctx, item_45_destructive_command_undone, Tampering(edit=_restore_nothing))
    assert found.status == "FAIL" and "are not as they were" in found.detail, found
    assert "/workspace/project" in found.detail
