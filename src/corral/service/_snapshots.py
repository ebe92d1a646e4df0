"""Snapshots: a sandbox's filesystem kept as a tenant's artifact that starts sandboxes like a template.

The engine makes and removes the artifact (the backend's business: a layer, an image); the store records whose it
is, its size against the tenant's `max_snapshots` / `max_snapshot_bytes`, and its name. A snapshot the store
refuses after the copy (its size over the quota) is removed at once, so nothing unrecorded stays behind.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from .._exceptions import InvalidRequestError, ServerError
from ..backends import SnapshotArtifact
from ..control import Action, Principal, SnapshotRecord, authorize

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import Engine
    from ._audited import Auditor
    from ._on_sandbox import Authorize

__all__ = ["SNAPSHOT_ID", "Snapshots"]

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{16}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str | None) -> str | None:
    if name is None:
        return None
    if not _NAME.fullmatch(name) or SNAPSHOT_ID.fullmatch(name):
        raise InvalidRequestError(f"snapshot name {name!r} is not valid: 1-128 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit, and not shaped like a snapshot id",
                                  details={"name": name})
    return name


class Snapshots:
    def __init__(self, store: ControlStore, engine: Engine, audited: Auditor, authorize: Authorize) -> None:
        self._store = store
        self._engine = engine
        self._audited = audited
        self._authorize = authorize

    async def create(self, principal: Principal, sandbox_id: str, name: str | None = None) -> SnapshotRecord:
        store, engine = self._store, self._engine
        snapshot_id = f"snap-{secrets.token_hex(8)}"
        async with self._audited(principal, "snapshot.create", sandbox_id, params={"name": name},
                                 status=201) as audit:
            name = check_name(name)
            record = await self._authorize(principal, sandbox_id, Action.SANDBOX_UPDATE)
            authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
            await store.check_snapshot_quota(record.tenant_id)
            artifact = await engine.snapshot(sandbox_id, snapshot_id)
            snapshot = SnapshotRecord(id=snapshot_id, tenant_id=record.tenant_id, name=name, sandbox_id=sandbox_id,
                                      template=record.template, backend=engine.backend.name,
                                      size_bytes=artifact.size_bytes, artifact=artifact.to_json(),
                                      created_at=datetime.now(UTC))
            try:
                await store.add_snapshot(principal, snapshot)
            except BaseException:  # over the size quota, a name taken meanwhile: the copy must not stay
                await asyncio.shield(engine.delete_snapshot(artifact))
                raise
            audit.outcome.update(snapshot=snapshot_id, size_bytes=artifact.size_bytes)
            return snapshot

    async def list(self, principal: Principal) -> list[SnapshotRecord]:
        async with self._audited(principal, "snapshot.list", None) as audit:
            authorize(principal, Action.SANDBOX_READ, principal.tenant_id)
            found = await self._store.list_snapshots(principal.tenant_id)
            audit.outcome["count"] = len(found)
            return found

    async def get(self, principal: Principal, snapshot: str) -> SnapshotRecord:
        async with self._audited(principal, "snapshot.get", snapshot[:256]):
            return await self.authorized(principal, snapshot, Action.SANDBOX_READ)

    async def delete(self, principal: Principal, snapshot: str) -> None:
        """Sandboxes started from it keep running (the backend keeps what they use until they end)."""
        async with self._audited(principal, "snapshot.delete", snapshot[:256], status=204):
            record = await self.authorized(principal, snapshot, Action.SANDBOX_KILL)
            await self._engine.delete_snapshot(artifact_of(record))
            await self._store.mark_snapshot_deleted(record.id)

    async def authorized(self, principal: Principal, snapshot: str, action: Action) -> SnapshotRecord:
        """The caller's tenant's snapshot (by id or name); another tenant's does not exist for it."""
        authorize(principal, action, principal.tenant_id)
        return await self._store.get_snapshot(principal.tenant_id, snapshot)


def artifact_of(record: SnapshotRecord) -> SnapshotArtifact:
    try:
        return SnapshotArtifact.from_json(record.artifact)
    except ValueError as exc:
        raise ServerError(f"snapshot {record.id} is unreadable: {exc}") from None
