"""Egress settings of tenants (`/v1/tenants/{t}/egress`); see `corral.service.TenantEgressSettings`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..control import Tenant, TenantEgress
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/tenants", route_class=AuditedRoute)


class EgressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ceiling: str | list[str] | None = None  # None: unchanged
    private: list[str] | None = None


def egress_json(tenant: Tenant, egress: TenantEgress) -> dict[str, Any]:
    return {"tenant": tenant.name, "ceiling": egress.ceiling, "private": list(egress.private)}


@router.get("/{name_or_id}/egress")
async def get_egress(name_or_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return egress_json(*await service(request).egress.get(principal, name_or_id))


@router.put("/{name_or_id}/egress")
async def set_egress(name_or_id: str, body: EgressSettings, request: Request,
                     principal: CurrentPrincipal) -> dict[str, Any]:
    tenant, egress = await service(request).egress.set(principal, name_or_id, ceiling=body.ceiling,
                                                       private=body.private)
    return egress_json(tenant, egress)
