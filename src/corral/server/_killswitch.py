"""The operator kill switch: `POST /v1/kill {"tenant": name-or-id}` or `{"key": key-id, "revoke": true}`.

Operators act inside their own tenant, admins anywhere (see `Sandboxes.kill_all`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, model_validator

from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1", route_class=AuditedRoute)


class KillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str | None = None
    key: str | None = None
    revoke: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> KillRequest:
        if (self.tenant is None) == (self.key is None):
            raise ValueError("name exactly one of 'tenant' or 'key'")
        if self.revoke and self.key is None:
            raise ValueError("'revoke' applies to a key; disable a tenant with PATCH /v1/tenants/{tenant}")
        return self


@router.post("/kill")
async def kill_switch(body: KillRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    report = await service(request).sandboxes.kill_all(principal, tenant=body.tenant, key=body.key,
                                                       revoke=body.revoke)
    return {"killed": report.killed, "failed": report.failed, "revoked": report.revoked}
