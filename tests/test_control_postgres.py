"""The control store on PostgreSQL: a throwaway cluster for the session (tests/postgres_support.py), the store's
own tests run again on it, and what only several replicas on one database can break (quotas and the audit chain
under concurrent writers, caches that other replicas do not invalidate).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text, update

from corral import AuthenticationError, NotFoundError, QuotaExceededError
from corral.control import SCHEMA_VERSION, Action, ControlStore, Quotas, Role
from corral.control._models import AuditRow
from corral.engine import SandboxSpec

from . import postgres_support
from . import test_control_audit as audit_tests
from . import test_control_audit_key as key_tests
from . import test_control_auth as auth_tests
from . import test_control_store as store_tests
from .postgres_support import DATABASE, PG_USER, Cluster

__all__ = ["DATABASE", "PG_USER", "Cluster", "postgres"]

pytestmark = pytest.mark.anyio

_TABLES = "tenants, api_keys, sandboxes, audit"


# -- the throwaway cluster (tests/postgres_support.py) ---------------------------------------------------------------

postgres = postgres_support.postgres  # the session's cluster, for this module and those that import it from here


@pytest.fixture
async def pg_url(postgres: Cluster, tmp_path: Path) -> str:
    """The session's database, emptied: every test starts from no tenants, keys, sandboxes or records."""
    url = postgres.url()
    async with ControlStore(url, home=tmp_path) as store:  # creates the tables the first time
        async with store._db.engine.begin() as conn:
            await conn.execute(text(f"TRUNCATE {_TABLES} CASCADE"))
    return url


@pytest.fixture
def clock() -> auth_tests.Clock:
    return auth_tests.Clock()


@pytest.fixture
async def store(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path,
                clock: auth_tests.Clock) -> AsyncIterator[ControlStore]:
    # The audit tests count on their own clock (one second later at every reading); the others share `clock`.
    chosen: Any = audit_tests.Clock() if request.function.__module__ == audit_tests.__name__ else clock
    async with ControlStore(pg_url, home=tmp_path, clock=chosen) as s:
        yield s


# -- the store's own tests, on PostgreSQL --------------------------------------------------------------------------
# The same functions as in the SQLite modules, collected here again with this module's `store` fixture. Left out
# are only those that open the SQLite file directly (file modes, pragmas, raw tampering: see below for the last).

chain = audit_tests.chain

test_tenants = store_tests.test_tenants
test_stored_secrets = store_tests.test_stored_secrets
test_private_grants = store_tests.test_private_grants
test_sandbox_lifecycle = store_tests.test_sandbox_lifecycle
test_list_and_expired = store_tests.test_list_and_expired
test_max_sandboxes_at_and_past_the_limit = store_tests.test_max_sandboxes_at_and_past_the_limit
test_total_memory_at_and_past_the_limit = store_tests.test_total_memory_at_and_past_the_limit
test_total_cpus_at_and_past_the_limit = store_tests.test_total_cpus_at_and_past_the_limit
test_per_sandbox_maxima = store_tests.test_per_sandbox_maxima
test_set_timeout_respects_the_maximum = store_tests.test_set_timeout_respects_the_maximum
test_quotas_are_per_tenant = store_tests.test_quotas_are_per_tenant
test_concurrent_creates_never_exceed_the_quota = store_tests.test_concurrent_creates_never_exceed_the_quota

test_authenticate_returns_the_principal = auth_tests.test_authenticate_returns_the_principal
test_wrong_secret_with_a_known_prefix_is_refused = auth_tests.test_wrong_secret_with_a_known_prefix_is_refused
test_revoked_key_stops_working = auth_tests.test_revoked_key_stops_working
test_last_used_is_recorded_and_throttled = auth_tests.test_last_used_is_recorded_and_throttled
test_disabled_tenant_cannot_authenticate = auth_tests.test_disabled_tenant_cannot_authenticate
test_key_creation_validates_role_and_tenant = auth_tests.test_key_creation_validates_role_and_tenant
test_list_keys_by_tenant = auth_tests.test_list_keys_by_tenant
test_store_hides_other_tenants_sandboxes = auth_tests.test_store_hides_other_tenants_sandboxes
test_reserve_needs_the_create_permission = auth_tests.test_reserve_needs_the_create_permission

test_concurrent_appends_make_one_chain = audit_tests.test_concurrent_appends_make_one_chain
test_empty_log = audit_tests.test_empty_log
test_hash_covers_every_field = audit_tests.test_hash_covers_every_field
test_records_keep_commands_verbatim_and_file_digests = audit_tests.test_records_keep_commands_verbatim_and_file_digests
test_params_are_stored_as_they_read_back = audit_tests.test_params_are_stored_as_they_read_back
test_query_filters = audit_tests.test_query_filters
test_export_jsonl_round_trip = audit_tests.test_export_jsonl_round_trip
test_export_filters = audit_tests.test_export_filters
test_follow_yields_new_records = audit_tests.test_follow_yields_new_records
test_follow_from_a_seq = audit_tests.test_follow_from_a_seq


# -- several replicas on one database ------------------------------------------------------------------------------

REPLICAS = 3


async def replicas(url: str, tmp_path: Path, n: int = REPLICAS, **kwargs: Any) -> list[ControlStore]:
    stores = [ControlStore(url, home=tmp_path, **kwargs) for _ in range(n)]
    for s in stores:
        await s.start()
    return stores


async def close_all(stores: list[ControlStore]) -> None:
    for s in stores:
        await s.close()


async def developer(store: ControlStore, quotas: Quotas | None = None) -> tuple[Any, str]:
    tenant = await store.create_tenant("acme", quotas)
    key = (await store.create_key(tenant.id, Role.DEVELOPER)).key
    return await store.authenticate(key), key


async def test_replicas_never_exceed_the_quota_together(pg_url: str, tmp_path: Path) -> None:
    """Each store's own lock cannot see the others: only the tenant row lock (SELECT ... FOR UPDATE) holds."""
    stores = await replicas(pg_url, tmp_path)
    try:
        dev, _ = await developer(stores[0], Quotas(max_sandboxes=4, max_memory_bytes=6 * 64 * 1024**2))
        spec = store_tests.spec()
        results = await asyncio.gather(*(s.reserve_sandbox(dev, spec) for _ in range(8) for s in stores),
                                       return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in results) == 4, results
        assert all(isinstance(r, QuotaExceededError) for r in results if isinstance(r, BaseException))
        assert len(await stores[1].list_sandboxes(dev.tenant_id)) == 4
    finally:
        await close_all(stores)


async def test_replicas_appending_at_once_keep_one_chain(pg_url: str, tmp_path: Path) -> None:
    """Every store believes its own in-memory head: the seq primary key turns each stale guess into a retry."""
    stores = await replicas(pg_url, tmp_path)
    try:
        await asyncio.gather(*(s.audit.append(audit_tests.event(i)) for i in range(40) for s in stores))
        result = await stores[0].audit.verify()
        assert result.ok and result.checked == 40 * REPLICAS, result
        seqs = [e.seq for e in await stores[2].audit.query(limit=None)]
        assert seqs == list(range(1, 40 * REPLICAS + 1))
    finally:
        await close_all(stores)


async def test_replicas_starting_together_create_the_schema_once(postgres: Cluster, tmp_path: Path) -> None:
    fresh = f"corral_fresh_{os.getpid()}"
    async with ControlStore(postgres.url(), home=tmp_path) as admin:
        async with admin._db.engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await auto.execute(text(f"CREATE DATABASE {fresh}"))
    stores = [ControlStore(postgres.url(fresh), home=tmp_path) for _ in range(REPLICAS)]
    try:
        await asyncio.gather(*(s.start() for s in stores))
        assert {await s.schema_version() for s in stores} == {SCHEMA_VERSION}
    finally:
        await close_all(stores)


async def test_revocation_reaches_other_replicas_within_the_cache_ttl(pg_url: str, tmp_path: Path) -> None:
    clock = auth_tests.Clock()
    one, two = await replicas(pg_url, tmp_path, 2, clock=clock, cache_ttl=5)
    try:
        tenant = await one.create_tenant("acme")
        new = await one.create_key(tenant.id, Role.DEVELOPER)
        await two.authenticate(new.key)  # now cached by `two`
        await one.revoke_key(new.info.id)
        with pytest.raises(AuthenticationError, match="revoked"):
            await one.authenticate(new.key)  # the store that revoked it: at once
        await two.authenticate(new.key)  # another replica: still cached...
        clock.advance(5)
        with pytest.raises(AuthenticationError, match="revoked"):
            await two.authenticate(new.key)  # ...for at most the TTL
    finally:
        await close_all([one, two])


async def test_destroyed_sandbox_reaches_other_replicas_within_the_cache_ttl(pg_url: str, tmp_path: Path) -> None:
    clock = auth_tests.Clock()
    one, two = await replicas(pg_url, tmp_path, 2, clock=clock, cache_ttl=5)
    try:
        dev, _ = await developer(one)
        sb = await one.reserve_sandbox(dev, SandboxSpec())
        assert (await two.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC)).id == sb.id  # cached by `two`
        await one.mark_destroyed(sb.id)
        with pytest.raises(NotFoundError):
            await one.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC)
        clock.advance(5)
        with pytest.raises(NotFoundError):
            await two.sandbox_for(dev, sb.id, Action.SANDBOX_EXEC)
    finally:
        await close_all([one, two])


# -- tampering, with SQL instead of the SQLite file ----------------------------------------------------------------


async def tamper(store: ControlStore, sql: str) -> None:
    async with store._db.engine.begin() as conn:
        await conn.execute(text(sql))


async def test_edited_record_is_reported(chain: ControlStore) -> None:
    await tamper(chain, """UPDATE audit SET params = '{"cmd": "echo innocent"}' WHERE seq = 100""")
    result = await chain.audit.verify()
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (100, "edited")
    assert result.checked == 99


async def test_deleted_record_is_reported(chain: ControlStore) -> None:
    await tamper(chain, "DELETE FROM audit WHERE seq = 50")
    result = await chain.audit.verify()
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (50, "deleted")


async def test_deleted_newest_records_are_caught_by_the_exported_head(chain: ControlStore) -> None:
    head = await chain.audit.head()
    await tamper(chain, f"DELETE FROM audit WHERE seq > {audit_tests.N - 2}")
    assert (await chain.audit.verify()).ok
    result = await chain.audit.verify(expected_head=head)
    assert result.problem is not None and result.problem.kind == "deleted"


def test_database_url_without_a_driver_gets_asyncpg(postgres: Cluster, tmp_path: Path) -> None:
    store = ControlStore(postgres.url().replace("postgresql+asyncpg://", "postgresql://"), home=tmp_path)
    assert store._db.url.drivername == "postgresql+asyncpg"


async def test_a_rewrite_rehashed_without_the_audit_key_is_reported(store: ControlStore) -> None:
    """Checklist item 39 on PostgreSQL: a middle record edited and it and every later one re-hashed (plain
    SHA-256, links intact) fails verification with the replicas' key."""
    entries = await key_tests.keyed_chain(store)
    forged = key_tests.rewritten(entries, key_tests.VICTIM, key_tests.plain_sha256)
    async with store._db.engine.begin() as conn:
        for entry in forged[key_tests.VICTIM - 1:]:
            await conn.execute(update(AuditRow).where(AuditRow.seq == entry.seq).values(
                params=entry.params, prev_hash=entry.prev_hash, hash=entry.hash, hmac_key_id=entry.hmac_key_id))
    result = await store.audit.verify()
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (key_tests.VICTIM, "edited")
    assert "re-hashed without the" in result.problem.message
