"""Account routes (tenants, keys; admin only) and the audit trail (auditor, operator, admin)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict

from .._exceptions import InvalidRequestError, NotFoundError
from ..control import Action, Principal, Role, Tenant, authorize
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services

router = APIRouter(prefix="/v1")

_AUDIT_LIMIT_MAX = 10_000


class TenantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str
    role: str = Role.DEVELOPER.value
    name: str = ""


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at.astimezone(UTC).isoformat(),
            "disabled": tenant.disabled, "quotas": asdict(tenant.quotas)}


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


@router.get("/audit/verify")
async def verify_audit(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    authorize(principal, Action.AUDIT_READ, principal.tenant_id)
    result = await svc.store.audit.verify()
    problem = asdict(result.problem) if result.problem is not None else None
    return {"ok": result.ok, "checked": result.checked, "head": str(result.head), "problem": problem}


@router.get("/audit/head")
async def audit_head(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    authorize(principal, Action.AUDIT_READ, principal.tenant_id)
    head = await svc.store.audit.head()
    return {"seq": head.seq, "hash": head.hash}
