"""`GET /v1/info`: the server's backend, its runtimes and what it cannot give (`corral.service.Info`); and
`GET /v1/templates`: the names of its templates (`corral.service.Templates`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1", route_class=AuditedRoute)


@router.get("/info")
async def info(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = service(request)
    found = await svc.info.get(principal)
    caller = await svc.info.caller(principal)
    return {"backend": found.backend, "runtimes": list(found.runtimes), "limitations": dict(found.limitations),
            "domain": found.domain, "root": found.root, "replica": found.replica,
            "caller": {"key_id": caller.key_id, "tenant_id": caller.tenant_id, "tenant": caller.tenant,
                       "role": caller.role}}


@router.get("/templates")
async def templates(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return {"templates": [{"name": name} for name in await service(request).templates.names(principal)]}
