"""A sandbox's checkpoints as the store keeps them (docs/lifecycle.md, "Checkpoints"): `store.checkpoints`.

```python
await store.checkpoints.add(principal, record)                       # name unique per sandbox, quota checked
await store.checkpoints.list(tenant_id, sandbox_id)                  # newest first
await store.checkpoints.get(tenant_id, sandbox_id, "before-migrate")  # by id or by name
await store.checkpoints.mark_deleted(checkpoint_id)
```

The backend keeps a checkpoint's bytes (`artifact`, `CheckpointArtifact.to_json()`); the store records whose it
is, its name, the command it preceded and its size. A table of its own, so older databases gain it from
`create_all`. A destroyed sandbox's checkpoints are marked deleted with it (`mark_sandbox_deleted`, called in the
destroy's transaction): they went with its disk. The tenant's `max_snapshot_bytes` counts the bytes of its live
checkpoints as well as its snapshots' (`live_bytes`); `max_snapshots` counts snapshots only.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, String, Text, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from .._exceptions import ConflictError, NotFoundError
from ._db import Database
from ._models import Base, TenantRow
from ._rbac import Principal

__all__ = ["CheckpointRecord", "CheckpointRow", "CheckpointStore", "live_checkpoint_bytes"]


class CheckpointRow(Base):
    """One checkpoint of a sandbox; a name is unique among the sandbox's live ones."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        Index("ix_checkpoints_sandbox_live", "sandbox_id", "deleted_at"),
        Index("ix_checkpoints_tenant_live", "tenant_id", "deleted_at"),
        Index("ux_checkpoints_sandbox_name_live", "sandbox_id", "name", unique=True,
              sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    sandbox_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(40))  # who took it (an automatic one: whose call)
    name: Mapped[str | None] = mapped_column(String(128))
    command: Mapped[str | None] = mapped_column(Text)  # what an automatic one preceded ("rm -rf /workspace")
    automatic: Mapped[bool] = mapped_column(Boolean, default=False)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    artifact: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


@dataclass(frozen=True)
class CheckpointRecord:
    id: str
    tenant_id: str
    sandbox_id: str
    name: str | None
    created_at: datetime
    size_bytes: int
    command: str | None
    automatic: bool
    artifact: dict[str, Any]
    deleted_at: datetime | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None


def _record(row: CheckpointRow) -> CheckpointRecord:
    return CheckpointRecord(id=row.id, tenant_id=row.tenant_id, sandbox_id=row.sandbox_id, name=row.name,
                            created_at=row.created_at, size_bytes=row.size_bytes, command=row.command,
                            automatic=bool(row.automatic), artifact=dict(row.artifact), deleted_at=row.deleted_at)


async def live_checkpoint_bytes(session: AsyncSession, tenant_id: str) -> int:
    """What the tenant's live checkpoints hold, read in the caller's session (the snapshot quota adds it)."""
    total = await session.scalar(select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
        CheckpointRow.tenant_id == tenant_id, CheckpointRow.deleted_at.is_(None)))
    return int(total or 0)


async def mark_sandbox_deleted(session: AsyncSession, sandbox_id: str, now: datetime) -> None:
    """The sandbox is gone, and its checkpoints with its disk: in the caller's (the destroy's) transaction."""
    await session.execute(update(CheckpointRow).where(CheckpointRow.sandbox_id == sandbox_id,
                                                      CheckpointRow.deleted_at.is_(None)).values(deleted_at=now))


# The quota check: (session, tenant row, bytes to add) -> raises QuotaExceededError. The store's own, passed in, so
# this module needs nothing of `_store` (which imports it).
QuotaCheck = Callable[[AsyncSession, TenantRow, int], Any]


class CheckpointStore:
    def __init__(self, db: Database, clock: Callable[[], datetime], quota: QuotaCheck) -> None:
        self._db = db
        self._now = clock
        self._quota = quota

    async def add(self, principal: Principal, record: CheckpointRecord) -> CheckpointRecord:
        """Record a checkpoint the engine took, within the tenant's `max_snapshot_bytes` (QuotaExceededError);
        a name taken by another of the sandbox's live checkpoints is ConflictError."""
        async with self._db.write() as session:
            tenant = await session.scalar(select(TenantRow).where(TenantRow.id == record.tenant_id).with_for_update())
            if tenant is None:
                raise NotFoundError(f"no tenant {record.tenant_id!r}")
            if record.name is not None and await _named(session, record.sandbox_id, record.name) is not None:
                raise ConflictError(f"sandbox {record.sandbox_id} has a checkpoint named {record.name!r} already; "
                                    "delete it or choose another name", details={"name": record.name})
            await self._quota(session, tenant, record.size_bytes)
            session.add(CheckpointRow(id=record.id, tenant_id=record.tenant_id, sandbox_id=record.sandbox_id,
                                      key_id=principal.key_id, name=record.name, command=record.command,
                                      automatic=record.automatic, size_bytes=record.size_bytes,
                                      artifact=record.artifact, created_at=record.created_at, deleted_at=None))
        return record

    async def name_taken(self, sandbox_id: str, name: str) -> bool:
        async with self._db.read() as session:
            return await _named(session, sandbox_id, name) is not None

    async def get(self, tenant_id: str, sandbox_id: str, checkpoint: str) -> CheckpointRecord:
        """The sandbox's live checkpoint with this id or name; another sandbox's (or tenant's) is unknown here."""
        async with self._db.read() as session:
            row = await session.get(CheckpointRow, checkpoint)
            if row is None or row.sandbox_id != sandbox_id or row.tenant_id != tenant_id or row.deleted_at is not None:
                row = await _named(session, sandbox_id, checkpoint)
        if row is None or row.tenant_id != tenant_id:
            raise NotFoundError(f"sandbox {sandbox_id} has no checkpoint {checkpoint!r}",
                                details={"checkpoint": checkpoint})
        return _record(row)

    async def list(self, tenant_id: str, sandbox_id: str) -> builtins.list[CheckpointRecord]:
        """The sandbox's live checkpoints, newest first."""
        stmt = (select(CheckpointRow).where(CheckpointRow.tenant_id == tenant_id,
                                            CheckpointRow.sandbox_id == sandbox_id,
                                            CheckpointRow.deleted_at.is_(None))
                .order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()))
        async with self._db.read() as session:
            return [_record(r) for r in (await session.scalars(stmt)).all()]

    async def mark_deleted(self, checkpoint_id: str) -> None:
        async with self._db.write() as session:
            row = await session.get(CheckpointRow, checkpoint_id)
            if row is not None and row.deleted_at is None:
                row.deleted_at = self._now()


async def _named(session: AsyncSession, sandbox_id: str, name: str) -> CheckpointRow | None:
    return await session.scalar(select(CheckpointRow).where(
        CheckpointRow.sandbox_id == sandbox_id, CheckpointRow.name == name, CheckpointRow.deleted_at.is_(None)))
