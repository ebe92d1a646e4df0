"""Egress settings of tenants (`/v1/tenants/{t}/egress`) and the audit records of the egress proxy.

The ceiling bounds every sandbox's `network` policy (admins set it); `private` lists the exact private
`ip:port` pairs the tenant's sandboxes may reach (operators of the tenant may set it, for their own databases
and services). A change reaches the tenant's live sandboxes at once, for new connections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from .._exceptions import CorralError, NotFoundError
from ..control import Action, AuditEvent, ControlStore, Tenant, TenantEgress, authorize
from ..egress import EgressEvent, EgressPolicy
from ..engine import Engine
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services, visible_tenant

logger = logging.getLogger("corral.server")
router = APIRouter(prefix="/v1/tenants")


class EgressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ceiling: str | list[str] | None = None  # None: unchanged
    private: list[str] | None = None


def egress_json(tenant: Tenant, egress: TenantEgress) -> dict[str, Any]:
    return {"tenant": tenant.name, "ceiling": egress.ceiling, "private": list(egress.private)}


@router.get("/{name_or_id}/egress")
async def get_egress(name_or_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "tenant.egress.read", name_or_id[:256]):
        tenant = await visible_tenant(svc, principal, name_or_id, Action.TENANT_EGRESS)
        egress = await svc.store.tenant_egress(tenant.id)
    return egress_json(tenant, egress)


@router.put("/{name_or_id}/egress")
async def set_egress(name_or_id: str, body: EgressSettings, request: Request,
                     principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    params = body.model_dump(mode="json", exclude_none=True)
    async with Audited(svc.store, principal, "tenant.egress", name_or_id[:256], params=params) as audit:
        tenant = await visible_tenant(svc, principal, name_or_id, Action.TENANT_EGRESS)
        audit.target = tenant.id
        current = await svc.store.tenant_egress(tenant.id)
        if body.ceiling is not None:
            authorize(principal, Action.TENANT_UPDATE)  # raising or lowering the ceiling is the admin's call
        ceiling = current.ceiling if body.ceiling is None else EgressPolicy.parse(body.ceiling).to_wire()
        private = current.private if body.private is None else list(body.private)
        EgressPolicy.parse("none", private=private)  # InvalidRequestError names a malformed pair
        egress = await svc.store.set_tenant_egress(tenant.id, TenantEgress(ceiling=ceiling, private=private))
        audit.outcome["updated"] = await _apply_to_live_sandboxes(svc, tenant.id, egress)
    return egress_json(tenant, egress)


async def _apply_to_live_sandboxes(svc: Services, tenant_id: str, egress: TenantEgress) -> int:
    """New private pairs apply at once; a lower ceiling narrows live sandboxes that now exceed it to `none`."""
    ceiling = EgressPolicy.parse(egress.ceiling)
    updated = 0
    for record in await svc.store.list_sandboxes(tenant_id):
        network = record.spec.get("network", "none")
        try:
            EgressPolicy.parse(network).within(ceiling)
        except CorralError:
            network = "none"
            await svc.store.set_sandbox_network(record.id, network)
        try:
            svc.engine.set_network(record.id, network, private=egress.private)
            updated += 1
        except CorralError:  # not (or no longer) in this engine: nothing to update
            continue
    return updated


def egress_recorder(store: ControlStore) -> Callable[[EgressEvent], Awaitable[None]]:
    """The proxy's `on_event`: one audit record per egress attempt, attributed to the sandbox's tenant and key."""

    async def record(event: EgressEvent) -> None:
        try:
            sandbox = await store.get_sandbox(event.sandbox_id)
        except NotFoundError:
            sandbox = None
        params = {"host": event.host, "port": event.port, "method": event.method}
        outcome = {"allowed": event.allowed, "rule": event.rule, "bytes_up": event.bytes_up,
                   "bytes_down": event.bytes_down, "duration": round(event.duration, 6)}
        if not event.allowed:
            outcome["reason"] = event.reason
        await store.audit.append(AuditEvent(
            action=f"egress.{event.kind}", target=event.sandbox_id,
            tenant_id=sandbox.tenant_id if sandbox else None, key_id=sandbox.key_id if sandbox else None,
            role=None, params=params, outcome=outcome))

    return record


def wire_egress(engine: Engine, store: ControlStore) -> None:
    """Send the engine's egress proxy's events to the audit trail (a no-op for an engine without a proxy)."""
    if engine.egress is not None:
        engine.egress.on_event = egress_recorder(store)
