"""The reconciler: one loop that makes what runs on this node agree with what tenants asked for.

The store holds what tenants asked for (a live record until its timeout); the engine holds what runs. Every
second the reconciler destroys sandboxes whose record expired (and audits `sandbox.expire`); every few passes it
also destroys sandboxes the engine runs that no live record claims (a create interrupted between engine and store,
a record ended by another replica's kill switch). It replaces the engine's and the server's separate reapers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from .._exceptions import CorralError, NotFoundError, SandboxTimeoutError
from ..control import AuditEvent

if TYPE_CHECKING:
    from ._service import Service

__all__ = ["Reconciler"]

logger = logging.getLogger("corral.service")

INTERVAL = 1.0
ORPHAN_EVERY = 10  # passes between orphan checks: they list every live record
ORPHAN_GRACE = 30.0  # seconds: a sandbox this young may still be between engine create and its record


class Reconciler:
    def __init__(self, service: Service, *, interval: float = INTERVAL) -> None:
        self._svc = service
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="corral-reconciler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        passes = 0
        while True:
            await asyncio.sleep(self.interval)
            passes += 1
            try:
                await self.expire()
                if passes % ORPHAN_EVERY == 0:
                    await self.remove_orphans()
            except Exception:
                logger.exception("reconciler.pass_failed")

    async def expire(self) -> list[str]:
        """Destroy every sandbox past its timeout; returns their ids."""
        svc = self._svc
        reaped: list[str] = []
        for record in await svc.store.expired_sandboxes():
            try:
                with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                    await svc.engine.destroy(record.id)
                await svc.store.mark_destroyed(record.id)
            except CorralError:
                logger.exception("sandbox.reap_failed", extra={"sandbox": record.id})
                continue
            await svc.store.audit.append(AuditEvent(
                action="sandbox.expire", target=record.id, tenant_id=record.tenant_id,
                outcome={"status": "destroyed", "reason": "timeout"}))
            reaped.append(record.id)
        return reaped

    async def remove_orphans(self) -> list[str]:
        """Destroy sandboxes this engine runs that no live record claims (older than the grace period)."""
        svc = self._svc
        live = {r.id for r in await svc.store.list_sandboxes(None)}
        removed: list[str] = []
        for info in svc.engine.list():
            if info.id in live or _young(info.created_at.timestamp()):
                continue
            with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                await svc.engine.destroy(info.id)
            await svc.store.audit.append(AuditEvent(
                action="sandbox.orphan", target=info.id, tenant_id=None,
                outcome={"status": "destroyed", "reason": "no live record claims it"}))
            removed.append(info.id)
        return removed


def _young(created: float) -> bool:
    return time.time() - created < ORPHAN_GRACE
