"""`ControlStore`'s records of what a tenant keeps beside its sandboxes: snapshots, volumes and stored secrets.

A mixin of the store (`ControlStore(SandboxRecords, TenantHoldings)`), apart because each of the three is a name
unique per tenant within its quotas and none touches sandbox records or keys; it uses only the store's database,
clock and create lock, declared below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from .._exceptions import ConflictError, NotFoundError, ServerError
from ._db import Database
from ._models import (
    Resealed,
    Resealer,
    SecretRow,
    SnapshotRecord,
    SnapshotRow,
    StoredSecret,
    TenantRow,
    VolumeRecord,
    VolumeRow,
    secret_from_row,
    snapshot_from_row,
    volume_from_row,
)
from ._quotas import check_limit, check_snapshot_totals
from ._rbac import Action, Principal, authorize
from ._rows import new_id, tenant_row


class TenantHoldings:
    """Snapshots, volumes and stored secrets of `ControlStore` (which sets the attributes below)."""

    _db: Database
    _create_lock: asyncio.Lock  # quota check and insert of this process never interleave (ControlStore)
    _now: Callable[[], datetime]

    # -- snapshots -------------------------------------------------------------------------------------------

    async def check_snapshot_quota(self, tenant_id: str) -> None:
        """Refuse before the copy when the tenant has no snapshot left (`add_snapshot` checks again, with the size)."""
        async with self._db.read() as session:
            tenant = await tenant_row(session, tenant_id)
            await check_snapshot_totals(session, tenant, 0, exclusive=True)

    async def add_snapshot(self, principal: Principal, record: SnapshotRecord) -> SnapshotRecord:
        """Record a snapshot the engine made, within the tenant's `max_snapshots` and `max_snapshot_bytes`; a name
        is unique among the tenant's snapshots (ConflictError)."""
        async with self._create_lock, self._db.write() as session:
            tenant = await session.scalar(select(TenantRow).where(TenantRow.id == record.tenant_id).with_for_update())
            if tenant is None:
                raise NotFoundError(f"no tenant {record.tenant_id!r}")
            if record.name is not None and await self._snapshot_named(session, record.tenant_id, record.name):
                raise ConflictError(f"a snapshot named {record.name!r} exists already; delete it or choose another "
                                    "name", details={"name": record.name})
            await check_snapshot_totals(session, tenant, record.size_bytes, exclusive=False)
            session.add(SnapshotRow(id=record.id, tenant_id=record.tenant_id, key_id=principal.key_id,
                                    name=record.name, sandbox_id=record.sandbox_id, template=record.template,
                                    backend=record.backend, size_bytes=record.size_bytes, artifact=record.artifact,
                                    created_at=record.created_at, deleted_at=None))
        return record

    @staticmethod
    async def _snapshot_named(session: AsyncSession, tenant_id: str, name: str) -> SnapshotRow | None:
        return await session.scalar(select(SnapshotRow).where(
            SnapshotRow.tenant_id == tenant_id, SnapshotRow.name == name, SnapshotRow.deleted_at.is_(None)))

    async def get_snapshot(self, tenant_id: str, snapshot: str) -> SnapshotRecord:
        """The tenant's live snapshot with this id or name; another tenant's is as unknown as a missing one."""
        async with self._db.read() as session:
            row = await session.get(SnapshotRow, snapshot)
            if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
                row = await self._snapshot_named(session, tenant_id, snapshot)
        if row is None:
            raise NotFoundError(f"no snapshot {snapshot!r}", details={"snapshot": snapshot})
        return snapshot_from_row(row)

    async def list_snapshots(self, tenant_id: str) -> list[SnapshotRecord]:
        stmt = (select(SnapshotRow).where(SnapshotRow.tenant_id == tenant_id, SnapshotRow.deleted_at.is_(None))
                .order_by(SnapshotRow.created_at, SnapshotRow.id))
        async with self._db.read() as session:
            return [snapshot_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def mark_snapshot_deleted(self, snapshot_id: str) -> SnapshotRecord:
        async with self._db.write() as session:
            row = await session.get(SnapshotRow, snapshot_id)
            if row is None:
                raise NotFoundError(f"no snapshot {snapshot_id!r}")
            if row.deleted_at is None:
                row.deleted_at = self._now()
        return snapshot_from_row(row)

    # -- volumes (docs/volumes.md) ---------------------------------------------------------------------------------

    async def create_volume(self, principal: Principal, name: str, size_bytes: int, *, backend: str,
                            volume_id: str | None = None) -> VolumeRecord:
        """Record a volume of the caller's tenant within its `max_volumes` and `max_volume_bytes`, in one
        transaction; a name is unique among the tenant's live volumes (ConflictError). Create it in the engine
        next, and `mark_volume_deleted` if that fails."""
        authorize(principal, Action.VOLUME_CREATE, principal.tenant_id)
        row = VolumeRow(id=volume_id or new_id("vol"), tenant_id=principal.tenant_id, name=name,
                        size_bytes=size_bytes, backend=backend, created_at=self._now(), deleted_at=None)
        taken = ConflictError(f"a volume named {name!r} exists already; delete it or choose another name",
                              details={"name": name})
        async with self._create_lock:
            try:
                async with self._db.write() as session:
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == principal.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {principal.tenant_id!r}")
                    if await self._volume_named(session, tenant.id, name) is not None:
                        raise taken
                    await self._check_volume_totals(session, tenant, size_bytes)
                    session.add(row)
            except IntegrityError:  # another replica took the name meanwhile (the partial unique index)
                raise taken from None
        return volume_from_row(row)

    @staticmethod
    async def _volume_named(session: AsyncSession, tenant_id: str, name: str) -> VolumeRow | None:
        return await session.scalar(select(VolumeRow).where(
            VolumeRow.tenant_id == tenant_id, VolumeRow.name == name, VolumeRow.deleted_at.is_(None)))

    @staticmethod
    async def _check_volume_totals(session: AsyncSession, tenant: TenantRow, size_bytes: int) -> None:
        live = (VolumeRow.tenant_id == tenant.id, VolumeRow.deleted_at.is_(None))
        totals = (await session.execute(select(func.count(), func.coalesce(func.sum(VolumeRow.size_bytes), 0))
                                        .where(*live))).one()
        count, total = int(totals[0]), int(totals[1])
        check_limit(tenant, "max_volumes", tenant.max_volumes, count + 1, "volumes", current=count)
        check_limit(tenant, "max_volume_bytes", tenant.max_volume_bytes, total + size_bytes,
                     "the total size of volumes", current=total, unit=" bytes")

    async def get_volume_by_name(self, tenant_id: str, name: str) -> VolumeRecord:
        """The tenant's live volume of this name; another tenant's is as unknown as a missing one."""
        async with self._db.read() as session:
            row = await self._volume_named(session, tenant_id, name)
        if row is None:
            raise NotFoundError(f"no volume named {name!r}", details={"volume": name})
        return volume_from_row(row)

    async def list_volumes(self, tenant_id: str) -> list[VolumeRecord]:
        """The tenant's live volumes, by name."""
        stmt = (select(VolumeRow).where(VolumeRow.tenant_id == tenant_id, VolumeRow.deleted_at.is_(None))
                .order_by(VolumeRow.name))
        async with self._db.read() as session:
            return [volume_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def mark_volume_deleted(self, volume_id: str) -> VolumeRecord:
        """The volume is gone (or never came up): its name is free and it stops counting against quotas."""
        async with self._db.write() as session:
            row = await session.get(VolumeRow, volume_id)
            if row is None:
                raise NotFoundError(f"no volume {volume_id!r}")
            if row.deleted_at is None:
                row.deleted_at = self._now()
        return volume_from_row(row)

    # -- stored secrets (docs/secrets.md): values sealed by the caller, never returned but to make a sandbox -----

    async def put_secret(self, tenant_id: str, name: str, hosts: list[str], body: bool, sealed: str) -> StoredSecret:
        """Store (or replace) the tenant's secret `name`; `sealed` is the value already sealed."""
        now = self._now()
        async with self._db.write() as session:
            await tenant_row(session, tenant_id)
            row = await self._secret_named(session, tenant_id, name)
            if row is None:
                row = SecretRow(id=new_id("sec"), tenant_id=tenant_id, name=name, created_at=now)
                session.add(row)
            row.hosts, row.body, row.sealed, row.updated_at = list(hosts), body, sealed, now
        return secret_from_row(row)

    async def get_secret(self, tenant_id: str, name: str) -> StoredSecret:
        """The tenant's secret `name` with its sealed value (for a sandbox being made with it)."""
        async with self._db.read() as session:
            row = await self._secret_named(session, tenant_id, name)
        if row is None:
            raise NotFoundError(f"no stored secret named {name!r}", details={"secret": name})
        return secret_from_row(row, sealed=True)

    async def list_secrets(self, tenant_id: str) -> list[StoredSecret]:
        stmt = select(SecretRow).where(SecretRow.tenant_id == tenant_id).order_by(SecretRow.name)
        async with self._db.read() as session:
            return [secret_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def delete_secret(self, tenant_id: str, name: str) -> None:
        async with self._db.write() as session:
            row = await self._secret_named(session, tenant_id, name)
            if row is None:
                raise NotFoundError(f"no stored secret named {name!r}", details={"secret": name})
            await session.delete(row)

    async def reseal_secrets(self, keyring: Resealer) -> Resealed:
        """Every tenant's stored values sealed again with the keyring's newest key (`corral secret reseal`), so that
        older keys can leave the keyring. All are opened before any is written: one that no key opens is refused,
        naming it, and nothing changes. A value replaced meanwhile (a `put`) is kept as its `put` sealed it."""
        async with self._db.read() as session:
            rows = (await session.execute(select(SecretRow.id, SecretRow.tenant_id, SecretRow.name,
                                                 SecretRow.sealed))).all()
        fresh: list[tuple[str, str, str]] = []
        unopened: list[str] = []
        for row_id, tenant_id, name, sealed in rows:
            if keyring.current(sealed):
                continue
            try:
                fresh.append((row_id, sealed, keyring.reseal(sealed)))
            except ServerError:
                unopened.append(f"{name} of tenant {tenant_id}")
        if unopened:
            raise ServerError(f"no key in the keyring opens the stored secret(s) {', '.join(sorted(unopened))}: "
                              "put the key that sealed them back after the newest one; nothing was resealed")
        changed = 0
        async with self._db.write() as session:
            for row_id, old, new in fresh:  # compare-and-swap: a concurrent `put` wins
                done = await session.execute(update(SecretRow).where(SecretRow.id == row_id, SecretRow.sealed == old)
                                             .values(sealed=new))
                changed += int(done.rowcount)  # type: ignore[attr-defined]
        return Resealed(resealed=changed, current=len(rows) - len(fresh))

    @staticmethod
    async def _secret_named(session: AsyncSession, tenant_id: str, name: str) -> SecretRow | None:
        stmt = select(SecretRow).where(SecretRow.tenant_id == tenant_id, SecretRow.name == name)
        return (await session.scalars(stmt)).first()
