"""Volumes in the store and the service, against an in-memory backend (no runtime): names, sizes, quotas, tenancy,
audit, the deletion rule, `resolve`, and what a failing backend leaves (nothing); and the SDK's surface against a
mock transport. tests/test_volumes.py does the same for real."""

from __future__ import annotations

import asyncio
import inspect
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import corral
from corral import (
    AsyncVolume,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    ServerError,
    Volume,
)
from corral.control import ControlStore, Principal, Quotas, Role
from corral.service import CreateSandbox, Service

from .fakes import FakeBackend, World, fake_service

pytestmark = pytest.mark.anyio

MIB = 2**20


class VolumeBackend(FakeBackend):
    """The fake backend's volumes (`world.volumes`: size by id), with a switch to make the next create fail."""

    def __init__(self, home: Path, world: World) -> None:
        super().__init__(home, world)
        self.fail_volume = False

    @property
    def volumes(self) -> dict[str, int]:
        return self.world.volumes

    async def create_volume(self, volume_id: str, size: int) -> None:
        if self.fail_volume:
            raise ServerError("the fake disk is broken")
        if volume_id in self.volumes:
            raise ConflictError(f"volume {volume_id} exists")
        await super().create_volume(volume_id, size)

    async def volume_used(self, volume_id: str) -> int:
        if volume_id not in self.volumes:
            raise NotFoundError(f"no volume {volume_id}")
        return 4096


@dataclass
class Setup:
    service: Service
    backend: VolumeBackend
    who: dict[str, Principal]
    tenants: dict[str, str]

    @property
    def store(self) -> ControlStore:
        return self.service.store


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    people = (("a_dev", "a", Role.DEVELOPER), ("a_aud", "a", Role.AUDITOR), ("b_dev", "b", Role.DEVELOPER))
    async with fake_service("cv-", VolumeBackend, people) as made:
        assert isinstance(made.backend, VolumeBackend)
        yield Setup(made.service, made.backend, made.who, made.tenants)


async def test_create_get_list_delete_are_audited(setup: Setup) -> None:
    s, dev = setup, setup.who["a_dev"]
    vol = await s.service.volumes.create(dev, "data", "1G")
    assert (vol.name, vol.size_bytes, vol.tenant_id, vol.backend) == ("data", 2**30, s.tenants["a"], "fake")
    assert s.backend.volumes == {vol.id: 2**30}
    detail = await s.service.volumes.get(dev, "data")
    assert detail.volume == vol and detail.used_bytes == 4096
    assert [v.name for v in await s.service.volumes.list(dev)] == ["data"]
    await s.service.volumes.delete(dev, "data")
    assert s.backend.volumes == {} and await s.service.volumes.list(dev) == []
    records = {r.action: r for r in reversed(await s.store.audit.query(tenant=s.tenants["a"]))}  # the first of each
    assert records["volume.create"].target == vol.id and records["volume.create"].outcome["status"] == 201
    assert records["volume.create"].params == {"name": "data", "size": "1G"}
    assert records["volume.get"].target == vol.id and records["volume.delete"].outcome["status"] == 204
    assert records["volume.list"].outcome == {"status": 200, "count": 1}


async def test_names_are_per_tenant_and_free_again_after_delete(setup: Setup) -> None:
    s, a, b = setup, setup.who["a_dev"], setup.who["b_dev"]
    first = await s.service.volumes.create(a, "data", "16M")
    with pytest.raises(ConflictError, match="exists already"):
        await s.service.volumes.create(a, "data", "32M")
    theirs = await s.service.volumes.create(b, "data", "16M")
    assert theirs.id != first.id
    await s.service.volumes.delete(a, "data")
    again = await s.service.volumes.create(a, "data", "16M")
    assert again.id not in (first.id, theirs.id)
    results = await asyncio.gather(s.service.volumes.create(a, "race", "16M"),
                                   s.service.volumes.create(a, "race", "16M"), return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["ConflictError", "VolumeRecord"]


async def test_another_tenants_volume_does_not_exist(setup: Setup) -> None:
    s = setup
    await s.service.volumes.create(s.who["a_dev"], "private", "16M")
    for call in (s.service.volumes.get, s.service.volumes.delete):
        with pytest.raises(NotFoundError, match="no volume named 'private'"):
            await call(s.who["b_dev"], "private")
    assert await s.service.volumes.list(s.who["b_dev"]) == []
    with pytest.raises(InvalidRequestError, match=r"no volume named 'private'.*'/mnt/p'"):
        await s.service.volumes.resolve(s.who["b_dev"], {"/mnt/p": "private"})
    assert len(s.backend.volumes) == 1


async def test_an_auditor_may_not_touch_volumes(setup: Setup) -> None:
    s, aud = setup, setup.who["a_aud"]
    with pytest.raises(PermissionDeniedError):
        await s.service.volumes.create(aud, "data", "16M")
    with pytest.raises(PermissionDeniedError):
        await s.service.volumes.list(aud)
    assert s.backend.volumes == {}
    record = (await s.store.audit.query(action="volume.create"))[-1]
    assert record.outcome == {"status": 403, "error": "permission_denied"}


@pytest.mark.parametrize(("name", "size", "says"), [("Data", "16M", "name"), ("", "16M", "name"),
                                                    ("a" * 64, "16M", "name"), ("ok", "8M", "outside 16M to 1T"),
                                                    ("ok", "1.5T", "outside"), ("ok", "big", "not a size"),
                                                    ("ok", 0, "positive")])
async def test_bad_input_creates_nothing(setup: Setup, name: str, size: int | str, says: str) -> None:
    s = setup
    with pytest.raises(InvalidRequestError, match=says):
        await s.service.volumes.create(s.who["a_dev"], name, size)
    assert s.backend.volumes == {} and await s.service.volumes.list(s.who["a_dev"]) == []
    record = (await s.store.audit.query(action="volume.create"))[-1]
    assert record.outcome == {"status": 400, "error": "invalid_request"}


async def test_quotas_count_volumes_and_their_total_size(setup: Setup) -> None:
    s, dev = setup, setup.who["a_dev"]
    await s.store.set_quotas(s.tenants["a"], Quotas(max_volumes=2, max_volume_bytes=48 * MIB))
    await s.service.volumes.create(dev, "one", "16M")
    with pytest.raises(QuotaExceededError, match="max_volume_bytes") as over:
        await s.service.volumes.create(dev, "two", "33M")
    assert over.value.details["current"] == 16 * MIB
    await s.service.volumes.create(dev, "two", "32M")  # exactly at the limit
    with pytest.raises(QuotaExceededError, match="max_volumes"):
        await s.service.volumes.create(dev, "three", "16M")
    await s.service.volumes.delete(dev, "one")
    await s.service.volumes.create(dev, "three", "16M")  # deleted ones stop counting
    assert sorted(v.name for v in await s.service.volumes.list(dev)) == ["three", "two"]
    assert len(s.backend.volumes) == 2
    assert (await s.store.get_tenant(s.tenants["a"])).quotas.max_volume_bytes == 48 * MIB


async def test_a_failing_backend_leaves_no_record(setup: Setup) -> None:
    s, dev = setup, setup.who["a_dev"]
    s.backend.fail_volume = True
    with pytest.raises(ServerError, match="broken"):
        await s.service.volumes.create(dev, "data", "16M")
    assert await s.service.volumes.list(dev) == []
    s.backend.fail_volume = False
    await s.service.volumes.create(dev, "data", "16M")  # the name and the quota were given back


async def test_deletion_is_refused_while_a_live_sandbox_has_it(setup: Setup) -> None:
    s, dev = setup, setup.who["a_dev"]
    vol = await s.service.volumes.create(dev, "data", "16M")
    assert await s.service.volumes.resolve(dev, {"/mnt/d": "data"}) == {"/mnt/d": vol.id}
    one = await s.service.sandboxes.create(dev, CreateSandbox(volumes={"/mnt/d": "data"}))
    two = await s.service.sandboxes.create(dev, CreateSandbox(volumes={"/home/user/d": "data"}))
    other = await s.service.sandboxes.create(dev, CreateSandbox())
    assert one.spec.volumes == {"/mnt/d": vol.id}  # the spec carries ids, not the tenant's names
    with pytest.raises(ConflictError) as refused:
        await s.service.volumes.delete(dev, "data")
    assert refused.value.details["sandboxes"] == [one.id, two.id]
    assert one.id in refused.value.message and two.id in refused.value.message and other.id not in refused.value.message
    await s.service.sandboxes.pause(dev, two.id)
    await s.service.sandboxes.kill(dev, one.id)
    with pytest.raises(ConflictError, match=two.id):  # paused: still its
        await s.service.volumes.delete(dev, "data")
    await s.service.sandboxes.kill(dev, two.id)
    await s.service.volumes.delete(dev, "data")
    assert s.backend.volumes == {}
    with pytest.raises(InvalidRequestError, match="no volume named 'data'"):
        await s.service.sandboxes.create(dev, CreateSandbox(volumes={"/mnt/d": "data"}))


async def test_two_replicas_cannot_take_one_name(setup: Setup) -> None:
    s = setup
    other = ControlStore(home=s.store.home)  # another server on the same database
    await other.start()
    try:
        results = await asyncio.gather(s.store.create_volume(s.who["a_dev"], "dup", MIB, backend="fake"),
                                       other.create_volume(s.who["a_dev"], "dup", MIB, backend="fake"),
                                       return_exceptions=True)
    finally:
        await other.close()
    assert sorted(type(r).__name__ for r in results) == ["ConflictError", "VolumeRecord"]
    with sqlite3.connect(s.store.home / "corral.db") as db:  # the database itself keeps live names unique
        (sql,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'ux_volumes_tenant_name_live'").fetchone()
    assert "UNIQUE" in sql and "deleted_at IS NULL" in sql


# -- the SDK's surface (no server: httpx.MockTransport) -----------------------------------------------------------


def test_volume_and_async_volume_are_twins() -> None:
    for method in ("create", "list", "get", "delete"):
        sync, asyn = getattr(Volume, method), getattr(AsyncVolume, method)
        assert inspect.iscoroutinefunction(asyn) and not inspect.iscoroutinefunction(sync), method
        ps, pa = inspect.signature(sync).parameters, inspect.signature(asyn).parameters
        assert [(p.name, p.kind, p.default) for p in ps.values()] == \
            [(p.name, p.kind, p.default) for p in pa.values()], method
    assert inspect.signature(Volume.create).parameters["size"].default == "1G"
    assert {"Volume", "AsyncVolume"} <= set(corral.__all__)


def test_the_sdk_sends_what_it_is_given_and_refuses_malformed_answers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            return httpx.Response(201, json={"id": "vol-1", "name": "data", "size": 2**30, "created_at": "t"})
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(200, json={"id": "vol-1", "name": "data"})  # no size: malformed

    transport = httpx.MockTransport(handler)
    vol = Volume.create("data", api_key="k", base_url="http://corral.test", transport=transport)
    assert (vol.id, vol.name, vol.size, vol.used) == ("vol-1", "data", 2**30, None)
    assert json.loads(seen[0].content) == {"name": "data", "size": "1G"}
    vol.delete()
    assert (seen[1].method, seen[1].url.path) == ("DELETE", "/v1/volumes/data")
    with pytest.raises(ServerError, match="malformed"):
        Volume.get("data", api_key="k", base_url="http://corral.test", transport=transport)
    with pytest.raises(TypeError):
        Volume.create("data", size=True, api_key="k", base_url="http://corral.test", transport=transport)
    assert len(seen) == 3  # the refused size never left the process
