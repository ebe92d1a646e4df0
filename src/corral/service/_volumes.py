"""Volumes (docs/volumes.md): a tenant's storage with a hard size limit, outliving sandboxes and mounted by name.

Create, list, get and delete, each authorized and audited; and `resolve`, which turns the names a new sandbox
asks for into the volume ids its spec carries (the sandboxes service calls it). The store keeps who owns which
name; the engine's backend keeps the bytes.
"""

from __future__ import annotations

import builtins
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from .._exceptions import ConflictError, InvalidRequestError, NotFoundError
from .._sizes import parse_size
from ..control import Action, ControlStore, Principal, VolumeRecord, authorize
from ..engine import Engine
from ._audited import Auditor

__all__ = ["MAX_VOLUME_SIZE", "MIN_VOLUME_SIZE", "VolumeDetail", "Volumes", "check_volume_name", "volume_size"]

VOLUME_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
MIN_VOLUME_SIZE = 16 * 2**20
MAX_VOLUME_SIZE = 2**40
_MAX_TEXT = 256  # the caller's own text kept in audit records


@dataclass(frozen=True)
class VolumeDetail:
    """One volume, and the bytes its files take now."""

    volume: VolumeRecord
    used_bytes: int


def check_volume_name(name: str) -> str:
    if not VOLUME_NAME.fullmatch(name):
        raise InvalidRequestError(f"volume name {name[:_MAX_TEXT]!r} is not valid: use 1 to 63 lowercase letters, "
                                  "digits, '-' or '_', starting with a letter or digit",
                                  details={"name": name[:_MAX_TEXT]})
    return name


def volume_size(size: int | str) -> int:
    """`size` in bytes (`"1G"`, `"512M"`, a byte count), between 16 MiB and 1 TiB."""
    try:
        n = parse_size(size, "volume size")
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc), details={"size": str(size)[:_MAX_TEXT]}) from None
    if not MIN_VOLUME_SIZE <= n <= MAX_VOLUME_SIZE:
        raise InvalidRequestError(f"volume size {str(size)[:_MAX_TEXT]!r} ({n} bytes) is outside 16M to 1T",
                                  details={"size": n, "min": MIN_VOLUME_SIZE, "max": MAX_VOLUME_SIZE})
    return n


class Volumes:
    def __init__(self, store: ControlStore, engine: Engine, audited: Auditor) -> None:
        self._store = store
        self._engine = engine
        self._audited = audited

    async def create(self, principal: Principal, name: str, size: int | str) -> VolumeRecord:
        """A new empty volume of the caller's tenant; its size is a hard limit (ENOSPC inside sandboxes)."""
        params = {"name": name[:_MAX_TEXT], "size": size if isinstance(size, int) else str(size)[:_MAX_TEXT]}
        async with self._audited(principal, "volume.create", None, params=params, status=201) as audit:
            authorize(principal, Action.VOLUME_CREATE, principal.tenant_id)
            size_bytes = volume_size(size)
            audit.target = f"vol-{secrets.token_hex(8)}"
            record = await self._store.create_volume(principal, check_volume_name(name), size_bytes,
                                                         backend=self._engine.backend.name,
                                                         volume_id=audit.target)
            try:
                await self._engine.create_volume(record.id, size_bytes)
            except BaseException:
                await self._store.mark_volume_deleted(record.id)  # the name and the quota are free again
                raise
            return record

    async def list(self, principal: Principal) -> builtins.list[VolumeRecord]:
        async with self._audited(principal, "volume.list", None) as audit:
            authorize(principal, Action.VOLUME_READ, principal.tenant_id)
            records = await self._store.list_volumes(principal.tenant_id)
            audit.outcome["count"] = len(records)
        return records

    async def get(self, principal: Principal, name: str) -> VolumeDetail:
        """The caller's tenant's volume of this name (another tenant's does not exist: `NotFoundError`)."""
        async with self._audited(principal, "volume.get", None, params={"name": name[:_MAX_TEXT]}) as audit:
            record = await self.find(principal, name, Action.VOLUME_READ)
            audit.target = record.id
            return VolumeDetail(record, await self._engine.volume_used(record.id))

    async def delete(self, principal: Principal, name: str) -> None:
        """Delete a volume and its files; refused (`ConflictError`, naming them) while a live sandbox of the
        tenant, running or paused, has it in its spec."""
        async with self._audited(principal, "volume.delete", None, params={"name": name[:_MAX_TEXT]},
                                     status=204) as audit:
            record = await self.find(principal, name, Action.VOLUME_DELETE)
            audit.target = record.id
            users = [s.id for s in await self._store.list_sandboxes(record.tenant_id)
                     if record.id in s.spec.volumes.values()]
            if users:
                raise ConflictError(f"volume {name!r} is mounted by sandbox{'es' if len(users) > 1 else ''} "
                                    f"{', '.join(users)}: kill {'them' if len(users) > 1 else 'it'} first",
                                    details={"volume": name, "sandboxes": users})
            await self._engine.delete_volume(record.id)
            await self._store.mark_volume_deleted(record.id)

    async def resolve(self, principal: Principal, volumes: Mapping[str, str]) -> dict[str, str]:
        """`{mount path: volume name}` of a sandbox being created -> `{mount path: volume id}`; a name the caller's
        tenant has no volume of (another tenant's included) is `InvalidRequestError` naming it."""
        if not volumes:
            return {}
        authorize(principal, Action.VOLUME_READ, principal.tenant_id)
        resolved: dict[str, str] = {}
        for path, name in volumes.items():
            try:
                record = await self._store.get_volume_by_name(principal.tenant_id, name)
            except NotFoundError:
                raise InvalidRequestError(f"no volume named {name[:_MAX_TEXT]!r} (asked to be mounted at "
                                          f"{path[:_MAX_TEXT]!r}): create it first",
                                          details={"volume": name[:_MAX_TEXT], "path": path[:_MAX_TEXT]}) from None
            backend = self._engine.backend.name
            if record.backend != backend:
                raise InvalidRequestError(f"volume {name!r} lives on the {record.backend} backend; this server runs "
                                          f"sandboxes on {backend}", details={"volume": name})
            resolved[path] = record.id
        return resolved

    async def find(self, principal: Principal, name: str, action: Action) -> VolumeRecord:
        """The caller's tenant's live volume of this name, if the caller may do `action` on it."""
        authorize(principal, action, principal.tenant_id)
        return await self._store.get_volume_by_name(principal.tenant_id, name)
