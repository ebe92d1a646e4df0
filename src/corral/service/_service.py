"""`Service`: the one layer every front end calls (REST, E2B, MCP, the dashboard).

It owns the engine and the store, starts and stops them (and the egress proxy) in the right order, and holds one
object per area with one method per operation; each method authorizes, audits and orchestrates. Front ends parse,
call one method, and render; none touches the engine or the store by itself. `Service` only composes: each area
is given what it uses (the store, the engine, the auditor, the authorize step, other areas), never the `Service`
(docs/architecture.md lists who depends on what).

```python
service = Service(engine, store)
async with service:                                   # store, egress proxy, engine, reconciler
    principal = await service.authenticate(key, ClientInfo("127.0.0.1", "POST", "/v1/sandboxes"))
    record = await service.sandboxes.create(principal, CreateSandbox(template="default"))
```
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

from .._exceptions import AuthenticationError
from ..control import ControlStore, Principal
from ..egress import PackageMirror
from ..engine import Engine
from ._access import SandboxAccess
from ._accounts import Keys, Tenants
from ._audit import AuditTrail
from ._audited import Auditor
from ._auto_resume import AutoResume, Waking
from ._callers import REQUEST_INVALID, Callers, ClientInfo
from ._checkpoints import Checkpoints
from ._code import Code
from ._commands import Commands
from ._egress import LiveEgress, TenantEgressSettings
from ._eval import EvalReports
from ._files import Files
from ._grants import PrivateGrants
from ._info import Info
from ._metrics import MetricsSampler
from ._on_sandbox import OnSandbox, SandboxGate
from ._ports import DEFAULT_DOMAIN, Ports
from ._processes import Processes
from ._pty import Pty
from ._reconciler import Reconciler
from ._replicas import Replica, ReplicaConfig
from ._sandboxes import Sandboxes
from ._secrets import StoredSecrets
from ._snapshots import Snapshots
from ._telemetry import Telemetry
from ._templates import Templates
from ._volumes import Volumes

__all__ = ["REQUEST_INVALID", "ClientInfo", "Service", "StartupHook"]

StartupHook = Callable[[ControlStore], Awaitable[None]]


class Service:
    def __init__(self, engine: Engine, store: ControlStore, *, on_startup: StartupHook | None = None,
                 domain: str = DEFAULT_DOMAIN, replica: ReplicaConfig | None = None, metrics: bool = True) -> None:
        self.engine = engine
        self.store = store
        self._on_startup = on_startup
        self.replica = Replica(store, engine, replica or ReplicaConfig())  # this server among others (docs/replicas.md)
        # Prometheus metrics (docs/operations.md); None: nothing is counted (`corral serve --no-metrics`).
        self.telemetry = Telemetry(store, engine, self.replica) if metrics else None
        # One audit record per operation, counted: what every area that audits is given.
        audited = self.auditor = Auditor(store, self.telemetry)
        self.callers = Callers(store, self.telemetry)  # who calls, and the records of refused callers
        self.tenants = Tenants(store, audited)
        self.keys = Keys(store, audited, self.tenants)
        self.audit = AuditTrail(store)
        # The authorize step of every operation on one sandbox, and what such an area needs besides.
        # Paused `auto_resume` sandboxes are woken by the requests that reach into them (docs/lifecycle.md).
        self.auto_resume = AutoResume(store, lambda record: self.sandboxes.resume_record(record))
        authorize = Waking(SandboxGate(store, self.replica), self.auto_resume)
        # Checkpoints of a sandbox in place (docs/lifecycle.md); the automatic ones are taken by the areas that
        # change files, through the hook they are given here.
        self.checkpoints = Checkpoints(store, engine, audited, authorize)
        on_sandbox = OnSandbox(authorize, engine, audited, before_change=self.checkpoints.before_change)
        self.access = SandboxAccess(store, engine, self.replica, self.callers)  # tokens that stand for the key
        self.snapshots = Snapshots(store, engine, audited, authorize)
        self.volumes = Volumes(store, engine, audited)  # docs/volumes.md
        self.secrets = StoredSecrets(store, engine, audited)  # docs/secrets.md
        self.sampler = MetricsSampler(engine)  # what `sandboxes.metrics` serves
        self.sandboxes = Sandboxes(store, engine, audited, authorize, replica=self.replica, tenants=self.tenants,
                                   volumes=self.volumes, secrets=self.secrets, snapshots=self.snapshots,
                                   sampler=self.sampler)
        self.files = Files(on_sandbox)
        self.commands = Commands(on_sandbox)
        self.processes = Processes(on_sandbox)
        self.pty = Pty(on_sandbox)
        self.code = Code(on_sandbox)
        # `domain`: where sandboxes' ports are served (docs/ports.md)
        self.ports = Ports(store, engine, self.callers, self.access, self.auto_resume, domain)
        live = LiveEgress(store, engine)
        # Private destinations admins grant tenants (docs/egress.md).
        self.grants = PrivateGrants(store, audited, self.tenants, live.apply, replica_url=self.replica.url)
        self.egress = TenantEgressSettings(store, audited, self.tenants, self.grants, live, self.telemetry)
        engine.remote_denials = self.egress.denials  # a proxy of another process records them
        self.info = Info(store, engine.backend, self.replica, self.ports.domain)
        self.eval = EvalReports(engine.home)  # the evaluation runs kept in the server's home
        self.templates = Templates(engine.templates, self.snapshots, audited)
        self.reconciler = Reconciler(store, engine, self.replica, self.sandboxes.pause_to_disk,
                                     telemetry=self.telemetry)

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

    # -- callers (the front ends' names for `callers`) ---------------------------------------------------------

    async def authenticate(self, key: str | None, client: ClientInfo) -> Principal:
        """`Callers.authenticate`."""
        return await self.callers.authenticate(key, client)

    async def record_denial(self, client: ClientInfo, exc: AuthenticationError, key: str | None) -> None:
        """`Callers.record_denial`."""
        await self.callers.record_denial(client, exc, key)

    async def record_invalid(self, principal: Principal, client: ClientInfo, *, route: str | None,
                             target: str | None, problems: list[dict[str, str]]) -> None:
        """`Callers.record_invalid`."""
        await self.callers.record_invalid(principal, client, route=route, target=target, problems=problems)
