"""The reconciler: one loop that makes what runs on this node agree with what tenants asked for.

The store holds what tenants asked for (a live record until its timeout); the engine holds what runs. Every
second the reconciler ends sandboxes whose record expired: destroyed (audited `sandbox.expire`), or paused to disk
when created with `on_timeout="pause"` (`sandbox.auto_pause`; destroyed after all if the tenant's `max_paused` is
reached). Every few passes it also destroys sandboxes paused to disk for longer than their tenant's
`max_paused_seconds`, sandboxes the engine runs that no live record claims (a create interrupted between
engine and store, a record ended by another replica's kill switch), and ends the records of this replica's
sandboxes that its engine no longer runs (a server killed between a destroy and its record; a backend that lost
the sandbox while no server ran). It is the one reaper: the engine ends nothing by itself.

With several replicas on one database (docs/replicas.md) each reconciles only the sandboxes its own backend runs
(its records, and those made before replicas), and every pass destroys what its engine runs whose record another
replica ended (the kill switch received there). What concerns all of them is done by one at a time, whichever
holds the `reconciler` lease: the sandboxes of a replica that stopped answering are marked `lost` (or failed, if
it was creating them), and lost ones past their timeout end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .._exceptions import ConflictError, CorralError, NotFoundError, QuotaExceededError, SandboxTimeoutError
from ..backends import SandboxState
from ..control import AuditEvent, SandboxRecord
from ._background import cancel

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import Engine
    from ._replicas import Replica
    from ._telemetry import Telemetry

__all__ = ["PauseToDisk", "Reconciler"]

PauseToDisk = Callable[[str], Awaitable[SandboxRecord]]  # `Sandboxes.pause_to_disk`: the quota-checked pause

logger = logging.getLogger("corral.service")

INTERVAL = 1.0
LEASE = "reconciler"  # the cluster-wide jobs' lease
ORPHAN_EVERY = 10  # passes between orphan checks: they list every live record
ORPHAN_GRACE = 30.0  # seconds: a sandbox this young may still be between engine create and its record


class Reconciler:
    def __init__(self, store: ControlStore, engine: Engine, replica: Replica, pause_to_disk: PauseToDisk, *,
                 telemetry: Telemetry | None = None, interval: float = INTERVAL) -> None:
        self._store = store
        self._engine = engine
        self._replica = replica
        self._pause_to_disk = pause_to_disk
        self._telemetry = telemetry
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="corral-reconciler")

    async def close(self) -> None:
        if self._task is None:
            return
        await cancel(self._task)
        self._task = None
        with contextlib.suppress(Exception):  # best effort: otherwise the lease simply expires
            await self._store.replicas.release(LEASE, self._replica.id)

    async def _run(self) -> None:
        passes = 0
        while True:
            await asyncio.sleep(self.interval)
            passes += 1
            started, ok = time.perf_counter(), True
            try:
                await self.run_pass(orphans=passes % ORPHAN_EVERY == 0)
            except Exception:
                ok = False
                logger.exception("reconciler.pass_failed")
            if self._telemetry is not None:
                self._telemetry.reconciled(time.perf_counter() - started, ok=ok)

    async def run_pass(self, *, orphans: bool = False) -> None:
        """One pass; with `orphans`, also the checks that list every live record (every `ORPHAN_EVERY` passes)."""
        await self.expire()
        await self.remove_ended()
        await self.cluster_pass()
        if orphans:
            await self.remove_forgotten()
            await self.remove_orphans()
            await self.remove_ghosts()

    async def expire(self) -> list[str]:
        """End every sandbox past its timeout (destroyed, or paused to disk as it asked); returns their ids."""
        ended: list[str] = []
        for record in await self._store.expired_sandboxes(owner=self._replica.id):
            reason = "timeout"
            if record.spec.on_timeout == "pause_memory":
                if await self._auto_pause_in_memory(record):
                    ended.append(record.id)
                continue
            if record.spec.on_timeout == "pause":
                paused = await self._auto_pause(record)
                if paused is None:
                    continue  # failed: logged, tried again next pass
                if paused:
                    ended.append(record.id)
                    continue
                reason = "timeout; the tenant's max_paused is reached, so it could not be paused"
            if await self._destroy(record, reason):
                ended.append(record.id)
        return ended

    async def _auto_pause(self, record: SandboxRecord) -> bool | None:
        """Pause to disk at the end of the TTL: True if paused, False if the quota forbids it, None if it failed."""
        try:
            await self._pause_to_disk(record.id)
        except QuotaExceededError:
            return False
        except CorralError:
            logger.exception("sandbox.auto_pause_failed", extra={"sandbox": record.id})
            return None
        await self._store.audit.append(AuditEvent(
            action="sandbox.auto_pause", target=record.id, tenant_id=record.tenant_id,
            outcome={"status": "paused", "reason": "timeout", "to_disk": True}))
        return True

    async def _auto_pause_in_memory(self, record: SandboxRecord) -> bool:
        """Freeze in place at the end of the TTL (processes kept); False (logged, tried again) if it failed."""
        try:
            with contextlib.suppress(ConflictError):  # frozen already (paused by hand): only the record changes
                await self._engine.pause(record.id)
            await self._store.auto_paused(record.id)
        except CorralError:
            logger.exception("sandbox.auto_pause_failed", extra={"sandbox": record.id})
            return False
        await self._store.audit.append(AuditEvent(
            action="sandbox.auto_pause", target=record.id, tenant_id=record.tenant_id,
            outcome={"status": "paused", "reason": "timeout", "to_disk": False}))
        return True

    async def remove_forgotten(self) -> list[str]:
        """Destroy sandboxes paused (to disk, or in place by their timeout) for longer than their tenant allows;
        returns their ids."""
        return [record.id for record in await self._store.forgotten_paused(owner=self._replica.id)
                if await self._destroy(record, "paused for longer than the tenant's max_paused_seconds")]

    async def _destroy(self, record: SandboxRecord, reason: str) -> bool:
        try:
            with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                await self._engine.destroy(record.id)
            await self._store.mark_destroyed(record.id)
        except CorralError:
            logger.exception("sandbox.reap_failed", extra={"sandbox": record.id})
            return False
        await self._store.audit.append(AuditEvent(
            action="sandbox.expire", target=record.id, tenant_id=record.tenant_id,
            outcome={"status": "destroyed", "reason": reason}))
        return True

    async def remove_ended(self) -> list[str]:
        """Destroy what this engine runs whose record has ended elsewhere (a kill or the kill switch through
        another replica while this one did not answer it): every pass, so such a stop takes a second, not the
        orphan check's period. The record's end was audited by whoever ended it."""
        ended = await self._store.replicas.ended([info.id for info in self._engine.list()])
        for sandbox_id in ended:
            with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                await self._engine.destroy(sandbox_id)
            logger.info("sandbox.ended_elsewhere", extra={"sandbox": sandbox_id})
        return ended

    async def cluster_pass(self) -> list[str]:
        """If this replica holds (or takes) the lease: mark the sandboxes of stopped replicas, and end the records
        of lost sandboxes past their timeout. Returns the ids changed; nothing if another replica holds it."""
        replica, registry = self._replica, self._store.replicas
        if not await registry.acquire(LEASE, replica.id, replica.ttl):
            return []
        changed: list[str] = []
        for record in await registry.mark_lost(replica.ttl):
            await self._store.audit.append(AuditEvent(
                action="sandbox.lost", target=record.id, tenant_id=record.tenant_id,
                outcome={"status": record.state.value, "reason": record.reason, "replica": record.owner}))
            changed.append(record.id)
        for record in await registry.expired_lost():
            await self._store.mark_destroyed(record.id)
            await self._store.audit.append(AuditEvent(
                action="sandbox.expire", target=record.id, tenant_id=record.tenant_id,
                outcome={"status": "destroyed", "reason": f"timeout, while lost: {record.reason}"}))
            changed.append(record.id)
        return changed

    async def remove_orphans(self) -> list[str]:
        """Destroy sandboxes this engine runs that no live record claims (older than the grace period)."""
        live = {r.id for r in await self._store.list_sandboxes(None)}
        removed: list[str] = []
        for info in self._engine.list():
            if info.id in live or _young(info.created_at.timestamp()):
                continue
            with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                await self._engine.destroy(info.id)
            await self._store.audit.append(AuditEvent(
                action="sandbox.orphan", target=info.id, tenant_id=None,
                outcome={"status": "destroyed", "reason": "no live record claims it"}))
            removed.append(info.id)
        return removed


    async def remove_ghosts(self) -> list[str]:
        """End the live records of this replica's running or paused sandboxes that its engine does not run."""
        running = {info.id for info in self._engine.list()}
        ended: list[str] = []
        for record in await self._store.list_sandboxes(None):
            if record.id in running or record.owner not in (None, self._replica.id) \
                    or record.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                continue
            if record.id in {info.id for info in self._engine.list()}:  # made or adopted meanwhile
                continue
            await self._store.mark_destroyed(record.id, failed=True)
            await self._store.audit.append(AuditEvent(
                action="sandbox.lost", target=record.id, tenant_id=record.tenant_id,
                outcome={"status": "failed", "reason": "its backend no longer runs it"}))
            ended.append(record.id)
        return ended


def _young(created: float) -> bool:
    return time.time() - created < ORPHAN_GRACE
