"""Account routes (tenants, keys; admin only) and the audit trail (auditor, operator, admin).

Reading the audit trail (query, export, follow, verify, head) is not itself recorded: an auditor tailing the
log would otherwise add a record for every record it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .._exceptions import InvalidRequestError, NotFoundError
from ..control import Action, ApiKey, AuditEntry, ChainHead, ControlStore, Principal, Role, Tenant, authorize
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services

router = APIRouter(prefix="/v1")

_AUDIT_LIMIT_MAX = 10_000
_EXPORT_BATCH = 1000
_NDJSON = "application/x-ndjson"
# A follower that sees no new record for this long gets an empty line: it keeps proxies and client read
# timeouts from closing an idle stream, and lets the server notice a client that went away.
FOLLOW_KEEPALIVE = 15.0


class TenantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str
    role: str = Role.DEVELOPER.value
    name: str = ""


NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class QuotasPatch(BaseModel):
    """The quotas to change; a field left out keeps its value, `null` removes the limit."""

    model_config = ConfigDict(extra="forbid")

    max_sandboxes: NonNegativeInt | None = None
    max_memory_bytes: NonNegativeInt | None = None
    max_cpus: NonNegativeFloat | None = None
    max_sandbox_memory_bytes: NonNegativeInt | None = None
    max_sandbox_cpus: NonNegativeFloat | None = None
    max_sandbox_disk_bytes: NonNegativeInt | None = None
    max_sandbox_timeout: NonNegativeFloat | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quotas: QuotasPatch | None = None
    disabled: bool | None = None


def _iso(time: datetime | None) -> str | None:
    return None if time is None else time.astimezone(UTC).isoformat()


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at.astimezone(UTC).isoformat(),
            "disabled": tenant.disabled, "quotas": asdict(tenant.quotas)}


def key_json(key: ApiKey, tenant_name: str | None) -> dict[str, Any]:
    """A key's record; the secret is not stored, so it cannot leak from here."""
    return {"id": key.id, "tenant_id": key.tenant_id, "tenant": tenant_name, "role": key.role.value,
            "name": key.name, "prefix": key.prefix, "created_at": _iso(key.created_at),
            "revoked_at": _iso(key.revoked_at), "last_used_at": _iso(key.last_used_at)}


async def _tenant_by_name_or_id(store: ControlStore, name_or_id: str) -> Tenant:
    try:
        return await store.tenant_by_name(name_or_id)
    except NotFoundError:
        pass
    try:
        return await store.get_tenant(name_or_id)
    except NotFoundError:
        raise NotFoundError(f"no tenant {name_or_id!r}", details={"tenant": name_or_id}) from None


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "tenant.create", body.name[:256], params={"name": body.name},
                       status=201):
        authorize(principal, Action.TENANT_CREATE)
        tenant = await svc.store.create_tenant(body.name)
    return tenant_json(tenant)


@router.get("/tenants")
async def list_tenants(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "tenant.list", None):
        authorize(principal, Action.TENANT_READ)
        tenants = await svc.store.list_tenants()
    return {"tenants": [tenant_json(t) for t in tenants]}


@router.patch("/tenants/{name_or_id}")
async def update_tenant(name_or_id: str, body: TenantPatch, request: Request,
                        principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    params = body.model_dump(mode="json", exclude_unset=True)
    async with Audited(svc.store, principal, "tenant.update", name_or_id[:256], params=params) as audit:
        authorize(principal, Action.TENANT_UPDATE)
        tenant = await _tenant_by_name_or_id(svc.store, name_or_id)
        audit.target = tenant.id
        if body.disabled and tenant.id == principal.tenant_id:
            # The caller's own keys would stop working: nobody could undo it through the API.
            raise InvalidRequestError("refusing to disable the caller's own tenant", details={"tenant": tenant.name})
        if body.quotas is not None:
            changes = body.quotas.model_dump(exclude_unset=True)
            tenant = await svc.store.set_quotas(tenant.id, dataclasses.replace(tenant.quotas, **changes))
        if body.disabled is not None:
            tenant = await svc.store.set_tenant_disabled(tenant.id, body.disabled)
    return tenant_json(tenant)


@router.get("/keys")
async def list_keys(request: Request, principal: CurrentPrincipal, tenant: str | None = None) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "key.list", None, params={"tenant": tenant}):
        authorize(principal, Action.KEY_READ)
        found = await _tenant_by_name_or_id(svc.store, tenant) if tenant else None
        keys = await svc.store.list_keys(found.id if found else None)
        names = {t.id: t.name for t in ([found] if found else await svc.store.list_tenants())}
    return {"keys": [key_json(k, names.get(k.tenant_id)) for k in keys]}


@router.post("/keys", status_code=201)
async def create_key(body: KeyRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    params = {"tenant": body.tenant, "role": body.role, "name": body.name}
    async with Audited(svc.store, principal, "key.create", None, params=params, status=201) as audit:
        authorize(principal, Action.KEY_CREATE)
        try:
            tenant = await svc.store.tenant_by_name(body.tenant)
        except NotFoundError as exc:
            raise InvalidRequestError(exc.message, details={"tenant": body.tenant}) from None
        new = await svc.store.create_key(tenant.id, body.role, body.name)
        audit.target = new.info.id
    return {"id": new.info.id, "key": new.key, "tenant": tenant.name, "role": new.info.role.value}


@router.delete("/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "key.revoke", key_id[:256], status=204):
        authorize(principal, Action.KEY_REVOKE)
        await svc.store.revoke_key(key_id)
    return Response(status_code=204)


async def _audit_tenant(svc: Services, principal: Principal, tenant: str | None) -> str | None:
    """The tenant id to filter on: admins see any (or all); others only their own."""
    tenant_id: str | None = None
    if tenant:
        try:
            tenant_id = (await svc.store.tenant_by_name(tenant)).id
        except NotFoundError:
            tenant_id = tenant  # an id
    if principal.role is Role.ADMIN:
        authorize(principal, Action.AUDIT_READ)
        return tenant_id
    authorize(principal, Action.AUDIT_READ, tenant_id or principal.tenant_id)
    return principal.tenant_id


@router.get("/audit")
async def query_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                      sandbox: str | None = None, action: str | None = None, since: datetime | None = None,
                      until: datetime | None = None,
                      limit: Annotated[int, Query(ge=1, le=_AUDIT_LIMIT_MAX)] = 1000) -> dict[str, Any]:
    svc = services(request)
    tenant_id = await _audit_tenant(svc, principal, tenant)
    records = await svc.store.audit.query(tenant=tenant_id, sandbox=sandbox, action=action, since=since,
                                          until=until, limit=limit)
    return {"records": [r.to_dict() for r in records]}


@router.get("/audit/export", response_model=None)
async def export_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                       sandbox: str | None = None, action: str | None = None, since: datetime | None = None,
                       until: datetime | None = None) -> StreamingResponse:
    svc = services(request)
    tenant_id = await _audit_tenant(svc, principal, tenant)
    pages = _export_pages(svc.store, tenant=tenant_id, sandbox=sandbox, action=action, since=since, until=until)
    return StreamingResponse(pages, media_type=_NDJSON)


async def _export_pages(store: ControlStore, **filters: Any) -> AsyncIterator[bytes]:
    """Matching records as JSONL, a page per read transaction, so a long log never sits in memory."""
    after = 0
    while True:
        page = await store.audit.query(after=after, limit=_EXPORT_BATCH, **filters)
        if page:
            yield "".join(entry.to_json() + "\n" for entry in page).encode("ascii")
            after = page[-1].seq
        if len(page) < _EXPORT_BATCH:
            return


@router.get("/audit/follow", response_model=None)
async def follow_audit(request: Request, principal: CurrentPrincipal, tenant: str | None = None,
                       sandbox: str | None = None, action: str | None = None,
                       after: Annotated[int | None, Query(ge=0)] = None) -> StreamingResponse:
    svc = services(request)
    tenant_id = await _audit_tenant(svc, principal, tenant)
    if after is None:
        after = (await svc.store.audit.head()).seq  # from now: taken before the response starts, so none is missed
    records = svc.store.audit.follow(after=after, tenant=tenant_id, sandbox=sandbox, action=action)
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
    svc = services(request)
    authorize(principal, Action.AUDIT_READ, principal.tenant_id)
    expected = ChainHead.parse(head) if head else None
    result = await svc.store.audit.verify(expected)
    problem = asdict(result.problem) if result.problem is not None else None
    return {"ok": result.ok, "checked": result.checked, "head": str(result.head), "problem": problem}


@router.get("/audit/head")
async def audit_head(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    authorize(principal, Action.AUDIT_READ, principal.tenant_id)
    head = await svc.store.audit.head()
    return {"seq": head.seq, "hash": head.hash}
