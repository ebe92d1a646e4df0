"""What several replicas on one database share (docs/replicas.md): heartbeats, leases, the signing secret, and
the records of sandboxes whose replica stopped answering.

```python
registry = store.replicas
await registry.heartbeat("r-a", "http://10.0.0.5:7770")   # every ttl/3 seconds
await registry.alive("r-b", ttl)                          # its heartbeat is younger than ttl
if await registry.acquire("reconciler", "r-a", ttl):      # one holder at a time, renewed by it
    await registry.mark_lost(ttl)                         # the dead replicas' sandboxes: lost or failed
```

A lease is one row, taken with one conditional UPDATE (`WHERE expires_at < now OR holder = me`) and created with
an INSERT that a concurrent creator loses on the primary key: two replicas can never both believe they hold it.
Times are the replicas' own clocks; they must agree to well within a TTL (NTP does that).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from ._cache import TTLCache
from ._db import Database
from ._models import (
    ClusterSecretRow,
    LeaseRow,
    ReplicaInfo,
    ReplicaRow,
    SandboxRecord,
    SandboxRow,
    SandboxStatus,
    sandbox_from_row,
)

__all__ = ["ReplicaRegistry"]

REPLICA_SECRET_NAME = "replica"  # noqa: S105 - the row's name in `cluster_secrets`, not a secret
_UNFINISHED = (SandboxStatus.CREATING.value,)  # a create its replica never finished: it never ran for anyone
_LIVE_STATES = (SandboxStatus.RUNNING.value, SandboxStatus.PAUSED.value)


class ReplicaRegistry:
    def __init__(self, db: Database, clock: Callable[[], datetime],
                 sandboxes: TTLCache[str, SandboxRecord]) -> None:
        self._db = db
        self._now = clock
        self._sandboxes = sandboxes  # the store's record cache: what this registry changes is invalidated there

    # -- heartbeats ------------------------------------------------------------------------------------------

    async def heartbeat(self, replica_id: str, url: str) -> None:
        """Record that `replica_id` is alive and reachable at `url` (inserted the first time)."""
        now = self._now()
        async with self._db.write() as session:
            row = await session.get(ReplicaRow, replica_id)
            if row is None:
                session.add(ReplicaRow(id=replica_id, url=url, started_at=now, heartbeat_at=now))
            else:
                row.url, row.heartbeat_at = url, now

    async def all(self, ttl: timedelta) -> list[ReplicaInfo]:
        now = self._now()
        async with self._db.read() as session:
            rows = (await session.scalars(select(ReplicaRow).order_by(ReplicaRow.id))).all()
        return [ReplicaInfo(r.id, r.url, r.started_at, r.heartbeat_at, now - r.heartbeat_at < ttl) for r in rows]

    async def get(self, replica_id: str, ttl: timedelta) -> ReplicaInfo | None:
        async with self._db.read() as session:
            row = await session.get(ReplicaRow, replica_id)
        if row is None:
            return None
        return ReplicaInfo(row.id, row.url, row.started_at, row.heartbeat_at, self._now() - row.heartbeat_at < ttl)

    # -- leases ----------------------------------------------------------------------------------------------

    async def acquire(self, name: str, holder: str, ttl: timedelta) -> bool:
        """Take or renew the lease `name` for `ttl`; False if another holder's lease has not expired."""
        now = self._now()
        taken = (update(LeaseRow).where(LeaseRow.name == name,
                                        or_(LeaseRow.expires_at < now, LeaseRow.holder == holder))
                 .values(holder=holder, expires_at=now + ttl))
        async with self._db.write() as session:
            if (await session.execute(taken)).rowcount == 1:  # type: ignore[attr-defined]
                return True
        try:
            async with self._db.write() as session:
                session.add(LeaseRow(name=name, holder=holder, expires_at=now + ttl))
        except IntegrityError:  # the row exists (another holder's), or another replica created it just now
            return False
        return True

    async def release(self, name: str, holder: str) -> None:
        """Give the lease up now (a clean shutdown), so another replica need not wait for it to expire."""
        async with self._db.write() as session:
            await session.execute(update(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder)
                                  .values(expires_at=self._now() - timedelta(seconds=1)))

    async def holder(self, name: str) -> str | None:
        async with self._db.read() as session:
            row = await session.get(LeaseRow, name)
        return row.holder if row is not None and row.expires_at >= self._now() else None

    # -- the shared secret -----------------------------------------------------------------------------------

    async def secret(self) -> str:
        """The replicas' signing secret, made by whichever replica asks first."""
        async with self._db.read() as session:
            row = await session.get(ClusterSecretRow, REPLICA_SECRET_NAME)
        if row is not None:
            return row.value
        try:
            async with self._db.write() as session:
                session.add(ClusterSecretRow(name=REPLICA_SECRET_NAME, value=secrets.token_hex(32),
                                             created_at=self._now()))
        except IntegrityError:
            pass  # another replica made it first: use theirs
        async with self._db.read() as session:
            made = await session.get(ClusterSecretRow, REPLICA_SECRET_NAME)
        assert made is not None
        return made.value

    # -- failover --------------------------------------------------------------------------------------------

    async def mark_lost(self, ttl: timedelta) -> list[SandboxRecord]:
        """The sandboxes of every replica whose heartbeat is older than `ttl`: a create it never finished is
        failed (ended; it never ran for anyone), a running or paused one `lost` (kept: it comes back if its
        replica does). Returns the records changed, for the audit trail."""
        now = self._now()
        changed: list[SandboxRecord] = []
        async with self._db.write() as session:
            dead = {r.id: r.heartbeat_at for r in (await session.scalars(
                select(ReplicaRow).where(ReplicaRow.heartbeat_at <= now - ttl))).all()}
            if not dead:
                return []
            rows = (await session.scalars(select(SandboxRow).where(
                SandboxRow.owner.in_(sorted(dead)), SandboxRow.destroyed_at.is_(None),
                SandboxRow.state.in_([*_UNFINISHED, *_LIVE_STATES])))).all()
            for row in rows:
                changed.append(_lose(row, dead[row.owner or ""], now))
        for record in changed:
            self._sandboxes.invalidate(record.id)
        return changed

    async def expired_lost(self) -> list[SandboxRecord]:
        """Lost sandboxes past their timeout: nobody can end them in a backend, so only their records end."""
        stmt = select(SandboxRow).where(SandboxRow.destroyed_at.is_(None), SandboxRow.expires_at <= self._now(),
                                        SandboxRow.state == SandboxStatus.LOST.value)
        async with self._db.read() as session:
            return [sandbox_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def owned(self, owner: str, states: tuple[SandboxStatus, ...]) -> list[SandboxRecord]:
        """Live records that `owner` runs (or ran) in one of `states`, for that replica's own start."""
        stmt = select(SandboxRow).where(SandboxRow.owner == owner, SandboxRow.destroyed_at.is_(None),
                                        SandboxRow.state.in_([s.value for s in states]))
        async with self._db.read() as session:
            return [sandbox_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def recovered(self, sandbox_id: str, owner: str) -> SandboxRecord | None:
        """A lost sandbox whose replica came back and still runs it: running again (None if no longer lost)."""
        async with self._db.write() as session:
            row = await _owned_row(session, sandbox_id, owner)
            if row is None or row.state != SandboxStatus.LOST.value:
                return None
            row.state, row.reason = SandboxStatus.RUNNING.value, None
        self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def ended(self, sandbox_ids: list[str]) -> list[str]:
        """Which of `sandbox_ids` have ended records (killed through another replica, the kill switch)."""
        if not sandbox_ids:
            return []
        stmt = select(SandboxRow.id).where(SandboxRow.id.in_(sandbox_ids), SandboxRow.destroyed_at.is_not(None))
        async with self._db.read() as session:
            return list((await session.scalars(stmt)).all())

    async def claim_unowned(self, sandbox_ids: list[str], owner: str) -> int:
        """Records made before replicas (owner NULL) that this replica's engine runs become its own."""
        if not sandbox_ids:
            return 0
        async with self._db.write() as session:
            done = await session.execute(update(SandboxRow).where(SandboxRow.id.in_(sandbox_ids),
                                                                  SandboxRow.owner.is_(None)).values(owner=owner))
        for sandbox_id in sandbox_ids:
            self._sandboxes.invalidate(sandbox_id)
        return int(done.rowcount)  # type: ignore[attr-defined]


def _lose(row: SandboxRow, heartbeat_at: datetime, now: datetime) -> SandboxRecord:
    since = heartbeat_at.isoformat(timespec="seconds")
    if row.state in _UNFINISHED:
        row.state, row.destroyed_at = SandboxStatus.FAILED.value, now
        row.reason = f"replica {row.owner} stopped answering (last heartbeat {since}) while creating it"
    else:
        row.state = SandboxStatus.LOST.value
        row.reason = (f"replica {row.owner}, which runs this sandbox, stopped answering (last heartbeat {since}); "
                      "it is back if that replica restarts, else kill it")
    return sandbox_from_row(row)


async def _owned_row(session: AsyncSession, sandbox_id: str, owner: str) -> SandboxRow | None:
    row = await session.get(SandboxRow, sandbox_id)
    return row if row is not None and row.owner == owner and row.destroyed_at is None else None
