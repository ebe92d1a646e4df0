"""The operator kill switch: stop every sandbox of a tenant, or of one API key, at once.

`POST /v1/kill {"tenant": name-or-id}` or `{"key": key-id, "revoke": true}`. Operators act inside their own
tenant, admins anywhere. A sandbox still being created when the switch is thrown is marked destroyed here; its
create call then finds it gone and destroys what the engine made (see `_sandboxes.create_sandbox`), so nothing
started before the switch survives it. With `revoke`, the key is revoked in the same call, so the agent that
holds it cannot start new sandboxes either.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, model_validator

from .._exceptions import CorralError, NotFoundError
from ..control import Action, Principal, Role, authorize
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services, visible_tenant
from ._sandboxes import destroy

router = APIRouter(prefix="/v1")

_PARALLEL_DESTROYS = 8  # runc deletes are mostly waiting on the kernel; a few at once is faster, not 500


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


def _authorize_role(principal: Principal) -> None:
    authorize(principal, Action.SANDBOX_KILL_ALL, None if principal.role is Role.ADMIN else principal.tenant_id)


async def _key_tenant_id(svc: Services, principal: Principal, key_id: str) -> str:
    """The key's tenant; another tenant's key is as unknown to an operator as a key that never existed."""
    _authorize_role(principal)
    try:
        key = await svc.store.get_key(key_id)
    except NotFoundError:
        key = None
    if key is None or (principal.role is not Role.ADMIN and key.tenant_id != principal.tenant_id):
        raise NotFoundError(f"no API key {key_id!r}", details={"key": key_id})
    return key.tenant_id


async def _destroy_all(svc: Services, sandbox_ids: list[str]) -> tuple[list[str], dict[str, str]]:
    gate = asyncio.Semaphore(_PARALLEL_DESTROYS)
    failed: dict[str, str] = {}

    async def one(sandbox_id: str) -> None:
        async with gate:
            try:
                await destroy(svc, sandbox_id)
            except CorralError as exc:
                failed[sandbox_id] = f"{exc.code}: {exc.message}"

    await asyncio.gather(*(one(s) for s in sandbox_ids))
    return [s for s in sandbox_ids if s not in failed], failed


@router.post("/kill")
async def kill_switch(body: KillRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    target = f"key:{body.key}" if body.key is not None else f"tenant:{body.tenant}"
    async with Audited(svc.store, principal, "sandbox.kill_all", target[:256],
                       params=body.model_dump(mode="json")) as audit:
        if body.key is not None:
            tenant_id = await _key_tenant_id(svc, principal, body.key)
            if body.revoke:
                await svc.store.revoke_key(body.key)  # first, so no new sandbox slips in behind the sweep
            records = await svc.store.list_sandboxes(tenant_id, key_id=body.key)
        else:
            assert body.tenant is not None
            tenant_id = (await visible_tenant(svc, principal, body.tenant, Action.SANDBOX_KILL_ALL)).id
            records = await svc.store.list_sandboxes(tenant_id)
        killed, failed = await _destroy_all(svc, [r.id for r in records])
        # A sandbox the engine failed to stop is reported, not hidden behind a 500 that would lose the others.
        audit.outcome.update(killed=killed, failed=failed, revoked=body.revoke)
    return {"killed": killed, "failed": failed, "revoked": body.revoke}
