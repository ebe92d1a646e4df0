"""Private destinations are the deployment's to grant (docs/egress.md, docs/security.md).

An admin grants a tenant the exact private `ip:port` pairs its sandboxes may be given (`PrivateGrants.grant`);
the tenant's operators switch on only granted ones (`TenantEgressSettings.set` asks `allow`); the control
plane's own services (`ControlPlane`: its API and metrics listeners, its database, its replicas) can never be
granted, whoever asks. Every grant and revocation is an audit record.
"""

from __future__ import annotations

import asyncio
import builtins
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .._exceptions import InvalidRequestError, PermissionDeniedError
from ..control import Action, Principal, PrivateGrant, Role, Tenant, TenantEgress
from ..egress import EgressPolicy
from ..egress._addresses import IPAddress, embedded_ipv4, host_addresses

if TYPE_CHECKING:
    from ..control import ControlStore
    from ._accounts import Tenants
    from ._audited import Auditor

__all__ = ["ApplyEgress", "ControlPlane", "PrivateGrants", "normalise_destination"]

# A tenant's egress applied to its live sandboxes (`LiveEgress.apply`): how many this engine updated.
ApplyEgress = Callable[[str, TenantEgress], Awaitable[int]]

_DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}
_URL_PORTS = {"http": 80, "https": 443}
_EVERY_REPLICA = timedelta(days=36500)  # the registry's `alive` is beside the point: a dead replica's port too


def normalise_destination(destination: object) -> str:
    """`destination` as the one `ip:port` form the grants and the egress settings compare (400 if malformed)."""
    if not isinstance(destination, str):
        raise InvalidRequestError("invalid private destination: give a string 'ip:port'",
                                  details={"field": "destination"})
    return EgressPolicy.parse("none", private=[destination]).private[0]


class ControlPlane:
    """The deployment's own services as `ip:port`s no sandbox may be granted: the listeners `serve` registers
    (its API port, its metrics port), this replica's advertised URL and every replica's, and the database."""

    def __init__(self, store: ControlStore, replica_url: str) -> None:
        self._store = store
        self._listeners: dict[tuple[str, int], str] = {}
        self.add_listener(*_url_host_port(replica_url), "the control plane's API (this replica's URL)")

    def add_listener(self, host: str, port: int, what: str) -> None:
        self._listeners[(host.strip("[]"), port)] = what

    async def owner(self, destination: str) -> str | None:
        """What of the control plane `destination` (normalised `ip:port`) would reach, or None."""
        host, _, port_text = destination.rpartition(":")
        ip, port = ipaddress.ip_address(host.strip("[]")), int(port_text)
        ip = embedded_ipv4(ip) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
        for (listener, listener_port), what in (await self._services()).items():
            if listener_port == port and await _reaches(ip, listener):
                return what
        return None

    async def _services(self) -> dict[tuple[str, int], str]:
        services = dict(self._listeners)
        for replica in await self._store.replicas.all(_EVERY_REPLICA):
            services.setdefault(_url_host_port(replica.url), f"the control plane's replica {replica.id!r}")
        try:
            db = make_url(self._store.url)
        except ArgumentError:
            return services
        backend = db.get_backend_name()
        if db.host and backend in _DB_PORTS:
            services[(db.host.strip("[]"), db.port or _DB_PORTS[backend])] = "the control plane's database"
        return services


async def _reaches(ip: IPAddress, listener: str) -> bool:
    """Whether connecting to `ip` can land on a socket bound to `listener` (an address, a name, or a wildcard)."""
    local = ip.is_loopback or ip.is_unspecified or ip in host_addresses()  # 0.0.0.0 reaches this host too
    for address in await _addresses(listener):
        if address.is_unspecified and local:
            return True
        # Conservative: one loopback address is as good as another here, and 0.0.0.0 connects to loopback.
        if address.is_loopback and (ip.is_loopback or ip.is_unspecified):
            return True
        if address == ip:
            return True
    return False


async def _addresses(host: str) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host or "0.0.0.0")]  # noqa: S104 - a wildcard is what is looked for
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def _url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return (parts.hostname or "", parts.port or _URL_PORTS.get(parts.scheme, 80))


class PrivateGrants:
    """The admin's grants (`/v1/tenants/{t}/egress/grants`) and the check every change of `private` passes."""

    def __init__(self, store: ControlStore, audited: Auditor, tenants: Tenants, apply_egress: ApplyEgress, *,
                 replica_url: str) -> None:
        self._store = store
        self._audited = audited
        self._tenants = tenants
        self._apply_egress = apply_egress
        self.control_plane = ControlPlane(store, replica_url)

    async def list(self, principal: Principal, name_or_id: str) -> tuple[Tenant, builtins.list[PrivateGrant]]:
        """Admins, and the tenant's operators (what they may switch on)."""
        async with self._audited(principal, "tenant.grants.read", name_or_id[:256]):
            tenant = await self._tenants.visible(principal, name_or_id, Action.TENANT_EGRESS)
            return tenant, await self._store.grants.list(tenant.id)

    async def grant(self, principal: Principal, name_or_id: str, destination: object) -> tuple[Tenant, str]:
        async with self._audited(principal, "tenant.grants.grant", name_or_id[:256],
                                 params={"destination": str(destination)[:256]}) as audit:
            tenant = await self._tenants.visible(principal, name_or_id, Action.TENANT_UPDATE)
            audit.target = tenant.id
            pair = normalise_destination(destination)
            await self._refuse_control_plane([pair])
            audit.outcome["granted"] = await self._store.grants.grant(tenant.id, pair, key_id=principal.key_id)
        return tenant, pair

    async def revoke(self, principal: Principal, name_or_id: str, destination: object) -> tuple[Tenant, str]:
        """Take a grant back: the tenant's sandboxes lose the destination at once, for new connections."""
        async with self._audited(principal, "tenant.grants.revoke", name_or_id[:256],
                                 params={"destination": str(destination)[:256]}) as audit:
            tenant = await self._tenants.visible(principal, name_or_id, Action.TENANT_UPDATE)
            audit.target = tenant.id
            pair = normalise_destination(destination)
            audit.outcome["revoked"] = await self._store.grants.revoke(tenant.id, pair)
            egress = await self._store.tenant_egress(tenant.id)
            audit.outcome["updated"] = await self._apply_egress(tenant.id, egress)
        return tenant, pair

    async def allow(self, principal: Principal, tenant_id: str, pairs: builtins.list[str]) -> builtins.list[str]:
        """Check the normalised `pairs` a caller switches on: never the control plane's (400); an operator's only if
        granted (403 naming the missing grants); an admin's are granted by saying so. Returns what was granted."""
        await self._refuse_control_plane(pairs)
        granted = {g.destination for g in await self._store.grants.list(tenant_id)}
        missing = [p for p in pairs if p not in granted]
        if not missing:
            return []
        if principal.role is not Role.ADMIN:
            raise PermissionDeniedError(
                f"private destination{'s' if len(missing) > 1 else ''} {', '.join(missing)} not granted to this "
                "tenant: an admin grants private destinations (corral tenants grant-private TENANT IP:PORT)",
                details={"field": "private", "missing_grants": missing})
        for pair in missing:
            await self._store.grants.grant(tenant_id, pair, key_id=principal.key_id)
        return missing

    async def _refuse_control_plane(self, pairs: builtins.list[str]) -> None:
        for pair in pairs:
            what = await self.control_plane.owner(pair)
            if what is not None:
                raise InvalidRequestError(
                    f"private destination {pair!r} is {what}: the control plane's own services can never be "
                    "granted to sandboxes", details={"field": "private", "destination": pair, "why": what})
