"""Egress settings of tenants, and the audit records of the egress proxy.

The ceiling bounds every sandbox's `network` policy (admins set it); `private` lists the exact private
`ip:port` pairs the tenant's sandboxes may reach (operators of the tenant switch on those an admin granted,
`PrivateGrants`). A change reaches the tenant's live sandboxes at once, for new connections.

Every attempt is one audit record (`egress_audit_event`). A proxy of another process (`corral egress-proxy`, for
Pods) records its refusals before it answers them, so `denials` finds them in the shared trail for the command
that caused them, on whichever server ran it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from .._exceptions import CorralError, NotFoundError
from ..control import Action, AuditEntry, AuditEvent, ControlStore, Principal, Tenant, TenantEgress, authorize
from ..egress import EgressEvent, EgressPolicy
from ..egress._events import EventKind

if TYPE_CHECKING:
    from ..engine import Engine
    from ._accounts import Tenants
    from ._audited import Auditor
    from ._grants import PrivateGrants
    from ._telemetry import Telemetry

__all__ = ["DENIALS_SCANNED", "LiveEgress", "TenantEgressSettings", "egress_audit_event", "egress_event_from_audit",
           "recorded_denials"]

DENIALS_SCANNED = 5000  # audit records of one command's egress read for its refusals: bounded, like the proxy's 200
DENIALS_KEPT = 200


class LiveEgress:
    """A tenant's changed egress settings applied to its live sandboxes (the settings and the grants both change
    them)."""

    def __init__(self, store: ControlStore, engine: Engine) -> None:
        self._store = store
        self._engine = engine

    async def apply(self, tenant_id: str, egress: TenantEgress) -> int:
        """New private pairs apply at once; a lower ceiling narrows live sandboxes that now exceed it to `none`.
        Returns how many sandboxes this engine updated."""
        ceiling = EgressPolicy.parse(egress.ceiling)
        updated = 0
        for record in await self._store.list_sandboxes(tenant_id):
            network: str | list[str] = _wire(record.spec.network)
            try:
                EgressPolicy.parse(network).within(ceiling)
            except CorralError:
                network = "none"
                await self._store.set_sandbox_network(record.id, network)
            try:
                self._engine.set_network(record.id, network, private=egress.private)
                updated += 1
            except CorralError:  # not (or no longer) in this engine: nothing to update
                continue
        return updated


class TenantEgressSettings:
    def __init__(self, store: ControlStore, audited: Auditor, tenants: Tenants, grants: PrivateGrants,
                 live: LiveEgress, telemetry: Telemetry | None = None) -> None:
        self._store = store
        self._audited = audited
        self._tenants = tenants
        self._grants = grants
        self._live = live
        self._telemetry = telemetry

    async def get(self, principal: Principal, name_or_id: str) -> tuple[Tenant, TenantEgress]:
        async with self._audited(principal, "tenant.egress.read", name_or_id[:256]):
            tenant = await self._tenants.visible(principal, name_or_id, Action.TENANT_EGRESS)
            return tenant, await self._store.tenant_egress(tenant.id)

    async def set(self, principal: Principal, name_or_id: str, *, ceiling: str | list[str] | None = None,
                  private: list[str] | None = None) -> tuple[Tenant, TenantEgress]:
        """Change the ceiling (admins) and the private pairs (operators of the tenant); None: unchanged."""
        params = {k: v for k, v in (("ceiling", ceiling), ("private", private)) if v is not None}
        async with self._audited(principal, "tenant.egress", name_or_id[:256], params=params) as audit:
            tenant = await self._tenants.visible(principal, name_or_id, Action.TENANT_EGRESS)
            audit.target = tenant.id
            current = await self._store.tenant_egress(tenant.id)
            if ceiling is not None:
                authorize(principal, Action.TENANT_UPDATE)  # raising or lowering the ceiling is the admin's call
            new_ceiling = current.ceiling if ceiling is None else EgressPolicy.parse(ceiling).to_wire()
            # InvalidRequestError names a malformed pair; stored normalised, the form the grants compare.
            new_private = list(EgressPolicy.parse("none", private=current.private if private is None else private)
                               .private)
            # -- private grants (service/_grants.py): never the control plane; an operator's only if granted --
            granted = await self._grants.allow(principal, tenant.id, new_private)
            if granted:
                audit.outcome["granted"] = granted
            # -- end of private grants --
            egress = await self._store.set_tenant_egress(
                tenant.id, TenantEgress(ceiling=new_ceiling, private=new_private))
            audit.outcome["updated"] = await self.apply_to_live_sandboxes(tenant.id, egress)
        return tenant, egress

    async def apply_to_live_sandboxes(self, tenant_id: str, egress: TenantEgress) -> int:
        """`LiveEgress.apply`."""
        return await self._live.apply(tenant_id, egress)

    async def record_event(self, event: EgressEvent) -> None:
        """The proxy's `on_event`: one audit record per egress attempt, attributed to the sandbox's tenant and key;
        and counted (a standalone proxy counts its own: `corral egress-proxy --metrics-port`)."""
        tenant_id = await egress_audit_event(self._store, event)
        if self._telemetry is not None:
            self._telemetry.egress.observe(tenant_id, event)

    async def denials(self, sandbox_id: str, since: float) -> list[EgressEvent]:
        """The engine's `remote_denials`: `recorded_denials` in this service's store."""
        return await recorded_denials(self._store, sandbox_id, since)


async def recorded_denials(store: ControlStore, sandbox_id: str, since: float) -> list[EgressEvent]:
    """Refusals of the sandbox recorded at or after `since` (a `time.time()`), oldest first, the last 200: what
    a proxy of another process refused (it records them before answering)."""
    entries = await store.audit.query(sandbox=sandbox_id, since=datetime.fromtimestamp(since, UTC),
                                      limit=DENIALS_SCANNED)
    refused = [egress_event_from_audit(e) for e in entries
               if e.action.startswith("egress.") and e.outcome.get("allowed") is False]
    return refused[-DENIALS_KEPT:]


async def egress_audit_event(store: ControlStore, event: EgressEvent) -> str | None:
    """One audit record for one egress attempt, attributed to the sandbox's tenant and key; returns the tenant's
    id (None: the sandbox's record is gone)."""
    try:
        sandbox = await store.get_sandbox(event.sandbox_id)
    except NotFoundError:
        sandbox = None
    params: dict[str, Any] = {"host": event.host, "port": event.port, "method": event.method}
    if event.kind == "dns":
        # The looked-up name comes from inside the sandbox (the agent's DNS stub reports it over the same socket
        # any code there can write to): the record says so, and is never the proxy's own word on a lookup.
        params["reported_by"] = "sandbox"
    outcome: dict[str, Any] = {"allowed": event.allowed, "rule": event.rule, "bytes_up": event.bytes_up,
                               "bytes_down": event.bytes_down, "duration": round(event.duration, 6)}
    if not event.allowed:
        outcome["reason"] = event.reason
    if event.secrets:  # which secrets went to this host (docs/secrets.md): names only, never a value
        outcome["secrets_injected"] = list(event.secrets)
    await store.audit.append(AuditEvent(
        action=f"egress.{event.kind}", target=event.sandbox_id,
        tenant_id=sandbox.tenant_id if sandbox else None, key_id=sandbox.key_id if sandbox else None,
        role=None, params=params, outcome=outcome))
    return sandbox.tenant_id if sandbox else None


def egress_event_from_audit(entry: AuditEntry) -> EgressEvent:
    """The attempt an `egress.*` audit record tells of (its time: when it was recorded)."""
    params, outcome = entry.params, entry.outcome
    return EgressEvent(time=entry.time.timestamp(), sandbox_id=entry.target or "",
                       kind=cast(EventKind, entry.action.removeprefix("egress.")), method=str(params.get("method", "")),
                       host=str(params.get("host", "")), port=int(params.get("port", 0)),
                       allowed=bool(outcome.get("allowed")), rule=str(outcome.get("rule", "")),
                       reason=str(outcome.get("reason", "")), bytes_up=int(outcome.get("bytes_up", 0)),
                       bytes_down=int(outcome.get("bytes_down", 0)), duration=float(outcome.get("duration", 0.0)))


def _wire(network: str | tuple[str, ...]) -> str | list[str]:
    return network if isinstance(network, str) else list(network)
