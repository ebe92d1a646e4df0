"""Account routes (tenants, keys; admin only) and the audit trail (auditor, operator, admin): thin adapters over
`Service.tenants`, `.keys` and `.audit`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .._bounds import MAX_INT64
from ..control import ApiKey, AuditEntry, Role, Tenant
from ..service import KEEP, AuditFilter
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1", route_class=AuditedRoute)

_AUDIT_LIMIT_MAX = 10_000
_NDJSON = "application/x-ndjson"
# A follower that sees no new record for this long gets an empty line: it keeps proxies and client read
# timeouts from closing an idle stream, and lets the server notice a client that went away.
FOLLOW_KEEPALIVE = 15.0


class TenantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    required_runtime: str | None = None  # "runsc": all its sandboxes run on gVisor (docs/security.md)


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str
    role: str = Role.DEVELOPER.value
    name: str = ""




# Quotas are stored in SQLite's 64-bit INTEGER (and REAL): at most 2**63 - 1, named in the 400 past it.
Count = Annotated[int, Field(ge=0, le=MAX_INT64)]
Amount = Annotated[float, Field(ge=0, le=float(MAX_INT64))]


class QuotasPatch(BaseModel):
    """The quotas to change; a field left out keeps its value, `null` removes the limit."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: Count | None = None
    max_memory_bytes: Count | None = None
    max_cpus: Amount | None = None
    max_sandbox_memory_bytes: Count | None = None
    max_sandbox_cpus: Amount | None = None
    max_sandbox_disk_bytes: Count | None = None
    max_sandbox_timeout: Amount | None = None
    max_paused: Count | None = None
    max_paused_seconds: Amount | None = None
    max_snapshots: Count | None = None
    max_snapshot_bytes: Count | None = None
    max_volumes: Count | None = None
    max_volume_bytes: Count | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quotas: QuotasPatch | None = None
    disabled: bool | None = None
    required_runtime: str | None = None  # left out: unchanged; null: no requirement; "runsc": gVisor only
    default_checkpoints: str | None = None  # left out: unchanged; "auto" | "manual" | null (manual)


def _iso(time: datetime | None) -> str | None:
    return None if time is None else time.astimezone(UTC).isoformat()


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at.astimezone(UTC).isoformat(),
            "disabled": tenant.disabled, "quotas": asdict(tenant.quotas), "required_runtime": tenant.required_runtime,
            "default_checkpoints": tenant.default_checkpoints}


def key_json(key: ApiKey, tenant_name: str | None) -> dict[str, Any]:
    """A key's record; the secret is not stored, so it cannot leak from here."""
    return {"id": key.id, "tenant_id": key.tenant_id, "tenant": tenant_name, "role": key.role.value,
            "name": key.name, "prefix": key.prefix, "created_at": _iso(key.created_at),
            "revoked_at": _iso(key.revoked_at), "last_used_at": _iso(key.last_used_at)}


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    tenant = await service(request).tenants.create(principal, body.name, required_runtime=body.required_runtime)
    return tenant_json(tenant)


@router.get("/tenants")
async def list_tenants(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return {"tenants": [tenant_json(t) for t in await service(request).tenants.list(principal)]}


@router.patch("/tenants/{name_or_id}")
async def update_tenant(name_or_id: str, body: TenantPatch, request: Request,
                        principal: CurrentPrincipal) -> dict[str, Any]:
    quotas = body.quotas.model_dump(exclude_unset=True) if body.quotas is not None else None
    runtime = body.required_runtime if "required_runtime" in body.model_fields_set else KEEP
    checkpoints = body.default_checkpoints if "default_checkpoints" in body.model_fields_set else KEEP
    tenant = await service(request).tenants.update(principal, name_or_id, quotas=quotas, disabled=body.disabled,
                                                   required_runtime=runtime, default_checkpoints=checkpoints,
                                                   params=body.model_dump(mode="json", exclude_unset=True))
    return tenant_json(tenant)


@router.get("/keys")
async def list_keys(request: Request, principal: CurrentPrincipal, tenant: str | None = None) -> dict[str, Any]:
    keys = await service(request).keys.list(principal, tenant)
    return {"keys": [key_json(key, name) for key, name in keys]}


@router.post("/keys", status_code=201)
async def create_key(body: KeyRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    new, tenant = await service(request).keys.create(principal, body.tenant, body.role, body.name)
    return {"id": new.info.id, "key": new.key, "tenant": tenant.name, "role": new.info.role.value}


@router.delete("/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).keys.revoke(principal, key_id)
    return Response(status_code=204)


@router.get("/audit")
async def query_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                      sandbox: str | None = None, action: str | None = None, since: datetime | None = None,
                      until: datetime | None = None, key: str | None = None,
                      limit: Annotated[int, Query(ge=1, le=_AUDIT_LIMIT_MAX)] = 1000,
                      order: Literal["asc", "desc"] = "asc") -> dict[str, Any]:
    where = AuditFilter(tenant, sandbox, action, since, until, key)
    records = await service(request).audit.query(principal, where, limit=limit, newest_first=order == "desc")
    return {"records": [r.to_dict() for r in records]}


@router.get("/audit/export", response_model=None)
async def export_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                       sandbox: str | None = None, action: str | None = None, since: datetime | None = None,
                       until: datetime | None = None, key: str | None = None) -> StreamingResponse:
    pages = await service(request).audit.export(principal, AuditFilter(tenant, sandbox, action, since, until, key))
    return StreamingResponse(_jsonl(pages), media_type=_NDJSON)


async def _jsonl(pages: AsyncIterator[list[AuditEntry]]) -> AsyncIterator[bytes]:
    async for page in pages:
        yield "".join(entry.to_json() + "\n" for entry in page).encode("ascii")


@router.get("/audit/follow", response_model=None)
async def follow_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                       sandbox: str | None = None, action: str | None = None, key: str | None = None,
                       after: Annotated[int | None, Query(ge=0)] = None) -> StreamingResponse:
    records = await service(request).audit.follow(principal, AuditFilter(tenant, sandbox, action, key=key),
                                                  after=after)
    return StreamingResponse(_with_keepalive(records, FOLLOW_KEEPALIVE), media_type=_NDJSON)


async def _with_keepalive(records: AsyncIterator[AuditEntry], idle: float) -> AsyncIterator[bytes]:
    """Each record as a JSON line, and an empty line after `idle` seconds without one.

    The records are pumped by a task into a queue: a timeout on the follower itself would cancel it mid-query.
    """
    queue: asyncio.Queue[AuditEntry] = asyncio.Queue(maxsize=1000)

    async def pump() -> None:
        async for entry in records:
            await queue.put(entry)

    task = asyncio.create_task(pump())
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, task}, timeout=idle, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield (getter.result().to_json() + "\n").encode("ascii")
                continue
            getter.cancel()
            if task in done:
                task.result()  # the follower failed: raise its error (the stream ends)
                return
            yield b"\n"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@router.get("/audit/verify")
async def verify_audit(request: Request, principal: CurrentPrincipal, head: str | None = None) -> dict[str, Any]:
    result = await service(request).audit.verify(principal, head)
    problem = asdict(result.problem) if result.problem is not None else None
    return {"ok": result.ok, "checked": result.checked, "head": str(result.head), "problem": problem,
            "unkeyed": result.unkeyed, "unchecked": result.unchecked}


@router.get("/audit/head")
async def audit_head(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    head = await service(request).audit.head(principal)
    return {"seq": head.seq, "hash": head.hash}
