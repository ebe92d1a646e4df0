"""`ControlStore`'s sandbox records: reserved within quotas, their states, timeouts and pauses, looked up and queried.

A mixin of the store (`ControlStore(SandboxRecords, TenantHoldings)`), apart because the records and their cache
(`_sandboxes`, see `_store`'s docstring) are a part of their own; it uses only the store's database, clock, cache
and create lock, declared below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.exc import IntegrityError

from .._exceptions import ConflictError, InvalidRequestError, NotFoundError
from ..backends._spec import SandboxSpec
from ._cache import MISSING, TTLCache
from ._checkpoints import mark_sandbox_deleted
from ._db import Database
from ._models import (
    DEFAULT_MAX_PAUSED_SECONDS,
    SandboxQuery,
    SandboxRecord,
    SandboxRow,
    SandboxStatus,
    TenantRow,
    sandbox_from_row,
)
from ._quotas import check_limit, check_per_sandbox, check_totals
from ._rbac import Action, Principal, authorize, require_sandbox
from ._rows import live_sandbox_row, new_id, sandbox_row, tenant_row


class SandboxRecords:
    """The sandbox records of `ControlStore` (which sets the attributes below)."""

    _db: Database
    _create_lock: asyncio.Lock  # quota check and insert of this process never interleave (ControlStore)
    _now: Callable[[], datetime]
    _sandboxes: TTLCache[str, SandboxRecord]  # by sandbox id

    # -- sandboxes --------------------------------------------------------------------------------------------

    async def reserve_sandbox(self, principal: Principal, spec: SandboxSpec, *, sandbox_id: str | None = None,
                              owner: str | None = None, running: bool = False) -> SandboxRecord:
        """Check the tenant's quotas and record a sandbox in state `creating`, in one transaction; `owner` is the
        replica whose backend will run it (docs/replicas.md).

        Create it in the engine next, then `mark_running` (or `mark_destroyed(failed=True)` if that fails). With
        `running`, the engine has it already (a warm pool's member, adopted): it is recorded `running` at once.
        """
        authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
        now = self._now()
        row = SandboxRow(id=sandbox_id or new_id("sb"), tenant_id=principal.tenant_id, key_id=principal.key_id,
                         template=spec.template, spec=_stored_spec(spec), metadata_=dict(spec.metadata),
                         memory_bytes=spec.limits.memory, cpus=spec.limits.cpus, disk_bytes=spec.limits.disk,
                         state=(SandboxStatus.RUNNING if running else SandboxStatus.CREATING).value, created_at=now,
                         expires_at=now + timedelta(seconds=spec.timeout), destroyed_at=None, owner=owner)
        async with self._create_lock:
            try:
                async with self._db.write() as session:
                    # FOR UPDATE serialises creates of one tenant on PostgreSQL; SQLite compiles it away (its
                    # BEGIN IMMEDIATE already holds the only write lock).
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == principal.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {principal.tenant_id!r}")
                    check_per_sandbox(tenant, row)
                    await check_totals(session, tenant, row)
                    session.add(row)
            except IntegrityError:
                raise ConflictError(f"a sandbox {row.id!r} already exists") from None
        return sandbox_from_row(row)

    async def mark_running(self, sandbox_id: str, *, engine_id: str | None = None,
                           expires_at: datetime | None = None) -> SandboxRecord:
        """The engine created it: record its state, and its engine id if that differs from the reservation's."""
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                row.state = SandboxStatus.RUNNING.value
                if engine_id is not None:
                    row.id = engine_id
                if expires_at is not None:
                    row.expires_at = expires_at
        finally:
            self._sandboxes.invalidate(sandbox_id)
            if engine_id is not None:
                self._sandboxes.invalidate(engine_id)
        return sandbox_from_row(row)

    async def set_sandbox_state(self, sandbox_id: str, state: SandboxStatus) -> SandboxRecord:
        """Running or paused; use `mark_destroyed` to end a sandbox."""
        if state not in (SandboxStatus.RUNNING, SandboxStatus.PAUSED):
            raise InvalidRequestError(f"use mark_destroyed for state {state.value!r}")
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                row.state = state.value
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def set_sandbox_timeout(self, sandbox_id: str, seconds: float) -> SandboxRecord:
        """Expire `seconds` from now (paused to disk: `seconds` after it resumes), within the tenant's
        `max_sandbox_timeout`."""
        if not seconds >= 0:
            raise InvalidRequestError("timeout must be 0 (end now) or a positive number of seconds")
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                tenant = await tenant_row(session, row.tenant_id)
                check_limit(tenant, "max_sandbox_timeout", tenant.max_sandbox_timeout, seconds,
                             "a sandbox timeout", unit="s")
                if row.paused_to_disk:
                    row.ttl_left = seconds
                else:
                    row.expires_at = self._now() + timedelta(seconds=seconds)
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def pause_to_disk(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox as paused to disk, within the tenant's `max_paused`; its timeout's clock stops.

        Call it before the engine stops the sandbox (it reserves the paused slot); `resumed` undoes it."""
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                if row.paused_to_disk:
                    raise ConflictError(f"sandbox {sandbox_id} is paused to disk already")
                tenant = await tenant_row(session, row.tenant_id)
                paused = await session.scalar(select(func.count()).where(
                    SandboxRow.tenant_id == tenant.id, SandboxRow.destroyed_at.is_(None),
                    SandboxRow.paused_to_disk.is_(True)))
                check_limit(tenant, "max_paused", tenant.max_paused, int(paused or 0) + 1,
                             "sandboxes paused to disk", current=int(paused or 0))
                now = self._now()
                row.ttl_left = max(1.0, (row.expires_at - now).total_seconds())
                row.state, row.paused_to_disk, row.paused_at = SandboxStatus.PAUSED.value, True, now
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def resumed(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox paused to disk as running again, within the tenant's running totals (it takes memory
        again); its timeout runs on from what it had left. Call it before the engine boots the sandbox."""
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                if row.paused_to_disk:
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == row.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {row.tenant_id!r}")
                    await check_totals(session, tenant, row)
                if row.ttl_left is not None:  # its clock stood still while it was paused
                    row.expires_at = self._now() + timedelta(seconds=row.ttl_left or 1.0)
                row.state, row.paused_to_disk, row.paused_at, row.ttl_left = \
                    SandboxStatus.RUNNING.value, False, None, None
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def auto_paused(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox frozen in place because its TTL ended (`on_timeout="pause_memory"`): its clock stops
        (it resumes with its whole timeout) and `max_paused_seconds` starts, as for a pause to disk."""
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                row.state, row.paused_at = SandboxStatus.PAUSED.value, self._now()
                row.ttl_left = float(row.spec.get("timeout") or 300.0)
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def forgotten_paused(self, owner: str | None = None) -> list[SandboxRecord]:
        """Sandboxes paused (to disk, or in place by their timeout) for longer than their tenant's
        `max_paused_seconds` (default 7 days); with `owner`, only that replica's (as `expired_sandboxes`)."""
        stmt = (select(SandboxRow, TenantRow.max_paused_seconds)
                .join(TenantRow, TenantRow.id == SandboxRow.tenant_id)
                .where(SandboxRow.destroyed_at.is_(None), SandboxRow.paused_at.is_not(None)))
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        now = self._now()
        async with self._db.read() as session:
            rows = (await session.execute(stmt)).all()
        return [sandbox_from_row(row) for row, limit in rows
                if row.paused_at is not None
                and (now - row.paused_at).total_seconds() > (DEFAULT_MAX_PAUSED_SECONDS if limit is None else limit)]

    async def mark_destroyed(self, sandbox_id: str, *, failed: bool = False) -> SandboxRecord:
        """The sandbox is gone (or never came up, `failed=True`): it stops counting against quotas."""
        try:
            async with self._db.write() as session:
                row = await sandbox_row(session, sandbox_id)
                if row.destroyed_at is None:
                    row.destroyed_at = self._now()
                    row.state = (SandboxStatus.FAILED if failed else SandboxStatus.DESTROYED).value
                    await mark_sandbox_deleted(session, sandbox_id, row.destroyed_at)  # they went with its disk
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def set_sandbox_network(self, sandbox_id: str, network: str | list[str]) -> SandboxRecord:
        """Record a live sandbox's new egress policy (the engine and proxy apply it; this keeps the record true)."""
        try:
            async with self._db.write() as session:
                row = await live_sandbox_row(session, sandbox_id)
                row.spec = {**row.spec, "network": network if isinstance(network, str) else list(network)}
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord:
        async with self._db.read() as session:
            return sandbox_from_row(await sandbox_row(session, sandbox_id))

    async def sandbox_for(self, principal: Principal, sandbox_id: str, action: Action, *,
                          include_destroyed: bool = False) -> SandboxRecord:
        """The sandbox if `principal` may do `action` on it; another tenant's is `NotFoundError`, like a
        missing one (checked before the role, so nothing about it leaks).

        Served from memory for `cache_ttl` seconds (see the module docstring); the record is shared between
        callers, so treat its `spec` and `metadata` as read-only.
        """
        record = await self._cached_sandbox(sandbox_id)
        if record is not None and not record.live and not include_destroyed:
            record = None
        require_sandbox(principal, action, sandbox_id, record.tenant_id if record is not None else None)
        assert record is not None
        return record

    async def find_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox's record (live or not) without authorizing anybody, served from the same cache as
        `sandbox_for`; None if there is no such sandbox. For credentials that name the sandbox themselves."""
        return await self._cached_sandbox(sandbox_id)

    async def _cached_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        record = self._sandboxes.get(sandbox_id)
        if record is not MISSING:
            return record
        token = self._sandboxes.token()
        async with self._db.read() as session:
            row = await session.get(SandboxRow, sandbox_id)
        if row is None:
            return None  # not cached: it may be created by another replica any moment
        found = sandbox_from_row(row)
        self._sandboxes.put(sandbox_id, found, token)
        return found

    async def list_sandboxes(self, tenant_id: str | None, *, key_id: str | None = None,
                             metadata: dict[str, str] | None = None,
                             include_destroyed: bool = False) -> list[SandboxRecord]:
        """Sandboxes of a tenant (None: all tenants), optionally of one key, whose metadata has these pairs."""
        query = SandboxQuery(metadata=metadata or {})
        return await self.query_sandboxes(tenant_id, query, key_id=key_id, include_destroyed=include_destroyed)

    async def query_sandboxes(self, tenant_id: str | None, query: SandboxQuery, *, key_id: str | None = None,
                              include_destroyed: bool = False) -> list[SandboxRecord]:
        """The sandboxes `query` selects, in its order, at most `query.limit` of them.

        The metadata filter runs here, not in SQL: matching inside JSON differs between SQLite and PostgreSQL;
        rows are read in order and filtered until the page is full.
        """
        stmt = select(SandboxRow).where(*_query_conditions(query))
        order = (SandboxRow.created_at.desc(), SandboxRow.id.desc()) if query.newest_first else \
            (SandboxRow.created_at, SandboxRow.id)
        stmt = stmt.order_by(*order)
        if tenant_id is not None:
            stmt = stmt.where(SandboxRow.tenant_id == tenant_id)
        if key_id is not None:
            stmt = stmt.where(SandboxRow.key_id == key_id)
        if not include_destroyed:
            stmt = stmt.where(SandboxRow.destroyed_at.is_(None))
        wanted = query.metadata.items()
        found: list[SandboxRecord] = []
        async with self._db.read() as session:
            for row in await session.scalars(stmt):
                if all(row.metadata_.get(k) == v for k, v in wanted):
                    found.append(sandbox_from_row(row))
                    if query.limit is not None and len(found) >= query.limit:
                        break
        return found

    async def expired_sandboxes(self, owner: str | None = None) -> list[SandboxRecord]:
        """Live sandboxes past their timeout, for the reaper (paused to disk: their clock stands still); with
        `owner`, only those that replica runs (and those made before replicas, which the one server ran). Lost
        ones are left to `replicas.expired_lost`: no backend here can end them."""
        stmt = select(SandboxRow).where(SandboxRow.destroyed_at.is_(None), SandboxRow.expires_at <= self._now(),
                                        SandboxRow.paused_to_disk.is_not(True), SandboxRow.paused_at.is_(None),
                                        SandboxRow.state != SandboxStatus.LOST.value)
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        async with self._db.read() as session:
            return [sandbox_from_row(r) for r in (await session.scalars(stmt.order_by(SandboxRow.expires_at))).all()]

    async def count_sandboxes(self, owner: str | None = None) -> dict[tuple[str, str], int]:
        """Live sandboxes per (tenant id, state), counted by the database in one grouped query (what a metrics
        scrape reads: its cost grows with tenants times states, not with sandboxes); with `owner`, only those
        that replica runs (and those made before replicas, as `expired_sandboxes`)."""
        stmt = select(SandboxRow.tenant_id, SandboxRow.state, func.count()).where(SandboxRow.destroyed_at.is_(None))
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        stmt = stmt.group_by(SandboxRow.tenant_id, SandboxRow.state)
        async with self._db.read() as session:
            return {(tenant, state): int(n) for tenant, state, n in (await session.execute(stmt)).all()}


def _stored_spec(spec: SandboxSpec) -> dict[str, Any]:
    """The spec as recorded: environment values are left out (they often carry secrets), names kept."""
    data = spec.model_dump(mode="json", exclude={"env"})
    data["env_names"] = sorted(spec.env)
    return data


def _query_conditions(query: SandboxQuery) -> list[ColumnElement[bool]]:
    """The SQL side of a sandbox query: state, template, creation time and where the last page ended."""
    conditions: list[ColumnElement[bool]] = []
    if query.states is not None:
        conditions.append(SandboxRow.state.in_(sorted(state.value for state in query.states)))
    if query.template is not None:
        conditions.append(SandboxRow.template == query.template)
    if query.created_after is not None:
        conditions.append(SandboxRow.created_at >= query.created_after)
    if query.after is not None:
        at, last_id = query.after
        same_time = SandboxRow.created_at == at
        if query.newest_first:
            conditions.append(or_(SandboxRow.created_at < at, and_(same_time, SandboxRow.id < last_id)))
        else:
            conditions.append(or_(SandboxRow.created_at > at, and_(same_time, SandboxRow.id > last_id)))
    return conditions
