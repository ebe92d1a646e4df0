"""Egress settings of tenants (`/v1/tenants/{t}/egress`) and the private destinations admins grant them
(`/v1/tenants/{t}/egress/grants`); see `corral.service.TenantEgressSettings` and `corral.service.PrivateGrants`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..control import PrivateGrant, Tenant, TenantEgress
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/tenants", route_class=AuditedRoute)


class EgressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ceiling: str | list[str] | None = None  # None: unchanged
    private: list[str] | None = None


class NewGrant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    destination: str  # "ip:port"


def egress_json(tenant: Tenant, egress: TenantEgress) -> dict[str, Any]:
    return {"tenant": tenant.name, "ceiling": egress.ceiling, "private": list(egress.private)}


def grants_json(tenant: Tenant, grants: list[PrivateGrant]) -> dict[str, Any]:
    return {"tenant": tenant.name, "grants": [{"destination": g.destination, "granted_at": g.granted_at.isoformat(),
                                               "key_id": g.key_id} for g in grants]}


@router.get("/{name_or_id}/egress")
async def get_egress(name_or_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return egress_json(*await service(request).egress.get(principal, name_or_id))


@router.put("/{name_or_id}/egress")
async def set_egress(name_or_id: str, body: EgressSettings, request: Request,
                     principal: CurrentPrincipal) -> dict[str, Any]:
    tenant, egress = await service(request).egress.set(principal, name_or_id, ceiling=body.ceiling,
                                                       private=body.private)
    return egress_json(tenant, egress)


@router.get("/{name_or_id}/egress/grants")
async def list_grants(name_or_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return grants_json(*await service(request).grants.list(principal, name_or_id))


@router.post("/{name_or_id}/egress/grants")
async def grant(name_or_id: str, body: NewGrant, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    grants = service(request).grants
    tenant, _ = await grants.grant(principal, name_or_id, body.destination)
    return grants_json(tenant, await service(request).store.grants.list(tenant.id))


@router.delete("/{name_or_id}/egress/grants/{destination}")
async def revoke(name_or_id: str, destination: str, request: Request,
                 principal: CurrentPrincipal) -> dict[str, Any]:
    tenant, _ = await service(request).grants.revoke(principal, name_or_id, destination)
    return grants_json(tenant, await service(request).store.grants.list(tenant.id))
