"""A tenant's quotas checked against a request: per sandbox, the totals of its sandboxes, snapshots and checkpoints.

Each check raises QuotaExceededError naming the limit, its value, the request and what is in use; the store calls
them inside the write transaction that records the new thing, so the check and the insert cannot interleave.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from .._exceptions import QuotaExceededError
from ._checkpoints import live_checkpoint_bytes
from ._models import SandboxRow, SnapshotRow, TenantRow

_CPU_EPSILON = 1e-9  # CPU totals are float sums (0.1 + 0.2); do not refuse a request that fits exactly


def check_limit(tenant: TenantRow, limit_name: str, limit: float | None, value: float, what: str, *,
                 current: float | None = None, unit: str = "") -> None:
    """Raise if `value` (the total after this request, or one sandbox's figure) is over `limit`."""
    if limit is None or value <= limit + _CPU_EPSILON:
        return
    in_use = f" ({_fmt(current, unit)} in use)" if current is not None else ""
    raise QuotaExceededError(
        f"tenant {tenant.name!r} quota exceeded: {what} would be {_fmt(value, unit)}, over {limit_name} = "
        f"{_fmt(limit, unit)}{in_use}",
        details={"tenant": tenant.name, "tenant_id": tenant.id, "limit": limit_name, "max": limit,
                 "requested": value, "current": current},
    )


def _fmt(value: float, unit: str) -> str:
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def check_per_sandbox(tenant: TenantRow, row: SandboxRow) -> None:
    timeout = (row.expires_at - row.created_at).total_seconds()
    check_limit(tenant, "max_sandbox_memory_bytes", tenant.max_sandbox_memory_bytes, row.memory_bytes,
                 "this sandbox's memory", unit=" bytes")
    check_limit(tenant, "max_sandbox_cpus", tenant.max_sandbox_cpus, row.cpus, "this sandbox's cpus")
    check_limit(tenant, "max_sandbox_disk_bytes", tenant.max_sandbox_disk_bytes, row.disk_bytes,
                 "this sandbox's disk", unit=" bytes")
    check_limit(tenant, "max_sandbox_timeout", tenant.max_sandbox_timeout, timeout, "a sandbox timeout", unit="s")


async def check_totals(session: AsyncSession, tenant: TenantRow, row: SandboxRow) -> None:
    if tenant.max_sandboxes is None and tenant.max_memory_bytes is None and tenant.max_cpus is None:
        return  # no total to keep: not a query on every create of an unlimited tenant
    # A sandbox paused to disk holds no memory nor CPU: it counts against `max_paused` instead.
    live = (SandboxRow.tenant_id == tenant.id, SandboxRow.destroyed_at.is_(None),
            SandboxRow.paused_to_disk.is_not(True), SandboxRow.id != row.id)
    totals = (await session.execute(select(func.count(), func.coalesce(func.sum(SandboxRow.memory_bytes), 0),
                                           func.coalesce(func.sum(SandboxRow.cpus), 0.0)).where(*live))).one()
    count, memory, cpus = int(totals[0]), int(totals[1]), float(totals[2])
    check_limit(tenant, "max_sandboxes", tenant.max_sandboxes, count + 1, "concurrent sandboxes", current=count)
    check_limit(tenant, "max_memory_bytes", tenant.max_memory_bytes, memory + row.memory_bytes,
                 "total memory", current=memory, unit=" bytes")
    check_limit(tenant, "max_cpus", tenant.max_cpus, cpus + row.cpus, "total cpus", current=cpus)


async def check_snapshot_totals(session: AsyncSession, tenant: TenantRow, size: int, *, exclusive: bool) -> None:
    """`exclusive`: is there room for one more at all (before its size is known)?"""
    live = (SnapshotRow.tenant_id == tenant.id, SnapshotRow.deleted_at.is_(None))
    totals = (await session.execute(select(func.count(), func.coalesce(func.sum(SnapshotRow.size_bytes), 0))
                                    .where(*live))).one()
    count, used = int(totals[0]), int(totals[1])
    check_limit(tenant, "max_snapshots", tenant.max_snapshots, count + 1, "snapshots", current=count)
    if tenant.max_snapshot_bytes is not None:  # the tenant's checkpoints count against the same bytes
        used += await live_checkpoint_bytes(session, tenant.id)
    if exclusive:
        if tenant.max_snapshot_bytes is not None and used >= tenant.max_snapshot_bytes:
            check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + 1,
                         "total snapshot size", current=used, unit=" bytes")
        return
    check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + size, "total snapshot size",
                 current=used, unit=" bytes")


async def check_checkpoint_bytes(session: AsyncSession, tenant: TenantRow, size: int) -> None:
    """A checkpoint of `size` more bytes within the tenant's `max_snapshot_bytes` (snapshots and checkpoints)."""
    if tenant.max_snapshot_bytes is None:
        return
    live = (SnapshotRow.tenant_id == tenant.id, SnapshotRow.deleted_at.is_(None))
    used = int(await session.scalar(select(func.coalesce(func.sum(SnapshotRow.size_bytes), 0)).where(*live)) or 0)
    used += await live_checkpoint_bytes(session, tenant.id)
    check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + size,
                 "total snapshot and checkpoint size", current=used, unit=" bytes")
