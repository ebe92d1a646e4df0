"""The control store: schema, tenants, sandbox records, and quotas at and past each limit."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from corral import ConflictError, InvalidRequestError, NotFoundError, QuotaExceededError
from corral.control import (
    SCHEMA_VERSION,
    Action,
    ControlStore,
    Principal,
    Quotas,
    Role,
    SandboxRecord,
    SandboxStatus,
    TenantEgress,
)
from corral.control._cache import MISSING, TTLCache
from corral.engine import Limits, SandboxSpec

pytestmark = pytest.mark.anyio

MiB = 1024**2


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(tmp_path: Path, clock: Clock) -> AsyncIterator[ControlStore]:
    async with ControlStore(home=tmp_path, clock=clock) as s:
        yield s


async def developer(store: ControlStore, tenant: str = "acme", quotas: Quotas | None = None) -> Principal:
    t = await store.create_tenant(tenant, quotas)
    return await store.authenticate((await store.create_key(t.id, Role.DEVELOPER)).key)


def spec(memory: int = 64 * MiB, cpus: float = 1.0, disk: int = 64 * MiB, timeout: float = 300,
         **metadata: str) -> SandboxSpec:
    return SandboxSpec(limits=Limits(memory=memory, cpus=cpus, disk=disk), timeout=timeout, metadata=metadata)


# -- schema --------------------------------------------------------------------------------------------------------


async def test_schema_and_sqlite_settings(store: ControlStore, tmp_path: Path) -> None:
    assert await store.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(tmp_path / "corral.db") as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {"tenants", "api_keys", "sandboxes", "audit", "schema_version"} <= tables
    async with store._db.engine.connect() as conn:
        assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1


async def test_database_is_readable_by_root_only(store: ControlStore, tmp_path: Path) -> None:
    await store.create_tenant("acme")
    for path in tmp_path.glob("corral.db*"):
        assert path.stat().st_mode & 0o077 == 0, f"{path.name} is mode {path.stat().st_mode & 0o777:o}"


async def test_foreign_keys_are_enforced(store: ControlStore, tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "corral.db") as con:
        con.execute("PRAGMA foreign_keys=ON")
        with pytest.raises(sqlite3.IntegrityError):
            con.execute("INSERT INTO api_keys (id, tenant_id, role, name, hash, prefix, created_at) "
                        "VALUES ('k', 'no-such-tenant', 'admin', '', 'h', 'p', '2030-01-01 00:00:00')")


async def test_state_survives_a_restart(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as store:
        dev = await developer(store)
        sb = await store.reserve_sandbox(dev, spec(team="x"))
        await store.start()  # starting twice (tables exist, version row exists) is harmless
    async with ControlStore(home=tmp_path) as again:
        assert await again.schema_version() == SCHEMA_VERSION
        assert (await again.get_sandbox(sb.id)) == sb
        assert [t.name for t in await again.list_tenants()] == ["acme"]


# -- tenants -------------------------------------------------------------------------------------------------------


async def test_tenants(store: ControlStore) -> None:
    quotas = Quotas(max_sandboxes=3, max_cpus=2.5)
    t = await store.create_tenant("acme", quotas)
    assert t.quotas == quotas and not t.disabled
    assert await store.get_tenant(t.id) == t == await store.tenant_by_name("acme")
    with pytest.raises(ConflictError, match="already exists"):
        await store.create_tenant("acme")
    with pytest.raises(InvalidRequestError):
        await store.create_tenant("bad name/../")
    with pytest.raises(NotFoundError):
        await store.get_tenant("tn_missing")
    updated = await store.set_quotas(t.id, Quotas(max_sandboxes=1))
    assert updated.quotas == Quotas(max_sandboxes=1) == (await store.get_tenant(t.id)).quotas


# -- sandbox records -----------------------------------------------------------------------------------------------


async def test_sandbox_lifecycle(store: ControlStore, clock: Clock) -> None:
    dev = await developer(store)
    env_spec = SandboxSpec(env={"TOKEN": "s3cret"}, metadata={"run": "1"}, timeout=60)
    sb = await store.reserve_sandbox(dev, env_spec)
    assert sb.state is SandboxStatus.CREATING and sb.live
    assert (sb.tenant_id, sb.key_id) == (dev.tenant_id, dev.key_id)
    assert sb.expires_at == clock.now + timedelta(seconds=60)
    assert "s3cret" not in str(sb.spec) and sb.spec.env == {} and sb.env_names == ("TOKEN",)
    assert sb.metadata == {"run": "1"} and sb.memory_bytes == Limits().memory
    running = await store.mark_running(sb.id, engine_id="engine-1")
    assert running.id == "engine-1" and running.state is SandboxStatus.RUNNING
    with pytest.raises(NotFoundError):
        await store.get_sandbox(sb.id)
    assert (await store.set_sandbox_state("engine-1", SandboxStatus.PAUSED)).state is SandboxStatus.PAUSED
    with pytest.raises(InvalidRequestError):
        await store.set_sandbox_state("engine-1", SandboxStatus.DESTROYED)
    clock.now += timedelta(seconds=10)
    assert (await store.set_sandbox_timeout("engine-1", 600)).expires_at == clock.now + timedelta(seconds=600)
    gone = await store.mark_destroyed("engine-1")
    assert gone.state is SandboxStatus.DESTROYED and gone.destroyed_at == clock.now
    with pytest.raises(NotFoundError):
        await store.set_sandbox_timeout("engine-1", 60)


async def test_list_and_expired(store: ControlStore, clock: Clock) -> None:
    dev = await developer(store)
    t = await store.get_tenant(dev.tenant_id)
    dev2 = await store.authenticate((await store.create_key(t.id, Role.DEVELOPER)).key)
    other = await developer(store, "other")
    a = await store.reserve_sandbox(dev, spec(timeout=10, team="red"))
    clock.now += timedelta(microseconds=1)  # listings are in creation order
    b = await store.reserve_sandbox(dev2, spec(timeout=100, team="blue"))
    c = await store.reserve_sandbox(other, spec(timeout=10))
    assert [s.id for s in await store.list_sandboxes(t.id)] == [a.id, b.id]
    assert [s.id for s in await store.list_sandboxes(t.id, key_id=dev2.key_id)] == [b.id]
    assert [s.id for s in await store.list_sandboxes(t.id, metadata={"team": "red"})] == [a.id]
    assert {s.id for s in await store.list_sandboxes(None)} == {a.id, b.id, c.id}
    await store.mark_destroyed(a.id, failed=True)
    assert [s.id for s in await store.list_sandboxes(t.id)] == [b.id]
    assert [s.state for s in await store.list_sandboxes(t.id, include_destroyed=True)] == \
        [SandboxStatus.FAILED, SandboxStatus.CREATING]
    assert await store.expired_sandboxes() == []
    clock.now += timedelta(seconds=10)  # exactly c's expiry
    assert [s.id for s in await store.expired_sandboxes()] == [c.id]  # a is destroyed, b has time left


# -- quotas --------------------------------------------------------------------------------------------------------


async def test_max_sandboxes_at_and_past_the_limit(store: ControlStore) -> None:
    dev = await developer(store, quotas=Quotas(max_sandboxes=2))
    first = await store.reserve_sandbox(dev, spec())
    await store.reserve_sandbox(dev, spec())  # exactly at the limit
    with pytest.raises(QuotaExceededError) as exc:
        await store.reserve_sandbox(dev, spec())
    message = exc.value.message
    assert "'acme'" in message and "max_sandboxes = 2" in message and "(2 in use)" in message
    assert exc.value.details["limit"] == "max_sandboxes" and exc.value.details["current"] == 2
    await store.mark_destroyed(first.id)  # destroyed sandboxes stop counting
    await store.reserve_sandbox(dev, spec())


async def test_total_memory_at_and_past_the_limit(store: ControlStore) -> None:
    dev = await developer(store, quotas=Quotas(max_memory_bytes=192 * MiB))
    await store.reserve_sandbox(dev, spec(memory=128 * MiB))
    await store.reserve_sandbox(dev, spec(memory=64 * MiB))  # 192 MiB: at the limit
    with pytest.raises(QuotaExceededError, match=r"total memory .*max_memory_bytes.*201326592 bytes in use"):
        await store.reserve_sandbox(dev, spec(memory=32 * MiB))


async def test_total_cpus_at_and_past_the_limit(store: ControlStore) -> None:
    dev = await developer(store, quotas=Quotas(max_cpus=0.3))
    for _ in range(3):
        await store.reserve_sandbox(dev, spec(cpus=0.1))  # 0.1 + 0.1 + 0.1 is not > 0.3
    with pytest.raises(QuotaExceededError, match=r"'acme'.*total cpus would be 0\.4.*max_cpus = 0\.3"):
        await store.reserve_sandbox(dev, spec(cpus=0.1))


@pytest.mark.parametrize(("quota", "field", "at", "past"), [
    ("max_sandbox_memory_bytes", "memory", 64 * MiB, 65 * MiB),
    ("max_sandbox_cpus", "cpus", 2.0, 2.5),
    ("max_sandbox_disk_bytes", "disk", 100 * MiB, 101 * MiB),
    ("max_sandbox_timeout", "timeout", 600.0, 601.0),
])
async def test_per_sandbox_maxima(store: ControlStore, quota: str, field: str, at: float, past: float) -> None:
    dev = await developer(store, quotas=Quotas(**{quota: at}))  # type: ignore[arg-type]
    await store.reserve_sandbox(dev, spec(**{field: at}))  # type: ignore[arg-type]
    with pytest.raises(QuotaExceededError, match=f"'acme'.*{quota}") as exc:
        await store.reserve_sandbox(dev, spec(**{field: past}))  # type: ignore[arg-type]
    assert exc.value.details["requested"] == past
    assert len(await store.list_sandboxes(dev.tenant_id)) == 1  # nothing recorded for the refused one


async def test_set_timeout_respects_the_maximum(store: ControlStore) -> None:
    dev = await developer(store, quotas=Quotas(max_sandbox_timeout=600))
    sb = await store.reserve_sandbox(dev, spec(timeout=60))
    await store.set_sandbox_timeout(sb.id, 600)
    with pytest.raises(QuotaExceededError, match="max_sandbox_timeout"):
        await store.set_sandbox_timeout(sb.id, 601)
    with pytest.raises(InvalidRequestError):
        await store.set_sandbox_timeout(sb.id, -1)
    ended = await store.set_sandbox_timeout(sb.id, 0)  # 0: the TTL ends now (the reconciler acts on it)
    assert [r.id for r in await store.expired_sandboxes()] == [ended.id]


async def test_quotas_are_per_tenant(store: ControlStore) -> None:
    a = await developer(store, "a", Quotas(max_sandboxes=1))
    b = await developer(store, "b", Quotas(max_sandboxes=1))
    await store.reserve_sandbox(a, spec())
    await store.reserve_sandbox(b, spec())  # a's use does not count against b
    with pytest.raises(QuotaExceededError, match="'a'"):
        await store.reserve_sandbox(a, spec())


async def test_concurrent_creates_never_exceed_the_quota(store: ControlStore) -> None:
    dev = await developer(store, quotas=Quotas(max_sandboxes=5))
    results = await asyncio.gather(*(store.reserve_sandbox(dev, spec()) for _ in range(20)),
                                   return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 5
    assert all(isinstance(r, QuotaExceededError) for r in results if isinstance(r, BaseException))
    assert len(await store.list_sandboxes(dev.tenant_id)) == 5


async def test_two_stores_on_one_database_respect_the_quota(tmp_path: Path) -> None:
    """Two stores stand in for two server processes: only the database serialises them."""
    async with ControlStore(home=tmp_path) as one, ControlStore(home=tmp_path) as two:
        dev = await developer(one, quotas=Quotas(max_sandboxes=4))
        results = await asyncio.gather(*(s.reserve_sandbox(dev, spec()) for _ in range(6) for s in (one, two)),
                                       return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in results) == 4
        assert all(isinstance(r, QuotaExceededError) for r in results if isinstance(r, BaseException))


def test_public_surface_is_sorted_and_complete() -> None:
    import corral.control

    # The order of __all__ is ruff's (RUF022, isort-style); here: every public name is exported and exists.
    assert all(hasattr(corral.control, name) for name in corral.control.__all__)
    public = {n for n, v in vars(corral.control).items() if not n.startswith("_") and not hasattr(v, "__path__")}
    assert public - set(corral.control.__all__) <= {"annotations"}


# -- the sandbox record cache --------------------------------------------------------------------------------------


async def test_sandbox_lookups_are_served_from_memory(store: ControlStore, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = await developer(store)
    other = await developer(store, "other")
    sb = await store.mark_running((await store.reserve_sandbox(dev, spec())).id)
    assert await store.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC) == sb  # read once, then cached

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the database was used")

    monkeypatch.setattr(store._db, "read", refuse)
    for _ in range(50):
        assert await store.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC) == sb  # the full record
    with pytest.raises(NotFoundError, match=f"no sandbox '{sb.id}'"):
        await store.sandbox_for(other, sb.id, Action.SANDBOX_READ)  # another tenant's: 404, from the cache too


async def test_every_change_through_the_store_is_seen_at_once(store: ControlStore, clock: Clock) -> None:
    dev = await developer(store)
    sb = await store.reserve_sandbox(dev, spec())

    async def seen() -> SandboxRecord:
        return await store.sandbox_for(dev, sb.id, Action.SANDBOX_READ, include_destroyed=True)

    assert (await seen()).state is SandboxStatus.CREATING
    await store.mark_running(sb.id)
    assert (await seen()).state is SandboxStatus.RUNNING
    await store.set_sandbox_state(sb.id, SandboxStatus.PAUSED)
    assert (await seen()).state is SandboxStatus.PAUSED
    clock.now += timedelta(seconds=1)
    await store.set_sandbox_timeout(sb.id, 30)
    assert (await seen()).expires_at == clock.now + timedelta(seconds=30)
    await store.mark_destroyed(sb.id)
    assert (await seen()).state is SandboxStatus.DESTROYED
    with pytest.raises(NotFoundError):
        await store.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC)  # destroyed: 404 at once


async def test_a_renamed_reservation_is_gone_under_its_old_id(store: ControlStore) -> None:
    dev = await developer(store)
    sb = await store.reserve_sandbox(dev, spec())
    await store.sandbox_for(dev, sb.id, Action.SANDBOX_READ)  # cached under the reservation's id
    await store.mark_running(sb.id, engine_id="engine-7")
    with pytest.raises(NotFoundError):
        await store.sandbox_for(dev, sb.id, Action.SANDBOX_READ)
    assert (await store.sandbox_for(dev, "engine-7", Action.SANDBOX_READ)).state is SandboxStatus.RUNNING


async def test_a_sandbox_unknown_here_is_looked_up_again(tmp_path: Path) -> None:
    """Misses are not cached: a sandbox another server process just created is found at once."""
    async with ControlStore(home=tmp_path) as one, ControlStore(home=tmp_path) as two:
        dev = await developer(one)
        with pytest.raises(NotFoundError):
            await two.sandbox_for(dev, "sb-later", Action.SANDBOX_READ)
        await one.reserve_sandbox(dev, spec(), sandbox_id="sb-later")
        assert (await two.sandbox_for(dev, "sb-later", Action.SANDBOX_READ)).id == "sb-later"


def test_ttl_cache_expiry_bound_and_invalidation_race() -> None:
    clock = Clock()
    cache: TTLCache[str, int] = TTLCache(timedelta(seconds=5), clock, max_entries=3)
    token = cache.token()
    for i, key in enumerate("abcd"):
        cache.put(key, i, token)
    assert len(cache) == 3 and cache.get("a") is MISSING and cache.get("d") == 3  # the oldest went first
    clock.now += timedelta(seconds=5)
    assert cache.get("d") is MISSING  # expired
    stale_reader = cache.token()  # a reader starts...
    cache.invalidate("e")  # ...a writer commits and invalidates...
    cache.put("e", 1, stale_reader)  # ...and what the reader read is not cached
    assert cache.get("e") is MISSING
    cache.put("e", 2, cache.token())
    assert cache.get("e") == 2
    clock.now -= timedelta(seconds=1)  # a clock that goes back does not make entries live longer
    assert cache.get("e") is MISSING


async def test_private_grants(store: ControlStore) -> None:
    """The private pairs a tenant's settings hand out are those still granted; a revocation switches it off."""
    t, other = await store.create_tenant("acme"), await store.create_tenant("other")
    await store.set_tenant_egress(t.id, TenantEgress(private=["10.0.0.5:5432", "10.0.0.6:80"]))
    assert (await store.tenant_egress(t.id)).private == []  # nothing granted: nothing open
    assert await store.grants.grant(t.id, "10.0.0.5:5432", key_id="key_admin")
    assert not await store.grants.grant(t.id, "10.0.0.5:5432")  # again: unchanged, the first grant kept
    grants = await store.grants.list(t.id)
    assert [(g.destination, g.key_id) for g in grants] == [("10.0.0.5:5432", "key_admin")]
    assert grants[0].granted_at.tzinfo is not None
    assert (await store.tenant_egress(t.id)).private == ["10.0.0.5:5432"]
    assert (await store.tenant_settings(t.id))[1].private == ["10.0.0.5:5432"]
    assert await store.grants.list(other.id) == []
    assert await store.grants.revoke(t.id, "10.0.0.5:5432")
    assert not await store.grants.revoke(t.id, "10.0.0.5:5432")
    assert (await store.tenant_egress(t.id)).private == []
    await store.grants.grant(t.id, "10.0.0.5:5432")
    assert (await store.tenant_egress(t.id)).private == []  # the revocation switched it off, not just hid it


async def test_stored_secrets(store: ControlStore) -> None:
    """A tenant's stored secrets (docs/secrets.md): put replaces, the sealed text comes back only from `get`, names
    are per tenant, and a long value's sealed text fits (8192 four-byte characters seal to ~60 KB)."""
    a, b = (await store.create_tenant("a")).id, (await store.create_tenant("b")).id
    sealed = "gAAAAA" + "x" * 60_000
    first = await store.put_secret(a, "GH", ["api.github.com"], False, sealed)
    assert (first.name, first.hosts, first.body, first.sealed) == ("GH", ("api.github.com",), False, "")
    again = await store.put_secret(a, "GH", ["*.example.org"], True, "other")
    assert again.created_at == first.created_at and again.hosts == ("*.example.org",) and again.body
    assert (await store.get_secret(a, "GH")).sealed == "other"
    await store.put_secret(b, "GH", ["b.example"], False, sealed)
    assert (await store.get_secret(b, "GH")).sealed == sealed
    assert [s.name for s in await store.list_secrets(a)] == ["GH"]
    assert all(s.sealed == "" for s in await store.list_secrets(a))
    await store.delete_secret(a, "GH")
    with pytest.raises(NotFoundError):
        await store.get_secret(a, "GH")
    with pytest.raises(NotFoundError):
        await store.delete_secret(a, "GH")
    assert [s.hosts for s in await store.list_secrets(b)] == [("b.example",)]
