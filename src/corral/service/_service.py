"""`Service`: the one layer every front end calls (REST, E2B, MCP, the dashboard).

It owns the engine and the store, starts and stops them (and the egress proxy) in the right order, authenticates
callers, and holds one object per area with one method per operation; each method authorizes, audits and
orchestrates. Front ends parse, call one method, and render; none touches the engine or the store by itself.

```python
service = Service(engine, store)
async with service:                                   # store, egress proxy, engine, reconciler
    principal = await service.authenticate(key, ClientInfo("127.0.0.1", "POST", "/v1/sandboxes"))
    record = await service.sandboxes.create(principal, CreateSandbox(template="default"))
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .._exceptions import AuthenticationError, NotFoundError
from ..control import Action, AuditEvent, ControlStore, Denial, Principal, Role, Tenant, authorize, parse_key
from ..egress import PackageMirror
from ..engine import Engine
from ._access import SandboxAccess
from ._accounts import Keys, Tenants
from ._audit import AuditTrail
from ._audited import Audited, Auditor
from ._code import Code
from ._commands import Commands
from ._egress import TenantEgressSettings
from ._eval import EvalReports
from ._files import Files
from ._grants import PrivateGrants
from ._info import Info
from ._metrics import MetricsSampler
from ._ports import DEFAULT_DOMAIN, Ports
from ._processes import Processes
from ._pty import Pty
from ._reconciler import Reconciler
from ._replicas import Replica, ReplicaConfig
from ._requests import current_request
from ._sandboxes import Sandboxes
from ._secrets import StoredSecrets
from ._snapshots import Snapshots
from ._telemetry import Telemetry
from ._templates import Templates
from ._volumes import Volumes

__all__ = ["REQUEST_INVALID", "ClientInfo", "Service", "StartupHook"]

StartupHook = Callable[[ControlStore], Awaitable[None]]
REQUEST_INVALID = "request.invalid"  # the audit action of a request refused by validation
_MAX_PROBLEMS = 20  # problems kept in the audit record (the caller's response lists them all)
_MAX_TEXT = 512  # the client's own text (paths, field names) is capped in the record


@dataclass(frozen=True)
class ClientInfo:
    """Where a request came from, for the records of refused ones."""

    client: str | None
    method: str
    path: str


class Service:
    def __init__(self, engine: Engine, store: ControlStore, *, on_startup: StartupHook | None = None,
                 domain: str = DEFAULT_DOMAIN, replica: ReplicaConfig | None = None, metrics: bool = True) -> None:
        self.engine = engine
        self.store = store
        # Prometheus metrics (docs/operations.md); None: nothing is counted (`corral serve --no-metrics`).
        self.telemetry = Telemetry(self) if metrics else None
        self._on_startup = on_startup
        self._auditor = Auditor(store, self.telemetry)
        self.replica = Replica(self, replica or ReplicaConfig())  # this server among others (docs/replicas.md)
        self.sandboxes = Sandboxes(self)
        self.access = SandboxAccess(self)  # tokens for clients that reach a sandbox without the key
        self.snapshots = Snapshots(self)
        self.files = Files(self)
        self.commands = Commands(self)
        self.processes = Processes(self)
        self.pty = Pty(self)
        self.ports = Ports(self, domain)  # `domain`: where sandboxes' ports are served (docs/ports.md)
        self.code = Code(self)
        self.egress = TenantEgressSettings(self)
        self.grants = PrivateGrants(self)  # private destinations admins grant tenants (docs/egress.md)
        engine.remote_denials = self.egress.denials  # a proxy of another process records them
        self.tenants = Tenants(store, self._auditor)
        self.keys = Keys(store, self._auditor, self.tenants)
        self.audit = AuditTrail(store)
        self.info = Info(store, engine.backend, self.replica, self.ports.domain)
        self.eval = EvalReports(engine.home)  # the evaluation runs kept in the server's home
        self.volumes = Volumes(store, engine, self._auditor)  # docs/volumes.md
        self.secrets = StoredSecrets(store, engine, self._auditor)  # docs/secrets.md
        self.templates = Templates(engine.templates, self.snapshots, self._auditor)
        self.reconciler = Reconciler(self)
        self.sampler = MetricsSampler(engine)  # what `sandboxes.metrics` serves

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Store first (the audit trail), then the egress proxy (reattached sandboxes need their socket back),
        then the engine, then this replica's heartbeat (it reconciles its records with what the engine runs), then
        the reconciler and the metrics sampler."""
        await self.store.start()
        self.access.start()
        if self._on_startup is not None:
            await self._on_startup(self.store)
        proxy = self.engine.egress
        if proxy is not None:
            proxy.on_event = self.egress.record_event
            await proxy.start()
        # What the store says is live, it reattaches; it ends nothing by itself (the reconciler does).
        await self.engine.start(adopt=await self.sandboxes.recoverable())
        await self.replica.start()
        self.reconciler.start()
        self.sampler.start()

    async def close(self) -> None:
        """Stop in reverse; sandboxes keep running for the next server."""
        try:
            await self.sampler.close()
            await self.reconciler.close()
            await self.replica.close()
            await self.engine.close()
        finally:
            proxy = self.engine.egress
            if proxy is not None:
                await proxy.close()
                if isinstance(proxy.mirror, PackageMirror):  # its upstream connections
                    await proxy.mirror.close()
            await self.store.close()

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- callers -------------------------------------------------------------------------------------------

    async def authenticate(self, key: str | None, client: ClientInfo) -> Principal:
        """The caller of `key`; a missing or refused key is `AuthenticationError`, recorded as `auth.denied`
        (aggregated per client address by the store, so a flood cannot grow the log without bound)."""
        try:
            if key is None:
                raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
            principal = await self.store.authenticate(key)
        except AuthenticationError as exc:
            await self.record_denial(client, exc, key)
            raise
        request = current_request()
        if request is not None:
            request.authenticated(principal)
        return principal

    async def record_denial(self, client: ClientInfo, exc: AuthenticationError, key: str | None) -> None:
        """A refused caller (also one whose credentials a front end could not even parse)."""
        request = current_request()
        if request is not None:
            request.refused(exc)
        if self.telemetry is not None:
            self.telemetry.refusal("auth.denied", exc.code)
        await self.store.auth_denials.record(Denial(client=client.client, method=client.method, path=client.path,
                                                    key_prefix=_key_prefix(key), reason=exc.message))

    async def record_invalid(self, principal: Principal, client: ClientInfo, *, route: str | None,
                             target: str | None, problems: list[dict[str, str]]) -> None:
        """Audit a request refused by validation before any operation ran."""
        params = {"client": client.client, "method": client.method, "path": client.path[:_MAX_TEXT],
                  "route": route, "problem_count": len(problems),
                  "problems": [{k: v[:_MAX_TEXT] for k, v in p.items()} for p in problems[:_MAX_PROBLEMS]]}
        request = current_request()
        if request is not None:
            request.operation(REQUEST_INVALID, target, "invalid_request", principal)
        if self.telemetry is not None:
            self.telemetry.refusal(REQUEST_INVALID, "invalid_request")
        await self.store.audit.append(AuditEvent.by(principal, REQUEST_INVALID, target[:256] if target else None,
                                                    params=params,
                                                    outcome={"status": 400, "error": "invalid_request"},
                                                    request_id=request.request_id if request else None))

    def audited(self, principal: Principal, action: Action | str, target: str | None, *,
                params: dict[str, Any] | None = None, status: int = 200) -> Audited:
        return self._auditor(principal, action, target, params=params, status=status)

    async def visible_tenant(self, principal: Principal, name_or_id: str, action: Action) -> Tenant:
        """The tenant named (by name or id) if `principal` may do `action` on it. The role is checked first; then,
        for anyone but an admin, another tenant is as unknown as one that never existed (a 404, nothing leaks)."""
        authorize(principal, action, None if principal.role is Role.ADMIN else principal.tenant_id)
        tenant: Tenant | None = None
        with contextlib.suppress(NotFoundError):
            tenant = await self.store.tenant_by_name(name_or_id)
        if tenant is None:
            with contextlib.suppress(NotFoundError):
                tenant = await self.store.get_tenant(name_or_id)
        if tenant is None or (principal.role is not Role.ADMIN and tenant.id != principal.tenant_id):
            raise NotFoundError(f"no tenant {name_or_id!r}", details={"tenant": name_or_id})
        return tenant


def _key_prefix(key: str | None) -> str | None:
    """The presented key's prefix if it is a well-formed Corral key; nothing of anything else."""
    if key is None:
        return None
    try:
        return parse_key(key).prefix
    except AuthenticationError:
        return None
