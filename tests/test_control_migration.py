"""A database made by an older Corral gains the columns added since (all nullable) when a new one opens it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from corral.backends import SandboxSpec
from corral.control import AuditEvent, AuditKeyring, ControlStore, Principal, Quotas, Role

pytestmark = pytest.mark.anyio

_ADDED = {"sandboxes": ["paused_to_disk", "paused_at", "ttl_left", "owner", "reason"],
          "tenants": ["max_paused", "max_paused_seconds", "max_snapshots", "max_snapshot_bytes"]}


def _columns(db: Path, table: str) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


async def test_an_older_database_gains_the_new_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    store = ControlStore(home=tmp_path)
    await store.start()
    tenant = await store.create_tenant("old")
    key = await store.create_key(tenant.id, Role.DEVELOPER)
    principal = Principal(tenant.id, key.info.id, Role.DEVELOPER)
    kept = await store.reserve_sandbox(principal, SandboxSpec(), sandbox_id="sb-0000000000000001")
    await store.close()
    db = tmp_path / "corral.db"
    with sqlite3.connect(db) as conn:  # what the first schema had: none of the lifecycle columns
        for table, columns in _ADDED.items():
            for column in columns:
                conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    assert not any(set(cols) & _columns(db, t) for t, cols in _ADDED.items())

    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        for table, columns in _ADDED.items():
            assert set(columns) <= _columns(db, table)
        record = await store.get_sandbox(kept.id)
        assert record.id == kept.id and not record.paused_to_disk
        await store.mark_running(kept.id)
        paused = await store.pause_to_disk(kept.id)
        assert paused.paused_to_disk and paused.ttl_left is not None
        updated = await store.set_quotas(tenant.id, Quotas(max_paused=3))
        assert updated.quotas.max_paused == 3
    finally:
        await store.close()


async def test_an_older_database_without_required_runtime_starts_and_reads_none(tmp_path: Path) -> None:
    store = ControlStore(home=tmp_path)
    await store.start()
    tenant = await store.create_tenant("old")
    await store.close()
    db = tmp_path / "corral.db"
    with sqlite3.connect(db) as conn:  # a database from before the runtime policy
        conn.execute("ALTER TABLE tenants DROP COLUMN required_runtime")
    assert "required_runtime" not in _columns(db, "tenants")

    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        assert "required_runtime" in _columns(db, "tenants")
        assert (await store.get_tenant(tenant.id)).required_runtime is None
        assert (await store.set_required_runtime(tenant.id, "runsc")).required_runtime == "runsc"
    finally:
        await store.close()


async def test_an_older_audit_table_gains_the_key_id_and_its_unkeyed_records_still_verify(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path, audit_keys=AuditKeyring()) as old:  # records signed as before keys
        for i in range(3):
            await old.audit.append(AuditEvent(action="tenant.create", params={"n": i}))
    db = tmp_path / "corral.db"
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE audit DROP COLUMN hmac_key_id")
    assert "hmac_key_id" not in _columns(db, "audit")

    async with ControlStore(home=tmp_path) as store:
        assert "hmac_key_id" in _columns(db, "audit")
        entry = await store.audit.append(AuditEvent(action="tenant.create", params={"n": 3}))
        assert entry.hmac_key_id == store.audit.keys.signing_id
        result = await store.audit.verify()
        assert result.ok and result.checked == 4 and result.unkeyed == 3, result.problem
