"""Egress settings of tenants, and the audit records of the egress proxy.

The ceiling bounds every sandbox's `network` policy (admins set it); `private` lists the exact private
`ip:port` pairs the tenant's sandboxes may reach (operators of the tenant may set it, for their own databases
and services). A change reaches the tenant's live sandboxes at once, for new connections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import CorralError, NotFoundError
from ..control import Action, AuditEvent, Principal, Tenant, TenantEgress, authorize
from ..egress import EgressEvent, EgressPolicy

if TYPE_CHECKING:
    from ._service import Service

__all__ = ["TenantEgressSettings"]


class TenantEgressSettings:
    def __init__(self, service: Service) -> None:
        self._svc = service

    async def get(self, principal: Principal, name_or_id: str) -> tuple[Tenant, TenantEgress]:
        async with self._svc.audited(principal, "tenant.egress.read", name_or_id[:256]):
            tenant = await self._svc.visible_tenant(principal, name_or_id, Action.TENANT_EGRESS)
            return tenant, await self._svc.store.tenant_egress(tenant.id)

    async def set(self, principal: Principal, name_or_id: str, *, ceiling: str | list[str] | None = None,
                  private: list[str] | None = None) -> tuple[Tenant, TenantEgress]:
        """Change the ceiling (admins) and the private pairs (operators of the tenant); None: unchanged."""
        params = {k: v for k, v in (("ceiling", ceiling), ("private", private)) if v is not None}
        async with self._svc.audited(principal, "tenant.egress", name_or_id[:256], params=params) as audit:
            tenant = await self._svc.visible_tenant(principal, name_or_id, Action.TENANT_EGRESS)
            audit.target = tenant.id
            current = await self._svc.store.tenant_egress(tenant.id)
            if ceiling is not None:
                authorize(principal, Action.TENANT_UPDATE)  # raising or lowering the ceiling is the admin's call
            new_ceiling = current.ceiling if ceiling is None else EgressPolicy.parse(ceiling).to_wire()
            new_private = current.private if private is None else list(private)
            EgressPolicy.parse("none", private=new_private)  # InvalidRequestError names a malformed pair
            egress = await self._svc.store.set_tenant_egress(
                tenant.id, TenantEgress(ceiling=new_ceiling, private=new_private))
            audit.outcome["updated"] = await self._apply_to_live_sandboxes(tenant.id, egress)
        return tenant, egress

    async def _apply_to_live_sandboxes(self, tenant_id: str, egress: TenantEgress) -> int:
        """New private pairs apply at once; a lower ceiling narrows live sandboxes that now exceed it to `none`."""
        ceiling = EgressPolicy.parse(egress.ceiling)
        updated = 0
        for record in await self._svc.store.list_sandboxes(tenant_id):
            network: str | list[str] = _wire(record.spec.network)
            try:
                EgressPolicy.parse(network).within(ceiling)
            except CorralError:
                network = "none"
                await self._svc.store.set_sandbox_network(record.id, network)
            try:
                self._svc.engine.set_network(record.id, network, private=egress.private)
                updated += 1
            except CorralError:  # not (or no longer) in this engine: nothing to update
                continue
        return updated

    async def record_event(self, event: EgressEvent) -> None:
        """The proxy's `on_event`: one audit record per egress attempt, attributed to the sandbox's tenant and key."""
        try:
            sandbox = await self._svc.store.get_sandbox(event.sandbox_id)
        except NotFoundError:
            sandbox = None
        params = {"host": event.host, "port": event.port, "method": event.method}
        outcome = {"allowed": event.allowed, "rule": event.rule, "bytes_up": event.bytes_up,
                   "bytes_down": event.bytes_down, "duration": round(event.duration, 6)}
        if not event.allowed:
            outcome["reason"] = event.reason
        await self._svc.store.audit.append(AuditEvent(
            action=f"egress.{event.kind}", target=event.sandbox_id,
            tenant_id=sandbox.tenant_id if sandbox else None, key_id=sandbox.key_id if sandbox else None,
            role=None, params=params, outcome=outcome))


def _wire(network: str | tuple[str, ...]) -> str | list[str]:
    return network if isinstance(network, str) else list(network)
