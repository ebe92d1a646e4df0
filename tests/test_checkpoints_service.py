"""Checkpoints in the store and the service (issue 26), against the fake backend's `Checkpointing` over the fake
agent's files (tests/fake_checkpoints.py): take, list, get, delete, restore in place (what it stopped), changes
with diffs; roles, tenancy, audit; bounds and eviction of automatic ones; the quota; bad input refused with
nothing changed; automatic checkpoints before each kind of call. tests/test_checkpoints_api.py goes through REST
and the SDK; tests/test_checkpoints_live.py does it on runc."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral import (
    ConflictError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
)
from corral._paths import sandbox_path
from corral.control import ControlStore, Principal, Quotas, Role
from corral.service import Cell, Command, CreateSandbox, Service, request_scope

from .fakes import FakeBackend, fake_service

pytestmark = pytest.mark.anyio


@dataclass
class Setup:
    service: Service
    backend: FakeBackend
    who: dict[str, Principal]
    tenants: dict[str, str]

    @property
    def store(self) -> ControlStore:
        return self.service.store

    @property
    def fs(self) -> Path:
        return self.backend.world.dir

    def file(self, sandbox_id: str, path: str) -> Path:
        return self.fs / f"{sandbox_id}.fs" / path.lstrip("/")

    async def sandbox(self, **options: Any) -> str:
        record = await self.service.sandboxes.create(self.who["dev"], CreateSandbox(**options))
        await self.service.engine.alive(record.id)
        return record.id

    async def records(self, action: str) -> list[dict[str, Any]]:
        found = await self.store.audit.query(tenant=self.tenants["a"], action=action)
        return [{"target": r.target, "params": r.params, "outcome": r.outcome, "key_id": r.key_id} for r in found]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    people = (("dev", "a", Role.DEVELOPER), ("aud", "a", Role.AUDITOR), ("admin", "a", Role.ADMIN),
              ("other", "b", Role.DEVELOPER))
    async with fake_service("ck-", FakeBackend, people) as made:
        yield Setup(made.service, made.backend, made.who, made.tenants)


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _write(s: Setup, sid: str, path: str, data: bytes) -> None:
    await s.service.files.write(s.who["dev"], sid, sandbox_path(path), _chunks(data))


async def _read(s: Setup, sid: str, path: str) -> bytes:
    return b"".join([c async for c in await s.service.files.read(s.who["dev"], sid, sandbox_path(path))])


# -- take, list, get, delete ------------------------------------------------------------------------------------


async def test_create_list_get_delete_are_audited(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await _write(s, sid, "/workspace/a.txt", b"12345")
    first = await s.service.checkpoints.create(dev, sid)
    named = await s.service.checkpoints.create(dev, sid, "before-migrate")
    assert first.id.startswith("ckpt-") and first.size_bytes >= 5 and not first.automatic
    assert (named.name, named.sandbox_id, named.tenant_id) == ("before-migrate", sid, s.tenants["a"])
    assert [c.id for c in await s.service.checkpoints.list(dev, sid)] == [named.id, first.id]  # newest first
    assert (await s.service.checkpoints.get(dev, sid, "before-migrate")).id == named.id
    assert (await s.service.checkpoints.get(dev, sid, first.id)).id == first.id
    await s.service.checkpoints.delete(dev, sid, "before-migrate")
    assert [c.id for c in await s.service.checkpoints.list(dev, sid)] == [first.id]
    assert s.backend.called("delete_checkpoint") == [named.id]
    created = await s.records("checkpoint.create")
    assert {r["outcome"]["checkpoint"] for r in created} == {first.id, named.id}
    assert all(r["outcome"]["status"] == 201 and r["target"] == sid for r in created)
    deleted = await s.records("checkpoint.delete")
    assert deleted[0]["outcome"] == {"status": 204, "checkpoint": named.id, "name": "before-migrate"}
    # A deleted one's name is free again.
    assert (await s.service.checkpoints.create(dev, sid, "before-migrate")).name == "before-migrate"


async def test_names_are_unique_per_sandbox_and_checked(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid, other_sid = await s.sandbox(), await s.sandbox()
    await s.service.checkpoints.create(dev, sid, "v1")
    await s.service.checkpoints.create(dev, other_sid, "v1")  # another sandbox's may share it
    with pytest.raises(ConflictError) as taken:
        await s.service.checkpoints.create(dev, sid, "v1")
    assert taken.value.details == {"name": "v1"}
    for bad in ("", "-x", "a b", "x" * 129, "ckpt-0123456789abcdef"):
        with pytest.raises(InvalidRequestError) as refused:
            await s.service.checkpoints.create(dev, sid, bad)
        assert refused.value.details == {"name": bad}
    assert len(await s.service.checkpoints.list(dev, sid)) == 1  # nothing taken by a refusal
    assert s.backend.called("checkpoint").count(sid) == 1


async def test_unknown_checkpoints_are_not_found(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid, other_sid = await s.sandbox(), await s.sandbox()
    theirs = await s.service.checkpoints.create(dev, other_sid, "theirs")
    for call in (lambda c: s.service.checkpoints.get(dev, sid, c), lambda c: s.service.checkpoints.delete(dev, sid, c),
                 lambda c: s.service.checkpoints.restore(dev, sid, c),
                 lambda c: s.service.checkpoints.changes(dev, sid, c)):
        for unknown in ("ckpt-0000000000000000", "nope", theirs.id, "theirs"):  # another sandbox's is unknown here
            with pytest.raises(NotFoundError) as missing:
                await call(unknown)
            assert list(missing.value.details.values()) == [unknown]
    assert s.backend.called("restore_checkpoint") == []


# -- roles and tenancy ------------------------------------------------------------------------------------------


async def test_auditors_read_but_never_change(setup: Setup) -> None:
    s, dev, aud = setup, setup.who["dev"], setup.who["aud"]
    sid = await s.sandbox()
    taken = await s.service.checkpoints.create(dev, sid, "v1")
    assert [c.id for c in await s.service.checkpoints.list(aud, sid)] == [taken.id]
    assert (await s.service.checkpoints.get(aud, sid, "v1")).id == taken.id
    assert (await s.service.checkpoints.changes(aud, sid, "v1")).changes == []
    with pytest.raises(PermissionDeniedError):
        await s.service.checkpoints.create(aud, sid)
    with pytest.raises(PermissionDeniedError):
        await s.service.checkpoints.restore(aud, sid, "v1")
    with pytest.raises(PermissionDeniedError):
        await s.service.checkpoints.delete(aud, sid, "v1")
    assert s.backend.called("restore_checkpoint") == [] and s.backend.called("delete_checkpoint") == []
    refused = await s.records("checkpoint.restore")
    assert refused[0]["outcome"]["error"] == "permission_denied"
    # An admin may restore.
    result = await s.service.checkpoints.restore(s.who["admin"], sid, "v1")
    assert result.checkpoint.id == taken.id


async def test_another_tenants_sandbox_does_not_exist(setup: Setup) -> None:
    s, other = setup, setup.who["other"]
    sid = await s.sandbox()
    await s.service.checkpoints.create(s.who["dev"], sid, "v1")
    calls = [s.service.checkpoints.create(other, sid), s.service.checkpoints.list(other, sid),
             s.service.checkpoints.get(other, sid, "v1"), s.service.checkpoints.delete(other, sid, "v1"),
             s.service.checkpoints.restore(other, sid, "v1"), s.service.checkpoints.changes(other, sid, "v1")]
    for call in calls:
        with pytest.raises(NotFoundError) as missing:
            await call
        assert missing.value.message == f"no sandbox {sid!r}"
    assert len(await s.service.checkpoints.list(s.who["dev"], sid)) == 1


# -- restore and changes ----------------------------------------------------------------------------------------


async def test_restore_puts_files_back_and_says_what_it_stopped(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await _write(s, sid, "/workspace/db/data.sql", b"rows")
    await _write(s, sid, "/workspace/keep.txt", b"v1")
    taken = await s.service.checkpoints.create(dev, sid, "good")
    await s.service.commands.run(dev, sid, Command("rm -rf /workspace/db"))
    await _write(s, sid, "/workspace/new.txt", b"made after")
    await s.service.processes.start(dev, sid, Command("sleep 300", tag="server"))
    assert not s.file(sid, "/workspace/db").exists()
    result = await s.service.checkpoints.restore(dev, sid, "good")
    await s.service.engine.alive(sid)
    assert result.checkpoint.id == taken.id and result.paths is None
    assert [p["cmd"] for p in result.stopped.processes] == ["sleep 300"]
    assert await _read(s, sid, "/workspace/db/data.sql") == b"rows"
    assert not s.file(sid, "/workspace/new.txt").exists()  # made since: gone
    record = (await s.records("checkpoint.restore"))[0]
    assert record["params"] == {"checkpoint": "good", "paths": None}
    assert record["outcome"]["checkpoint"] == taken.id and record["key_id"] == dev.key_id
    assert [p["cmd"] for p in record["outcome"]["stopped"]["processes"]] == ["sleep 300"]
    # The checkpoint stays: a second restore is possible.
    assert [c.id for c in await s.service.checkpoints.list(dev, sid)] == [taken.id]


async def test_restore_of_some_paths_leaves_the_rest(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await _write(s, sid, "/workspace/db/data.sql", b"rows")
    await _write(s, sid, "/workspace/notes.txt", b"old notes")
    await s.service.checkpoints.create(dev, sid, "good")
    await _write(s, sid, "/workspace/db/data.sql", b"corrupt")
    await _write(s, sid, "/workspace/notes.txt", b"new notes")
    result = await s.service.checkpoints.restore(dev, sid, "good", paths=["/workspace/db"])
    await s.service.engine.alive(sid)
    assert result.paths == ["/workspace/db"]
    assert await _read(s, sid, "/workspace/db/data.sql") == b"rows"
    assert await _read(s, sid, "/workspace/notes.txt") == b"new notes"


@pytest.mark.parametrize(("paths", "field"), [("/workspace", "paths"), ([], "paths"), (["relative"], "paths"),
                                             (["/ok", "a\0b"], "paths"), (["/w"] * 65, "paths")])
async def test_bad_restore_paths_change_nothing(setup: Setup, paths: Any, field: str) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await s.service.checkpoints.create(dev, sid, "good")
    await _write(s, sid, "/workspace/after.txt", b"x")
    with pytest.raises(InvalidRequestError) as refused:
        await s.service.checkpoints.restore(dev, sid, "good", paths=paths)
    assert field in refused.value.message or field in refused.value.details
    assert s.backend.called("restore_checkpoint") == [] and s.file(sid, "/workspace/after.txt").exists()


async def test_changes_list_paths_and_diff_text_files(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await _write(s, sid, "/workspace/code.py", b"a = 1\nb = 2\n")
    await _write(s, sid, "/workspace/gone.txt", b"bye\n")
    await _write(s, sid, "/workspace/blob.bin", b"\0\1\2")
    await s.service.checkpoints.create(dev, sid, "before")
    await _write(s, sid, "/workspace/code.py", b"a = 1\nb = 3\n")
    await s.service.files.remove(dev, sid, sandbox_path("/workspace/gone.txt"))
    await _write(s, sid, "/workspace/blob.bin", b"\0\1\2\3")
    await _write(s, sid, "/workspace/new.txt", b"hello\n")
    found = await s.service.checkpoints.changes(dev, sid, "before", diff=True)
    by_path = {c.change.path: c for c in found.changes}
    assert {p: c.change.kind for p, c in by_path.items()} == {
        "/workspace/code.py": "modified", "/workspace/gone.txt": "deleted", "/workspace/blob.bin": "modified",
        "/workspace/new.txt": "added"}
    assert "-b = 2\n+b = 3\n" in (by_path["/workspace/code.py"].diff or "")
    assert "+hello" in (by_path["/workspace/new.txt"].diff or "")
    assert "-bye" in (by_path["/workspace/gone.txt"].diff or "")
    assert by_path["/workspace/blob.bin"].diff is None  # not text
    assert not found.truncated and found.until is None
    plain = await s.service.checkpoints.changes(dev, sid, "before")
    assert all(c.diff is None for c in plain.changes)
    # Between two checkpoints.
    after = await s.service.checkpoints.create(dev, sid, "after")
    between = await s.service.checkpoints.changes(dev, sid, "before", after.id)
    assert {c.change.path for c in between.changes} == set(by_path) and between.until is not None
    assert (await s.service.checkpoints.changes(dev, sid, "after")).changes == []
    record = next(r for r in await s.records("checkpoint.changes") if r["params"]["diff"])
    assert record["params"] == {"since": "before", "until": None, "diff": True} and record["outcome"]["count"] == 4


# -- bounds, eviction, quota, destroy ---------------------------------------------------------------------------


async def test_automatic_ones_are_kept_to_checkpoint_keep_named_ones_never_evicted(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox(checkpoints="auto", checkpoint_keep=2)
    await s.service.checkpoints.create(dev, sid, "named")
    taken = []
    for n in range(4):
        with request_scope(f"r{n}") as info:
            await s.service.commands.run(dev, sid, Command(f"echo {n} > /workspace/f{n}"))
        taken.append(info.checkpoint)
    kept = await s.service.checkpoints.list(dev, sid)
    assert [c.id for c in kept if c.automatic] == [taken[3], taken[2]]
    assert [c.name for c in kept if not c.automatic] == ["named"]
    assert [c.command for c in kept if c.automatic] == ["echo 3 > /workspace/f3", "echo 2 > /workspace/f2"]
    execs = await s.records("sandbox.exec")
    assert sorted(r["outcome"].get("checkpoint") for r in execs) == sorted(taken)
    assert any(r["outcome"].get("evicted") == [taken[0]] for r in execs)


async def test_a_checkpoint_that_does_not_fit_evicts_the_oldest_automatic_then_says_which_to_delete(
        setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox(checkpoints="auto")
    await _write(s, sid, "/workspace/data", b"x" * 1000)  # an automatic one before it: empty
    await s.service.checkpoints.create(dev, sid, "named")  # 1000 bytes
    s.backend.checkpoint_room = 2500
    with request_scope("r") as info:
        await s.service.commands.run(dev, sid, Command("true"))  # 1000 more: fits
    assert info.checkpoint is not None
    with request_scope("r2") as info2:
        await s.service.commands.run(dev, sid, Command("true"))  # does not fit: the oldest automatic ones go
    kept = await s.service.checkpoints.list(dev, sid)
    assert info2.checkpoint in {c.id for c in kept} and info.checkpoint not in {c.id for c in kept}
    s.backend.checkpoint_room = 1500
    with pytest.raises(DiskFullError) as full:
        await s.service.checkpoints.create(dev, sid, "second")
    assert full.value.details["checkpoints"] == ["named"] and "named" in full.value.message
    assert [c.name for c in await s.service.checkpoints.list(dev, sid)] == ["named"]


async def test_the_snapshot_bytes_quota_counts_checkpoints(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await _write(s, sid, "/workspace/data", b"x" * 3000)
    await s.store.set_quotas(s.tenants["a"], Quotas(max_snapshot_bytes=5000))
    await s.service.checkpoints.create(dev, sid, "one")
    with pytest.raises(QuotaExceededError) as over:
        await s.service.checkpoints.create(dev, sid, "two")
    assert over.value.details["limit"] == "max_snapshot_bytes"
    assert [c.name for c in await s.service.checkpoints.list(dev, sid)] == ["one"]
    assert len(list((s.fs / f"{sid}.ckpt").iterdir())) == 1  # the refused one's bytes are gone too
    with pytest.raises(QuotaExceededError):
        await s.service.snapshots.create(dev, sid)  # 3000 of checkpoints + a snapshot's 4096 > 5000


async def test_destroyed_sandboxes_lose_their_checkpoints(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    await s.service.checkpoints.create(dev, sid, "v1")
    await s.service.sandboxes.kill(dev, sid)
    assert await s.store.checkpoints.list(s.tenants["a"], sid) == []
    assert not (s.fs / f"{sid}.ckpt").exists()


# -- automatic checkpoints before each kind of call -------------------------------------------------------------


def _tar(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def test_auto_takes_one_before_each_call_that_can_change_files(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox(checkpoints="auto", checkpoint_keep=50)
    files, p = s.service.files, sandbox_path
    calls = {
        "echo hi": lambda: s.service.commands.run(dev, sid, Command("echo hi")),
        "sleep 1": lambda: s.service.processes.start(dev, sid, Command("sleep 1")),
        "code cell (python)": lambda: s.service.code.run(dev, sid, Cell("x = 1")),
        "write /workspace/a": lambda: files.write(dev, sid, p("/workspace/a"), _chunks(b"a")),
        "make_dir /workspace/d": lambda: files.make_dir(dev, sid, p("/workspace/d")),
        "rename /workspace/a /workspace/b": lambda: files.rename(dev, sid, p("/workspace/a"), p("/workspace/b")),
        "remove /workspace/b": lambda: files.remove(dev, sid, p("/workspace/b")),
        "upload archive into /workspace/t": lambda: files.write_archive(dev, sid, p("/workspace/t"),
                                                                        _chunks(_tar("x.txt", b"x"))),
    }
    for command, call in calls.items():
        with request_scope(command) as info:
            await call()
        assert info.checkpoint is not None, command
        assert (await s.service.checkpoints.get(dev, sid, info.checkpoint)).command == command
    # Reads take none.
    with request_scope("read") as info:
        await files.list(dev, sid, p("/workspace"))
        await s.service.processes.list(dev, sid)
    assert info.checkpoint is None
    assert len(await s.service.checkpoints.list(dev, sid)) == len(calls)


async def test_manual_sandboxes_take_none_and_the_tenant_default_applies(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox()
    with request_scope("r") as info:
        await s.service.commands.run(dev, sid, Command("true"))
    assert info.checkpoint is None and await s.service.checkpoints.list(dev, sid) == []
    await s.service.tenants.update(s.who["admin"], "a", default_checkpoints="auto")
    auto = await s.sandbox()
    assert (await s.service.sandboxes.get(dev, auto)).spec.checkpoints == "auto"
    assert (await s.service.sandboxes.get(dev, await s.sandbox(checkpoints="manual"))).spec.checkpoints == "manual"
    with pytest.raises(InvalidRequestError) as bad:
        await s.service.tenants.update(s.who["admin"], "a", default_checkpoints="always")
    assert bad.value.details == {"default_checkpoints": "always"}
    assert (await s.store.get_tenant(s.tenants["a"])).default_checkpoints == "auto"


async def test_automatic_ones_stay_within_checkpoint_bytes(setup: Setup) -> None:
    s, dev = setup, setup.who["dev"]
    sid = await s.sandbox(checkpoints="auto", checkpoint_bytes=1500)
    await _write(s, sid, "/workspace/data", b"x" * 1000)
    taken = []
    for _ in range(3):  # each automatic one holds the 1000 bytes (the fake's size: every file's bytes)
        with request_scope("r") as info:
            await s.service.commands.run(dev, sid, Command("true"))
        taken.append(info.checkpoint)
    assert [c.id for c in await s.service.checkpoints.list(dev, sid) if c.automatic] == [taken[-1]]
