"""Sandboxes: create, list, get, kill, timeout, network, pause, resume, and the operator kill switch.

Each method authorizes, audits, checks quotas (the store) and capacity (the engine), and orchestrates store and
engine with the compensations a failure needs: a sandbox the engine made never outlives its record, and a
record whose sandbox could not be made stops counting against the tenant's quotas.
"""

from __future__ import annotations

import asyncio
import builtins
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from .._bounds import MAX_DURATION, EnvVars, Metadata
from .._exceptions import (
    ConflictError,
    CorralError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    RuntimeUnavailableError,
    SandboxTimeoutError,
)
from ..backends import (
    DEFAULT_FILE_ROOTS,
    ROOT_FILE_ROOTS,
    Limits,
    Runtime,
    SandboxSpec,
    SandboxState,
    SnapshotArtifact,
    backend_runtimes,
)
from ..backends._spec import SealedSecret
from ..control import (
    Action,
    Principal,
    Role,
    SandboxQuery,
    SandboxRecord,
    StoredSecret,
    Tenant,
    TenantEgress,
    authorize,
)
from ..egress import EgressPolicy
from ..engine import Adoption
from ._checkpoints import CheckpointOptions, checkpoint_mode
from ._cursor import decode_cursor, encode_cursor
from ._metrics import SandboxMetric
from ._outcome import RETRY_AFTER_DETAIL
from ._secrets import SecretRequest, audit_secrets, seal_secrets
from ._snapshots import SNAPSHOT_ID, artifact_of

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import Engine
    from ._accounts import Tenants
    from ._audited import Auditor
    from ._metrics import MetricsSampler
    from ._on_sandbox import Authorize
    from ._replicas import Replica
    from ._secrets import StoredSecrets
    from ._snapshots import Snapshots
    from ._volumes import Volumes

__all__ = ["CHECKPOINT_UNAVAILABLE", "CreateSandbox", "ForkSandbox", "KillReport", "SandboxPage", "Sandboxes",
           "check_network", "file_roots"]

# Why `pause(memory=True, to_disk=True)` is refused (docs/lifecycle.md, "Processes across a pause to disk").
CHECKPOINT_UNAVAILABLE = (
    "keeping processes across a pause to disk needs CRIU checkpoints of the sandbox, which Corral does not take "
    "(docs/lifecycle.md says why); pause(memory=False) keeps every file and ends the processes, pause() keeps "
    "both in memory")

# Quotas on totals free up when the tenant's sandboxes end; per-sandbox maxima never do.
_TOTAL_QUOTAS = frozenset({"max_sandboxes", "max_memory_bytes", "max_cpus"})
_RETRY_AFTER_MAX = 300
_PARALLEL_DESTROYS = 8  # runc deletes are mostly waiting on the kernel; a few at once is faster


class CreateSandbox(CheckpointOptions):
    """What a tenant asks for; every front end builds one (the REST API takes it as its body as it is)."""

    model_config = ConfigDict(extra="forbid")

    template: str = "default"
    runtime: str = "runc"
    timeout: Annotated[float, Field(gt=0, le=MAX_DURATION)] = 300
    network: str | list[str] = "none"  # docs/egress.md: "none", "internet" or a list of rules
    limits: dict[str, Any] = Field(default_factory=dict)
    env: EnvVars = Field(default_factory=dict)
    metadata: Metadata = Field(default_factory=dict)
    file_roots: list[str] | None = None  # None: DEFAULT_FILE_ROOTS
    # "pause": paused to disk when the TTL ends; "pause_memory": frozen in place, processes kept (docs/lifecycle.md)
    on_timeout: Literal["kill", "pause", "pause_memory"] = "kill"
    # Paused, it resumes when a request reaches it (commands, files, code, ports; E2B's autoResume; docs/lifecycle.md)
    auto_resume: bool = False
    volumes: dict[str, str] = Field(default_factory=dict)  # mount path -> the tenant's volume name
    public_ports: bool = False  # the sandbox's ports answer without the tenant's key (docs/lifecycle.md)
    # Root inside the sandbox (docs/security.md): commands and files may act as "root", and `sudo` works. Only
    # where the backend has a user namespace per sandbox (`service.info`: `root`); elsewhere `invalid_request`.
    root: bool = False
    # name -> value and hosts (docs/secrets.md): `$name` inside is a placeholder; values only at the egress proxy
    secrets: dict[str, SecretRequest] = Field(default_factory=dict)

    def audit_params(self) -> dict[str, Any]:
        params = self.model_dump(mode="json", exclude={"env", "secrets"})
        params["env_names"] = sorted(self.env)  # values often carry secrets
        if self.secrets:
            params["secrets"] = audit_secrets(self.secrets)
        return params


MAX_FORKS = 100  # children of one fork call


class ForkSandbox(BaseModel):
    """What may differ between a fork and its parent (its time to live, its metadata), and how many children of
    the same instant to start (`count`: the parent is frozen and copied once)."""

    model_config = ConfigDict(extra="forbid")

    timeout: Annotated[float, Field(gt=0, le=MAX_DURATION)] | None = None
    metadata: Metadata | None = None
    count: Annotated[int, Field(ge=1, le=MAX_FORKS)] | None = None


@dataclass(frozen=True)
class SandboxPage:
    """A page of sandboxes; `next_cursor` asks for the next one (None: this was the last)."""

    records: builtins.list[SandboxRecord]
    next_cursor: str | None


@dataclass(frozen=True)
class KillReport:
    killed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    revoked: bool = False


def file_roots(record: SandboxRecord) -> list[str]:
    """The directories the file API may touch in this sandbox."""
    roots = record.spec.file_roots
    return list(roots) if roots else list(DEFAULT_FILE_ROOTS)


def _default_roots(root: bool) -> tuple[str, ...]:
    """Where the file API goes when the tenant names no roots: a sandbox with root adds root's home."""
    return ROOT_FILE_ROOTS if root else DEFAULT_FILE_ROOTS


def _utc(moment: datetime | None) -> datetime | None:
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def check_network(network: str | list[str], egress: TenantEgress) -> str | list[str]:
    """The policy in its normal form, if it is well-formed and within the tenant's ceiling."""
    policy = EgressPolicy.parse(network, private=egress.private)  # InvalidRequestError says what is wrong
    # The tenant's private pairs belong to its ceiling by definition; PermissionDeniedError names any excess.
    policy.within(EgressPolicy.parse(egress.ceiling, private=egress.private))
    return policy.to_wire()


class Sandboxes:
    """Each dependency is what it uses of it: the store and the engine it orchestrates, the audit, the authorize
    step (`authorized`), this replica's id (the owner of what it creates), the tenants (the kill switch's),
    volumes, stored secrets and snapshots (what a create resolves), and the metrics sampler (`metrics`)."""

    def __init__(self, store: ControlStore, engine: Engine, audited: Auditor, authorize: Authorize, *,
                 replica: Replica, tenants: Tenants, volumes: Volumes, secrets: StoredSecrets, snapshots: Snapshots,
                 sampler: MetricsSampler) -> None:
        self._store = store
        self._engine = engine
        self._audited = audited
        self._authorize = authorize
        self._replica = replica
        self._tenants = tenants
        self._volumes = volumes
        self._secrets = secrets
        self._snapshots = snapshots
        self._sampler = sampler

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def create(self, principal: Principal, request: CreateSandbox) -> SandboxRecord:
        sandbox_id = f"sb-{secrets.token_hex(8)}"
        async with self._audited(principal, "sandbox.create", sandbox_id, params=request.audit_params(),
                                 status=201) as audit:
            source = await self._source(principal, request.template)
            volumes = await self._volumes.resolve(principal, request.volumes) if request.volumes else {}
            stored = await self._secrets.for_sandbox(principal, request.secrets) if request.secrets else {}
            tenant, egress = await self._store.tenant_settings(principal.tenant_id)
            request = request.model_copy(update={"checkpoints": checkpoint_mode(
                request.checkpoints, tenant.default_checkpoints, self._engine.checkpoints_supported)})
            spec = self._spec(request, egress, volumes, template_known=source is not None, stored=stored)
            spec = await self._required_runtime(principal, spec, audit.outcome, tenant)
            claimed = self._engine.claim(spec) if source is None else None
            if claimed is None:
                return await self._start(principal, spec, sandbox_id, lambda: self._engine.create(
                    spec, sandbox_id=sandbox_id, source=source))
            audit.target = claimed
            return await self._adopt(principal, spec, claimed)

    async def _adopt(self, principal: Principal, spec: SandboxSpec, claimed: str) -> SandboxRecord:
        """A create served by a warm pool's member (docs/performance.md): the engine applies `spec` to it (in
        memory, a millisecond), then it is recorded running, quotas checked, in one transaction. A refusal
        destroys it (never pooled again: the refused create's audit record names it, and no tenant may know
        another's sandbox id). Until the record exists nobody can reach it; the reconciler spares young
        sandboxes, and one left by a crash here has no record and is swept as an orphan."""
        engine = self._engine
        try:
            await engine.adopt(claimed, spec)
        except BaseException:
            if engine.is_claimed(claimed):
                engine.release(claimed, reuse=False)
            raise
        try:
            return await self._reserve(principal, spec, claimed, running=True)
        except BaseException:
            await asyncio.shield(engine.destroy(claimed))
            raise

    async def _required_runtime(self, principal: Principal, spec: SandboxSpec, outcome: dict[str, Any],
                                tenant: Tenant | None = None) -> SandboxSpec:
        """`spec` on the runtime the tenant requires (docs/security.md, "Runtime policy"), whatever it asked for:
        a sandbox asked for on runc is upgraded, and the audit `outcome` says so. Every path that starts a
        sandbox for a tenant (create, from a snapshot too, and fork) comes through here. A backend that cannot
        run the required runtime refuses, naming the policy: it never falls back to a weaker one."""
        required = (tenant or await self._store.get_tenant(principal.tenant_id)).required_runtime
        if required is None:
            return spec
        runtime = Runtime(required)
        backend = self._engine.backend
        if runtime not in backend_runtimes(backend):
            raise RuntimeUnavailableError(
                f"this tenant's policy requires the {runtime.value} runtime for every sandbox, and the "
                f"{backend.name} backend cannot run it; ask the operator", details={"required_runtime": runtime.value})
        if spec.runtime is runtime:
            return spec
        outcome["runtime_upgraded"] = {"asked": spec.runtime.value, "runtime": runtime.value}
        return SandboxSpec.model_validate({**spec.model_dump(), "runtime": runtime})

    async def _start(self, principal: Principal, spec: SandboxSpec, sandbox_id: str,
                     make: Callable[[], Awaitable[object]]) -> SandboxRecord:
        """Reserve (quotas), have the engine `make` it, record it running; undo the reservation on failure."""
        return (await self._start_many(principal, spec, [sandbox_id], make))[0]

    async def _start_many(self, principal: Principal, spec: SandboxSpec, sandbox_ids: builtins.list[str],
                          make: Callable[[], Awaitable[object]]) -> builtins.list[SandboxRecord]:
        """`_start` for several sandboxes the engine makes in one call: every reservation first (a quota without
        room for all of them refuses all), undone, each, if anything fails."""
        reserved: builtins.list[SandboxRecord] = []
        try:
            for sandbox_id in sandbox_ids:
                reserved.append(await self._reserve(principal, spec, sandbox_id))
            await make()
        except BaseException:
            for record in reserved:
                await asyncio.shield(self._store.mark_destroyed(record.id, failed=True))
            raise
        return [await self._mark_running(record.id) for record in reserved]

    async def _source(self, principal: Principal, template: str) -> SnapshotArtifact | None:
        """A template that is the id of one of the tenant's snapshots starts from that snapshot."""
        if not SNAPSHOT_ID.fullmatch(template):
            return None
        try:
            snapshot = await self._snapshots.authorized(principal, template, Action.SANDBOX_READ)
        except NotFoundError:
            raise InvalidRequestError(f"no template or snapshot {template!r}", details={"template": template}) from None
        if snapshot.backend != self._engine.backend.name:
            raise InvalidRequestError(f"snapshot {template} was taken on the {snapshot.backend} backend; this "
                                      f"server runs the {self._engine.backend.name} backend",
                                      details={"template": template})
        return artifact_of(snapshot)

    def _spec(self, request: CreateSandbox, egress: TenantEgress, volumes: dict[str, str], *,
              template_known: bool = False, stored: dict[str, StoredSecret] | None = None) -> SandboxSpec:
        network = check_network(request.network, egress)
        try:
            spec = SandboxSpec(template=request.template, runtime=request.runtime,  # type: ignore[arg-type]
                               timeout=request.timeout, limits=Limits(**request.limits), env=request.env,
                               metadata=request.metadata,
                               file_roots=_default_roots(request.root) if request.file_roots is None
                               else tuple(request.file_roots),
                               network=network if isinstance(network, str) else tuple(network),
                               network_private=tuple(egress.private), on_timeout=request.on_timeout,
                               auto_resume=request.auto_resume,
                               volumes=volumes, public_ports=request.public_ports, root=request.root,
                               secrets=self._sealed(request, stored or {}), **request.checkpoint_spec())
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}"
                                 for e in exc.errors())
            raise InvalidRequestError(f"invalid sandbox spec: {problems}") from None
        self._engine.check_secrets(spec)
        if template_known:
            return spec
        try:
            self._engine.templates.get(spec.template)
        except NotFoundError as exc:
            raise InvalidRequestError(exc.message, details={"template": spec.template}) from None
        return spec

    def _sealed(self, request: CreateSandbox, stored: dict[str, StoredSecret]) -> tuple[SealedSecret, ...]:
        if not request.secrets:
            return ()
        return seal_secrets(request.secrets, request.env, self._engine.keyring, stored)

    async def fork(self, principal: Principal, sandbox_id: str, request: ForkSandbox) -> builtins.list[SandboxRecord]:
        """New sandboxes (`request.count`, default one) with the parent's files at this instant and its spec
        (unless `request` changes the timeout or metadata), counted against the tenant's quotas like creates.
        All or nothing: a quota that lacks room for all of them, or a child that cannot start, starts none."""
        child_ids = [f"sb-{secrets.token_hex(8)}" for _ in range(request.count or 1)]
        async with self._audited(principal, "sandbox.fork", sandbox_id,
                                 params=request.model_dump(mode="json"), status=201) as audit:
            await self.authorized(principal, sandbox_id, Action.SANDBOX_READ)
            authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
            changes: dict[str, Any] = {}
            if request.timeout is not None:
                changes["timeout"] = request.timeout
            if request.metadata is not None:
                changes["metadata"] = request.metadata
            try:
                spec = self._engine.spec(sandbox_id).model_copy(update=changes)  # with its env values
                spec = SandboxSpec.model_validate(spec.model_dump())
            except pydantic.ValidationError as exc:
                raise InvalidRequestError(f"invalid fork: {exc.errors()[0]['msg']}") from None
            spec = await self._required_runtime(principal, spec, audit.outcome)  # set since the parent started
            audit.outcome["sandbox_ids"] = child_ids
            return await self._start_many(principal, spec, child_ids, lambda: self._engine.fork_many(
                sandbox_id, child_ids, spec=spec))

    async def _reserve(self, principal: Principal, spec: SandboxSpec, sandbox_id: str, *,
                       running: bool = False) -> SandboxRecord:
        try:
            return await self._store.reserve_sandbox(principal, spec, sandbox_id=sandbox_id,
                                                     owner=self._replica.id, running=running)
        except QuotaExceededError as exc:
            if exc.details.get("limit") in _TOTAL_QUOTAS:
                exc.details[RETRY_AFTER_DETAIL] = await self._retry_after(principal.tenant_id)
            raise

    async def _retry_after(self, tenant_id: str) -> int:
        """Seconds until the tenant's first sandbox expires: the earliest a total quota can free up by itself."""
        live = await self._store.list_sandboxes(tenant_id)
        if not live:
            return 1
        wait = (min(r.expires_at for r in live) - datetime.now(UTC)).total_seconds()
        return max(1, min(_RETRY_AFTER_MAX, int(wait) + 1))

    async def _mark_running(self, sandbox_id: str) -> SandboxRecord:
        """Record the new sandbox as running, unless the kill switch ended it while the engine was creating it."""
        try:
            return await self._store.mark_running(sandbox_id)
        except BaseException as exc:
            await self.destroy(sandbox_id)  # what the engine made must not outlive its record
            if isinstance(exc, NotFoundError):
                raise ConflictError(f"sandbox {sandbox_id} was stopped (kill switch) while it was being created",
                                    details={"sandbox_id": sandbox_id}) from None
            raise

    async def list(self, principal: Principal, metadata: dict[str, str] | None = None) -> list[SandboxRecord]:
        wanted = metadata or {}
        async with self._audited(principal, "sandbox.list", None, params={"metadata": wanted}) as audit:
            authorize(principal, Action.SANDBOX_READ, principal.tenant_id)
            records = await self._store.list_sandboxes(principal.tenant_id, metadata=wanted)
            audit.outcome["count"] = len(records)
        return records

    async def page(self, principal: Principal, query: SandboxQuery, cursor: str | None = None) -> SandboxPage:
        """One page of the tenant's live sandboxes that `query` selects; `cursor` is the previous page's
        `next_cursor` (a malformed one is `InvalidRequestError`)."""
        params = {"metadata": dict(query.metadata), "states": sorted(query.states or ()), "template": query.template,
                  "newest_first": query.newest_first, "limit": query.limit}
        async with self._audited(principal, "sandbox.list", None, params=params) as audit:
            authorize(principal, Action.SANDBOX_READ, principal.tenant_id)
            limit = query.limit
            wanted = replace(query, after=decode_cursor(cursor) if cursor else None,
                             limit=None if limit is None else limit + 1)
            records = await self._store.query_sandboxes(principal.tenant_id, wanted)
            more = limit is not None and len(records) > limit
            if more:
                records = records[:limit]
            audit.outcome["count"] = len(records)
        return SandboxPage(records, encode_cursor(records[-1]) if more else None)

    async def egress_limits(self, principal: Principal) -> TenantEgress:
        """What network the caller's own tenant may give its sandboxes (its ceiling and private pairs): what a
        front end needs to turn another API's network settings into a policy the tenant may have. Anyone who may
        create sandboxes may know it; not audited (the create that uses it is)."""
        authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
        return await self._store.tenant_egress(principal.tenant_id)

    async def alive(self, principal: Principal, sandbox_id: str) -> bool:
        """Whether the sandbox runs and its agent answers: False for a paused, ended, unknown or wedged one."""
        async with self._audited(principal, "sandbox.health", sandbox_id) as audit:
            try:
                record = await self.authorized(principal, sandbox_id, Action.SANDBOX_READ)
                alive = record.state is SandboxState.RUNNING and await self._engine.alive(sandbox_id)
            except NotFoundError:
                alive = False
            audit.outcome["alive"] = alive
        return alive

    async def get(self, principal: Principal, sandbox_id: str) -> SandboxRecord:
        async with self._audited(principal, "sandbox.get", sandbox_id):
            return await self.authorized(principal, sandbox_id, Action.SANDBOX_READ)

    async def metrics(self, principal: Principal, sandbox_id: str, start: datetime | None = None,
                      end: datetime | None = None) -> builtins.list[SandboxMetric]:
        """The sandbox's resource samples from `start` to `end` (both included, to the second; naive times are
        UTC; None: from its first sample, up to now), oldest first: one every 5 s while it runs, none while it
        is paused, the last hour kept (`MetricsSampler`). A window before the sandbox existed is []."""
        start, end = _utc(start), _utc(end)
        params = {"start": _iso(start), "end": _iso(end)}
        async with self._audited(principal, "sandbox.metrics", sandbox_id, params=params) as audit:
            await self.authorized(principal, sandbox_id, Action.SANDBOX_READ)
            if start is not None and end is not None and start > end:
                raise InvalidRequestError(f"start ({params['start']}) is after end ({params['end']})", details=params)
            samples = self._sampler.window(sandbox_id, start, end)
            audit.outcome["count"] = len(samples)
            return samples

    async def kill(self, principal: Principal, sandbox_id: str) -> None:
        async with self._audited(principal, "sandbox.kill", sandbox_id, status=204):
            await self.authorized(principal, sandbox_id, Action.SANDBOX_KILL)
            await self.destroy(sandbox_id)

    async def set_timeout(self, principal: Principal, sandbox_id: str, seconds: float) -> SandboxRecord:
        async with self._audited(principal, "sandbox.timeout", sandbox_id, params={"timeout": seconds}):
            await self.authorized(principal, sandbox_id, Action.SANDBOX_UPDATE)
            return await self._store.set_sandbox_timeout(sandbox_id, seconds)  # the reconciler reads it

    async def set_network(self, principal: Principal, sandbox_id: str,
                          network: str | builtins.list[str]) -> SandboxRecord:
        """Change a live sandbox's egress policy: new connections follow it at once; open ones keep going."""
        async with self._audited(principal, "sandbox.network", sandbox_id, params={"network": network}):
            record = await self.authorized(principal, sandbox_id, Action.SANDBOX_UPDATE)
            egress = await self._store.tenant_egress(record.tenant_id)
            normal = check_network(network, egress)
            self._engine.set_network(sandbox_id, normal, private=egress.private)
            return await self._store.set_sandbox_network(sandbox_id, normal)

    async def pause(self, principal: Principal, sandbox_id: str, *, memory: bool = True,
                    to_disk: bool = False) -> SandboxRecord:
        """`memory`: frozen in place; otherwise paused to disk (docs/lifecycle.md). `to_disk` with `memory`
        (processes kept across a pause to disk, by checkpointing them) is refused with the reason."""
        params = {"memory": memory, "to_disk": to_disk}
        async with self._audited(principal, "sandbox.pause", sandbox_id, params=params):
            await self.authorized(principal, sandbox_id, Action.SANDBOX_UPDATE)
            if memory and to_disk:
                raise RuntimeUnavailableError(CHECKPOINT_UNAVAILABLE, details={"feature": "checkpoint"})
            if memory:
                await self._engine.pause(sandbox_id)
                return await self._store.set_sandbox_state(sandbox_id, SandboxState.PAUSED)
            return await self.pause_to_disk(sandbox_id)

    async def pause_to_disk(self, sandbox_id: str) -> SandboxRecord:
        """Record first (the tenant's `max_paused`), then stop; a failed stop leaves it recorded as it was."""
        store = self._store
        before = await store.get_sandbox(sandbox_id)
        record = await store.pause_to_disk(sandbox_id)
        try:
            await self._engine.pause(sandbox_id, memory=False)
        except BaseException:
            await asyncio.shield(store.resumed(sandbox_id))
            if before.state is SandboxState.PAUSED:
                await asyncio.shield(store.set_sandbox_state(sandbox_id, SandboxState.PAUSED))
            raise
        return record

    async def resume(self, principal: Principal, sandbox_id: str) -> SandboxRecord:
        async with self._audited(principal, "sandbox.resume", sandbox_id):
            return await self.resume_record(await self.authorized(principal, sandbox_id, Action.SANDBOX_UPDATE))

    async def connect(self, principal: Principal, sandbox_id: str, timeout: float | None = None, *,
                      resume: bool = True) -> tuple[SandboxRecord, bool]:
        """Make the sandbox usable: resumed if it is paused (unless not `resume`), and alive at least `timeout`
        more seconds (its end is only ever moved later, never earlier). Returns the record and whether it was
        resumed."""
        async with self._audited(principal, "sandbox.connect", sandbox_id,
                                 params={"timeout": timeout, "resume": resume}) as audit:
            record = await self.authorized(principal, sandbox_id, Action.SANDBOX_UPDATE)
            was_paused = resume and record.state is SandboxState.PAUSED
            if was_paused:
                record = await self.resume_record(record)
            if timeout is not None and record.expires_at < datetime.now(UTC) + timedelta(seconds=timeout):
                record = await self._store.set_sandbox_timeout(sandbox_id, timeout)
            audit.outcome["resumed"] = was_paused
        return record, was_paused

    async def resume_record(self, record: SandboxRecord) -> SandboxRecord:
        """Resume a paused sandbox whose record the caller holds, authorized and audited already (the lifecycle's
        own step, which auto-resume wakes sandboxes with too)."""
        sandbox_id = record.id
        if not record.paused_to_disk:
            await self._engine.resume(sandbox_id)
            return await self._store.resumed(sandbox_id)
        resumed = await self._store.resumed(sandbox_id)  # the running quotas, reserved before it boots
        try:
            await self._engine.resume(sandbox_id)
        except BaseException:
            await asyncio.shield(self._store.pause_to_disk(sandbox_id))
            raise
        return resumed

    async def recoverable(self) -> dict[str, Adoption]:
        """What a restarted engine reattaches, as the store describes it: every live record that runs, is paused
        or was lost (its replica may be this one, back). The engine sweeps whatever else it finds."""
        wanted = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.LOST)
        return {r.id: Adoption(spec=r.spec, state=SandboxState.PAUSED if r.state is SandboxState.PAUSED
                               else SandboxState.RUNNING, paused_to_disk=r.paused_to_disk,
                               created_at=r.created_at.timestamp())
                for r in await self._store.list_sandboxes(None) if r.state in wanted}

    # -- shared by the other services ----------------------------------------------------------------------

    async def authorized(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord:
        """The sandbox if `principal` may do `action` on it; another tenant's is as unknown as a missing one. One
        that another replica runs, or that is lost, is refused with the reason (`Replica.check_local`)."""
        return await self._authorize(principal, sandbox_id, action)

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy in the engine (gone already is fine) and record it."""
        try:
            await self._engine.destroy(sandbox_id)
        except (NotFoundError, SandboxTimeoutError):
            pass
        await self._store.mark_destroyed(sandbox_id)

    # -- the operator kill switch --------------------------------------------------------------------------

    async def kill_all(self, principal: Principal, *, tenant: str | None = None, key: str | None = None,
                       revoke: bool = False) -> KillReport:
        """Stop every sandbox of a tenant, or of one API key (revoked first with `revoke`), at once.

        A sandbox still being created is marked destroyed here; its create then finds it gone and destroys what
        the engine made, so nothing started before the switch survives it.
        """
        if (tenant is None) == (key is None):
            raise InvalidRequestError("name exactly one of 'tenant' or 'key'")
        if revoke and key is None:
            raise InvalidRequestError("'revoke' applies to a key; disable a tenant instead")
        target = f"key:{key}" if key is not None else f"tenant:{tenant}"
        params = {"tenant": tenant, "key": key, "revoke": revoke}
        async with self._audited(principal, "sandbox.kill_all", target[:256], params=params) as audit:
            if key is not None:
                tenant_id = await self._key_tenant_id(principal, key)
                if revoke:
                    await self._store.revoke_key(key)  # first, so no new sandbox slips in behind the sweep
                records = await self._store.list_sandboxes(tenant_id, key_id=key)
            else:
                assert tenant is not None
                tenant_id = (await self._tenants.visible(principal, tenant, Action.SANDBOX_KILL_ALL)).id
                records = await self._store.list_sandboxes(tenant_id)
            report = await self._destroy_all([r.id for r in records], revoked=revoke)
            # A sandbox the engine failed to stop is reported, not hidden behind an error that loses the others.
            audit.outcome.update(killed=report.killed, failed=report.failed, revoked=revoke)
        return report

    async def _key_tenant_id(self, principal: Principal, key_id: str) -> str:
        """The key's tenant; another tenant's key is as unknown to an operator as a key that never existed."""
        authorize(principal, Action.SANDBOX_KILL_ALL, None if principal.role is Role.ADMIN else principal.tenant_id)
        try:
            key = await self._store.get_key(key_id)
        except NotFoundError:
            key = None
        if key is None or (principal.role is not Role.ADMIN and key.tenant_id != principal.tenant_id):
            raise NotFoundError(f"no API key {key_id!r}", details={"key": key_id})
        return key.tenant_id

    async def _destroy_all(self, sandbox_ids: builtins.list[str], *, revoked: bool) -> KillReport:
        gate = asyncio.Semaphore(_PARALLEL_DESTROYS)
        failed: dict[str, str] = {}

        async def one(sandbox_id: str) -> None:
            async with gate:
                try:
                    await self.destroy(sandbox_id)
                except CorralError as exc:
                    failed[sandbox_id] = f"{exc.code}: {exc.message}"

        await asyncio.gather(*(one(s) for s in sandbox_ids))
        return KillReport([s for s in sandbox_ids if s not in failed], failed, revoked)


