"""The engine: sandboxes' lifecycle over a backend, their timeouts, their state on disk, a warm pool.

The control plane serves this API. It is async; every method is safe to call concurrently.

The engine never imports a backend implementation: it takes a `Backend` (docs/backends.md) or loads one by name.
Around the backend's calls it waits for each new sandbox's agent, attaches the egress proxy, tells an OOM kill
from any other SIGKILL, and undoes a create that fails half-way.

State: the engine's own, one file per sandbox, `<home>/engine/<id>.json` (spec, times, state, the backend's name
and record). A restarted engine reads them back, gives each record to `backend.restore`, reattaches to every
sandbox still `alive` (`adopt`), and has the backend `sweep` whatever it holds beyond those: half-created, dead,
expired or pooled sandboxes, so nothing leaks across restarts.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import write_atomic, write_json_atomic
from .._exceptions import (
    AgentError,
    CapacityError,
    ConflictError,
    CorralError,
    InvalidRequestError,
    NotFoundError,
    SandboxTimeoutError,
)
from .._settings import agent_seconds, corral_home
from ..backends import (
    RESIZABLE_LIMITS,
    AgentAddress,
    Backend,
    BackendCapacity,
    BackendRecord,
    RemoteEgress,
    Resizable,
    SandboxUsage,
    SnapshotArtifact,
    load_backend,
)
from ..backends._spec import check_user
from ..templates import Template, TemplateStore
from ._agent_client import AgentClient, Liveness, OutputCallback, PtySession, Source, StartCallback, WatchStream
from ._capacity import Capacity, MachineUsage
from ._code import CodeError, CodeResult, CodeSession, ResultCallback
from ._models import (
    Entry,
    ExecResult,
    Limits,
    ProcessInfo,
    ProcessSelector,
    PtySize,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    WatchEvent,
)
from ._pool import PoolState, PoolStats, WarmPool

if TYPE_CHECKING:
    from ..egress import EgressEvent, EgressPolicy, EgressProxy
    from ..egress._keyring import SecretKeyring

logger = logging.getLogger("corral.engine")

DenialSource = Callable[[str, float], Awaitable[Sequence["EgressEvent"]]]  # (sandbox id, since) -> refusals

REAP_INTERVAL = 1.0
TOMBSTONES_KEPT = 1000
STATE_DIR = "engine"  # under the home: one `<sandbox id>.json` per sandbox
_READY_POLL = 0.02  # seconds between pings while a new sandbox's agent starts
_ALIVE_POLL = 0.25  # ... and between asking the backend whether it still runs at all
_CLAIM_PING_TIMEOUT = 2.0  # a pool member's agent answers a ping in a millisecond; one that does not is dead
_POOL_QUIET = 0.5  # seconds after the last create or claim before pools start refilling (a burst goes first)
_POOL_PARALLEL = max(1, os.cpu_count() or 1)  # members started at once: one per core
_POOL_IDLE_POLL = 2.0  # seconds between looks at the pools when nothing wakes the filler
_POOL_PRESSURE_POLL = 1.0  # ... while memory is short
_POOL_RETRY = 5.0  # seconds before a pool whose member failed to start tries again
_GiB = 1024**3

# Every sandbox reaches out only through the egress proxy, bridged by the agent to 127.0.0.1:3128 (docs/egress.md).
# Lower-case twins: curl and wget read only those.
_PROXY = "http://127.0.0.1:3128"
_NO_PROXY = "localhost,127.0.0.1,::1"
EGRESS_ENV = {
    "HTTP_PROXY": _PROXY, "HTTPS_PROXY": _PROXY, "http_proxy": _PROXY, "https_proxy": _PROXY,
    "NO_PROXY": _NO_PROXY, "no_proxy": _NO_PROXY,
}
# A sandbox with secrets trusts the deployment's CA (docs/secrets.md), through the variables its clients read:
# OpenSSL and Python's ssl, requests, curl, git, pip and Node (which adds to its own store).
_TRUST_DIR = "/.corral/egress"
TRUST_CA, TRUST_BUNDLE = "ca.pem", "ca-bundle.pem"
TRUST_ENV = {
    "SSL_CERT_FILE": f"{_TRUST_DIR}/{TRUST_BUNDLE}", "REQUESTS_CA_BUNDLE": f"{_TRUST_DIR}/{TRUST_BUNDLE}",
    "CURL_CA_BUNDLE": f"{_TRUST_DIR}/{TRUST_BUNDLE}", "GIT_SSL_CAINFO": f"{_TRUST_DIR}/{TRUST_BUNDLE}",
    "PIP_CERT": f"{_TRUST_DIR}/{TRUST_BUNDLE}", "NODE_EXTRA_CA_CERTS": f"{_TRUST_DIR}/{TRUST_CA}",
}
_HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
# Where the policy grants the package preset, pip and npm use the proxy's caching mirror. Elsewhere they keep
# their usual registries through the proxy, so a refusal reaches them as a refused CONNECT, whose reason pip
# prints in its retry warnings (a refused mirror page, pip would report only as "no matching distribution").
MIRROR_ENV = {"PIP_INDEX_URL": f"{_PROXY}/pypi/simple/", "npm_config_registry": f"{_PROXY}/npm/"}


@functools.lru_cache(maxsize=1)
def _host_bundle() -> bytes:
    """The host's trust store (Debian's path first), which the sandbox's bundle extends."""
    for path in _HOST_BUNDLES:
        with contextlib.suppress(OSError):
            return Path(path).read_bytes()
    return b""


@functools.lru_cache(maxsize=1024)
def _grants_packages(network: str | tuple[str, ...], private: tuple[str, ...]) -> bool:
    """Memoised: every exec builds an environment, and parsing the policy each time would tax that hot path."""
    spec_policy = SandboxSpec.model_construct(network=network, network_private=private).egress_policy()
    return spec_policy.grants_preset("packages")


@dataclass
class _Sandbox:
    id: str
    spec: SandboxSpec
    record: BackendRecord
    agent: AgentClient  # made once from the backend's `agent_address`, fixed for the sandbox's life
    created_at: float
    expires_at: float
    state: SandboxState = SandboxState.RUNNING
    template_env: dict[str, str] = field(default_factory=dict)
    pooled: bool = False
    # Paused to disk (docs/lifecycle.md): no process, no memory; `ttl_left` is what its timeout had left, the
    # clock stops while it sleeps.
    paused_to_disk: bool = False
    ttl_left: float = 0.0
    # Serialises what changes the sandbox's state (pause, resume, snapshot, destroy): a snapshot must not copy a
    # disk that a pause is unmounting, nor the reaper pause what a caller is resuming.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, compare=False, repr=False)

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            state=self.state,
            template=self.spec.template,
            runtime=self.spec.runtime.value,
            limits=self.spec.limits,
            created_at=datetime.fromtimestamp(self.created_at, UTC),
            expires_at=datetime.fromtimestamp(self.expires_at, UTC),
            env=dict(self.spec.env),
            metadata=dict(self.spec.metadata),
            paused_to_disk=self.paused_to_disk,
        )

    def to_json(self, backend: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "state": self.state.value,
            "template_env": self.template_env,
            "pooled": self.pooled,
            "paused_to_disk": self.paused_to_disk,
            "ttl_left": self.ttl_left,
            "backend": backend,
            "record": self.record.to_json(),
        }


class Engine:
    """Creates, runs and destroys sandboxes on one backend.

    ```python
    async with Engine() as engine:
        sb = await engine.create(SandboxSpec(template="default", limits=Limits(memory="512M")))
        result = await sb.exec("echo hi")
        await sb.files.write("/workspace/a.bin", b"\\x00\\xff")
        await sb.destroy()
    ```

    **Parameters:**
    * **home** - the state directory (default: `$CORRAL_HOME` or `/var/lib/corral`).
    * **backend** - where isolation comes from: a `corral.backends.Backend`, or the name of one to load with
      `corral.backends.load_backend(name, home)` (default `"local"`: OCI bundles on this host, runc or runsc).
    * **pools** - warm pools (`WarmPool`): sandboxes started ahead of demand, per spec, that `create` (and the
      service, through `claim`) hands out instead of starting one (docs/performance.md, "Warm pools").
    * **pool_size** - shorthand for one pool of `pool_spec` (default: the default spec) of this size.
    * **capacity** - how much of the backend's room sandboxes may take (`Capacity`); past it `create` raises
      `CapacityError` and starts nothing.
    * **egress** - the egress proxy (`corral.egress.EgressProxy`, started by the caller) that enforces each
      sandbox's `network` policy. Without one, nothing leaves a sandbox at all (loopback only).
    """

    def __init__(self, home: str | os.PathLike[str] | None = None, backend: Backend | str = "local", *,
                 templates: TemplateStore | None = None, pools: Sequence[WarmPool] = (), pool_size: int = 0,
                 pool_spec: SandboxSpec | None = None, capacity: Capacity | None = None,
                 egress: EgressProxy | None = None, keyring: SecretKeyring | None = None,
                 liveness: Liveness | None = None) -> None:
        self.home = corral_home(home)
        self._keyring = keyring
        self.liveness = liveness or _liveness_from_settings()
        self.backend: Backend = load_backend(backend, self.home) if isinstance(backend, str) else backend
        # Asked once: every exec builds an environment, and a Protocol's isinstance costs ~8 us.
        self._remote_egress = self.backend if isinstance(self.backend, RemoteEgress) else None
        self._resizable = self.backend if isinstance(self.backend, Resizable) else None
        self.templates = templates or TemplateStore(self.home)
        if pool_size:
            pools = [*pools, WarmPool(pool_spec or SandboxSpec(), pool_size)]
        self._pools: dict[tuple[object, ...], PoolState] = {}
        for pool in pools:
            if self._pool_key(pool.spec) in self._pools:
                raise InvalidRequestError(f"warm pools {self._pools[self._pool_key(pool.spec)].pool.describe()!r} "
                                          f"and {pool.describe()!r} serve the same sandboxes on this backend")
            self._pools[self._pool_key(pool.spec)] = PoolState(pool)
        # Pools give members back while the backend has less memory available (None: 10% of its total, >= 1 GiB).
        self.pool_memory_floor: int | None = None
        self.capacity = capacity or Capacity()
        self.egress = egress
        # Where a `RemoteEgress` backend's refusals are found (the service: the shared audit trail).
        self.remote_denials: DenialSource | None = None
        self._state_dir = self.home / STATE_DIR
        self._creating: dict[str, int] = {}  # sandbox id -> memory limit, while the backend creates it
        self._sandboxes: dict[str, _Sandbox] = {}
        self._tombstones: dict[str, str] = {}
        self._pooled: dict[str, _Sandbox] = {}  # ready pool members, by id
        self._claimed: dict[str, _Sandbox] = {}  # taken from a pool by `claim`, not yet `adopt`ed or `release`d
        self._pool_starting: set[str] = set()  # pool members being created (not a caller's create)
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._pool_wake = asyncio.Event()
        self._last_demand = 0.0  # monotonic time of the last create or claim: pools fill in the quiet after it
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._lock_fd: int | None = None

    # -- lifecycle of the engine itself ---------------------------------------------------------------

    async def start(self, *, expire: bool = True) -> None:
        """Take the state directory, reattach what still runs, start the pool.

        `expire`: destroy sandboxes past their timeout here. The control plane passes False: its reconciler
        expires sandboxes from the store's records, which are the one truth of what tenants asked for.
        """
        if self._started:
            return
        self._state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_ownership()
        self._started = True
        await self._recover()
        if expire:
            self._tasks.append(asyncio.create_task(self._reaper(), name="corral-reaper"))
        if self._pools:
            self._tasks.append(asyncio.create_task(self._pool_filler(), name="corral-pool"))

    async def close(self, *, destroy_all: bool = False) -> None:
        """Stop background work. Sandboxes keep running (a new engine reattaches) unless `destroy_all`."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        # Members being started finish (a create cancelled half-way undoes itself in a shielded task that this
        # close would not wait for), then every member goes with the rest.
        await asyncio.gather(*self._pool_tasks, return_exceptions=True)
        pool = [*self._pooled.values(), *self._claimed.values()]
        self._pooled.clear()
        self._claimed.clear()
        for state in self._pools.values():
            state.members.clear()
        victims = pool + (list(self._sandboxes.values()) if destroy_all else [])
        await asyncio.gather(*(self._destroy(sb, reason="engine closed") for sb in victims),
                             return_exceptions=True)
        await self.backend.close()
        self._started = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _take_ownership(self) -> None:
        """One engine per state directory: a second one would sweep the first one's sandboxes."""
        fd = os.open(self.home / "engine.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise ConflictError(f"another Corral engine (a running `corral serve`?) owns {self.home}; "
                                "stop it or use its API") from exc
        self._lock_fd = fd

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sandboxes ---------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec | None = None, *, sandbox_id: str | None = None,
                     source: SnapshotArtifact | None = None) -> SandboxHandle:
        """Create a sandbox and wait until its agent answers. Fails closed; a failure leaves nothing.

        `sandbox_id` lets the caller (the control plane, which records the sandbox first) choose the id. With
        `source` (a snapshot's artifact, from `snapshot`), it starts with the snapshot's files, on the template
        the snapshot was taken on.
        """
        spec = spec or SandboxSpec()
        if sandbox_id is not None:
            _check_sandbox_id(sandbox_id)
            self._check_unused(sandbox_id)
        # NotFoundError names the available ones; a snapshot's template is the exact build it was taken on.
        template = self.templates.get(source.template if source is not None else spec.template)
        claimed = None if sandbox_id is not None or source is not None else self.claim(spec)
        if claimed is not None:
            try:
                return await self.adopt(claimed, spec)
            except BaseException:
                if self.is_claimed(claimed):
                    self.release(claimed)
                raise
        self._last_demand = time.monotonic()
        sb = await self._create(spec, template, sandbox_id=sandbox_id, source=source)
        self._sandboxes[sb.id] = sb
        logger.info("sandbox.created", extra={"sandbox": sb.id, "template": spec.template,
                                              "runtime": spec.runtime.value, "pooled": False})
        return SandboxHandle(self, sb.id)

    # -- warm pools (docs/performance.md, "Warm pools") ----------------------------------------------------

    def claim(self, spec: SandboxSpec) -> str | None:
        """Take a ready pool member that can serve `spec` aside, and return its id (None: no pool for `spec`, or
        it is empty). No await: a burst's concurrent claims never get the same member. The caller then `adopt`s
        it (with the id it was told, e.g. after recording it) or `release`s it; until then nobody sees it."""
        self._last_demand = time.monotonic()
        if not self._pools or spec.volumes:  # no pool: no key to build on every create
            return None
        state = self._pools.get(self._pool_key(spec))
        if state is None:
            return None
        self._pool_wake.set()
        if not state.members:
            state.stats.missed += 1
            return None
        sandbox_id = state.members.pop()  # the newest: its pages are the likeliest still in memory
        self._claimed[sandbox_id] = self._pooled.pop(sandbox_id)
        state.stats.claimed += 1
        return sandbox_id

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Make a claimed member the sandbox `spec` asks for: its env, network policy, secrets' trust files,
        metadata and timeout, applied now. A member whose agent no longer answers is replaced by a sandbox
        created cold under the same id, so a claim never hands out a dead sandbox."""
        sb = self._claimed.pop(sandbox_id)
        try:
            usable = await self._answers(sb) and await self._resized(sb, spec)
        except BaseException:  # cancelled: still the caller's to release
            self._claimed[sandbox_id] = sb
            raise
        if not usable:
            await self._destroy(sb, reason="pool member unusable")
            self._tombstones.pop(sandbox_id, None)
            sb = await self._create(spec, self.templates.get(spec.template), sandbox_id=sandbox_id)
        else:
            now = time.time()
            sb.spec, sb.pooled = spec, False
            sb.created_at, sb.expires_at = now, now + spec.timeout
            if self.egress is not None:
                self.egress.set_policy(sb.id, self._policy(spec))
                self._write_trust(sb.record, spec)
            self._save(sb)  # its spec and times, and no longer a pool member
        self._sandboxes[sb.id] = sb
        logger.info("sandbox.created", extra={"sandbox": sb.id, "template": spec.template,
                                              "runtime": spec.runtime.value, "pooled": True})
        return SandboxHandle(self, sb.id)

    @staticmethod
    async def _answers(sb: _Sandbox) -> bool:
        try:
            async with asyncio.timeout(_CLAIM_PING_TIMEOUT):
                await sb.agent.ping()
        except (AgentError, TimeoutError):
            logger.warning("pool.member_dead", extra={"sandbox": sb.id})
            return False
        return True

    def _pool_key(self, spec: SandboxSpec) -> tuple[object, ...]:
        """Which pool can serve `spec`: its `pool_key`, without the limits a `Resizable` backend sets at claim."""
        if self._resizable is None:
            return spec.pool_key()
        fixed = spec.limits.model_dump(exclude=set(RESIZABLE_LIMITS))
        return (spec.template, spec.runtime.value, tuple(sorted(fixed.items())), bool(spec.volumes), spec.root)

    def _differs_in_resizable(self, mine: Limits, wanted: Limits) -> bool:
        return any(getattr(mine, name) != getattr(wanted, name) for name in RESIZABLE_LIMITS)

    async def _resized(self, sb: _Sandbox, spec: SandboxSpec) -> bool:
        """Give a claimed member `spec`'s memory, CPU and pids limits (if they differ); False if the backend
        refused, or more memory than the member had does not fit the machine: the claim then starts a sandbox cold,
        which, as every create, takes the room of ready members first (and raises `CapacityError` without)."""
        if self._resizable is None or not self._differs_in_resizable(sb.spec.limits, spec.limits):
            return True
        if spec.limits.memory > sb.spec.limits.memory:
            # `adopt` took the member out of `_claimed`: `usage` has it no more, so it is checked whole, as a create.
            try:
                self.capacity.check(self.usage(), spec.limits.memory, await self.backend.capacity(),
                                    retry_after=self._retry_after())
            except CapacityError:
                return False  # started cold instead, in this member's room and other members' if need be
        try:
            await self._resizable.resize(sb.record, spec.limits)
        except CorralError:
            logger.exception("pool.resize_failed", extra={"sandbox": sb.id})
            return False
        return True

    def is_claimed(self, sandbox_id: str) -> bool:
        """Claimed and neither adopted nor released yet."""
        return sandbox_id in self._claimed

    def release(self, sandbox_id: str, *, reuse: bool = True) -> None:
        """Give a claimed member back unused (the caller's create failed before `adopt`): nothing ran in it. With
        `reuse=False` (its id was shown to someone, e.g. in a refused create's audit record) it is destroyed."""
        sb = self._claimed.pop(sandbox_id)
        state = self._pools.get(self._pool_key(sb.spec))
        if not reuse or state is None or len(state.members) >= state.pool.size:
            self._evict(sb, state)
            return
        state.members.append(sandbox_id)
        self._pooled[sandbox_id] = sb

    def pool_stats(self) -> dict[str, PoolStats]:
        """Each pool's figures, by its description (`default=50:10`)."""
        out = {}
        for state in self._pools.values():
            state.stats.ready, state.stats.starting = len(state.members), state.starting
            out[state.pool.describe()] = replace(state.stats)
        return out

    @property
    def pools(self) -> builtins.list[WarmPool]:
        return [state.pool for state in self._pools.values()]

    async def _create(self, spec: SandboxSpec, template: Template, *, pooled: bool = False,
                      sandbox_id: str | None = None, source: SnapshotArtifact | None = None) -> _Sandbox:
        sandbox_id = sandbox_id or f"sb-{secrets.token_hex(8)}"
        await self.backend.check(spec)
        figures = await self.backend.capacity()
        # Checked and counted with no await in between, so concurrent creates cannot all squeeze past the check
        # (nor two of them take the same id).
        self._check_unused(sandbox_id)
        self._check_capacity(spec, figures, pooled=pooled)
        self._creating[sandbox_id] = spec.limits.memory
        try:
            record = await self.backend.create(sandbox_id, spec, template, source)
            try:
                agent = self._agent_client(sandbox_id, self.backend.agent_address(record))
                await self._wait_ready(sandbox_id, record, agent)
                await self._attach_egress(sandbox_id, record, spec)
                now = time.time()
                sb = _Sandbox(id=sandbox_id, spec=spec, record=record, agent=agent, created_at=now,
                              expires_at=now + spec.timeout, template_env=dict(template.env), pooled=pooled)
                self._save(sb)
            except BaseException:
                await asyncio.shield(self._discard(sandbox_id, record))
                raise
        finally:
            self._creating.pop(sandbox_id, None)
        return sb

    def _check_capacity(self, spec: SandboxSpec, figures: BackendCapacity, *, pooled: bool) -> None:
        """`Capacity.check`; a caller's create that does not fit takes the room of ready pool members first."""
        while True:
            try:
                self.capacity.check(self.usage(), spec.limits.memory, figures, retry_after=self._retry_after())
                return
            except CapacityError:
                if pooled or not self._evict_one():
                    raise

    def _check_unused(self, sandbox_id: str) -> None:
        if sandbox_id in self._sandboxes or sandbox_id in self._creating or self._state_path(sandbox_id).exists():
            raise ConflictError(f"sandbox {sandbox_id} already exists")

    async def _wait_ready(self, sandbox_id: str, record: BackendRecord, agent: AgentClient) -> None:
        """Ping the new sandbox's agent until it answers, the backend's `ready_timeout` passes, or the backend
        says the sandbox stopped (an agent that died at start never answers: do not wait out the timeout)."""
        timeout = self.backend.ready_timeout(record)
        start = time.monotonic()
        deadline, next_alive = start + timeout, start + _ALIVE_POLL
        while True:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await agent.ping()
                return
            except (AgentError, TimeoutError) as exc:
                now = time.monotonic()
                stopped = False
                if now >= next_alive:
                    stopped, next_alive = not await self.backend.alive(record), now + _ALIVE_POLL
                if stopped or now >= deadline:
                    what = "it stopped" if stopped else f"its agent did not answer within {timeout:g}s"
                    diagnostics = await self._diagnostics(record)
                    raise AgentError(f"sandbox {sandbox_id} started but {what}: {diagnostics}",
                                      details={"sandbox_id": sandbox_id}) from exc
            await asyncio.sleep(_READY_POLL)

    async def _diagnostics(self, record: BackendRecord) -> str:
        try:
            return await self.backend.diagnostics(record)
        except Exception as exc:  # the error being raised matters more than why its details are missing
            return f"(no diagnostics: {exc})"

    async def _discard(self, sandbox_id: str, record: BackendRecord) -> None:
        """Undo a create that failed after the backend made the sandbox: nothing of it may be left."""
        try:
            if self.egress is not None:
                await self.egress.detach(sandbox_id)
            await self.backend.destroy(record)
            self._state_path(sandbox_id).unlink(missing_ok=True)
        except Exception:
            # The create's own error is what the caller needs; this one goes to the log (and `sweep` at the
            # next start takes what is left).
            logger.exception("sandbox.discard_failed", extra={"sandbox": sandbox_id})

    def usage(self) -> MachineUsage:
        """Sandboxes and memory limits promised on this machine: running, pooled and being created."""
        held = [*(sb for sb in self._sandboxes.values() if not sb.paused_to_disk), *self._pooled.values(),
                *self._claimed.values()]
        return MachineUsage(sandboxes=len(held) + len(self._creating),
                            memory=sum(sb.spec.limits.memory for sb in held) + sum(self._creating.values()))

    def _retry_after(self) -> int:
        """Seconds until the first sandbox reaches its timeout: the earliest a slot frees up by itself."""
        if not self._sandboxes:
            return 10
        soonest = min(sb.expires_at for sb in self._sandboxes.values()) - time.time()
        return max(1, min(300, int(soonest) + 1))

    def get(self, sandbox_id: str) -> SandboxHandle:
        self._lookup(sandbox_id)
        return SandboxHandle(self, sandbox_id)

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self._lookup(sandbox_id).info()

    def list(self) -> list[SandboxInfo]:
        return [sb.info() for sb in sorted(self._sandboxes.values(), key=lambda s: s.created_at)]

    async def destroy(self, sandbox_id: str) -> None:
        sb = self._lookup(sandbox_id)
        async with sb.lock:
            await self._destroy(sb, reason="destroyed")

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        """Pause: with `memory`, every process frozen in place; without, paused to disk (docs/lifecycle.md):
        processes ended, memory and cgroup released, the filesystem (and /tmp, saved beside it) kept."""
        sb = self._lookup(sandbox_id)
        async with sb.lock:
            await self._pause(sb, memory=memory)

    async def _pause(self, sb: _Sandbox, *, memory: bool) -> None:
        sandbox_id = sb.id
        if sb.paused_to_disk:
            raise ConflictError(f"sandbox {sandbox_id} is paused to disk already")
        if memory:
            if sb.state == SandboxState.PAUSED:
                raise ConflictError(f"sandbox {sandbox_id} is paused already")
            # Calls in flight (a long command, a terminal) wait through the pause: not a wedged agent's silence.
            sb.agent.freeze()
            try:
                await self.backend.pause(sb.record)
            except BaseException:
                sb.agent.thaw()
                raise
            sb.state = SandboxState.PAUSED
            self._save(sb)
            return
        await self._pause_to_disk(sb)

    async def _pause_to_disk(self, sb: _Sandbox) -> None:
        if sb.state == SandboxState.PAUSED:  # frozen: thaw it so its agent can save /tmp, then stop it
            await self.backend.resume(sb.record)
            sb.agent.thaw()
            sb.state = SandboxState.RUNNING
        await self._save_tmp(sb)
        if self.egress is not None:
            await self.egress.detach(sb.id)
        await self.backend.stop(sb.record)
        sb.state, sb.paused_to_disk = SandboxState.PAUSED, True
        sb.ttl_left = max(1.0, sb.expires_at - time.time())
        self._save(sb)
        logger.info("sandbox.paused_to_disk", extra={"sandbox": sb.id, "ttl_left": round(sb.ttl_left)})

    async def resume(self, sandbox_id: str) -> None:
        sb = self._lookup(sandbox_id)
        async with sb.lock:
            await self._resume(sb)

    async def _resume(self, sb: _Sandbox) -> None:
        sandbox_id = sb.id
        if sb.state != SandboxState.PAUSED:
            raise ConflictError(f"sandbox {sandbox_id} is not paused")
        if sb.paused_to_disk:
            await self._boot(sb)
            return
        await self.backend.resume(sb.record)
        sb.agent.thaw()
        sb.state = SandboxState.RUNNING
        self._save(sb)

    async def _boot(self, sb: _Sandbox) -> None:
        """Start a sandbox paused to disk again: capacity first (it takes memory again), then the backend, the
        agent, egress, its /tmp; the timeout runs again from what it had left."""
        figures = await self.backend.capacity()
        self.capacity.check(self.usage(), sb.spec.limits.memory, figures, retry_after=self._retry_after())
        self._creating[sb.id] = sb.spec.limits.memory
        try:
            record = await self.backend.boot(sb.record, sb.spec)
            try:
                agent = self._agent_client(sb.id, self.backend.agent_address(record))
                await self._wait_ready(sb.id, record, agent)
                await self._attach_egress(sb.id, record, sb.spec)
                await self._restore_tmp(sb, agent)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.backend.stop(record))
                raise
        finally:
            self._creating.pop(sb.id, None)
        sb.record, sb.agent = record, agent
        sb.state, sb.paused_to_disk = SandboxState.RUNNING, False
        sb.expires_at = time.time() + sb.ttl_left
        self._save(sb)
        self._tmp_path(sb.id).unlink(missing_ok=True)
        logger.info("sandbox.resumed_from_disk", extra={"sandbox": sb.id})

    def _tmp_path(self, sandbox_id: str) -> Path:
        return self._state_dir / f"{sandbox_id}.tmp.tar"

    async def _save_tmp(self, sb: _Sandbox) -> None:
        """/tmp is a tmpfs (memory): its files go to a tar beside the engine's state, through the agent (which
        reads them as the sandbox's user would: nothing there is beyond its reach; in a sandbox with root, as root,
        whose files there may be its own)."""
        path = self._tmp_path(sb.id)
        partial = path.with_suffix(".partial")
        try:
            with open(partial, "wb") as f:
                async for chunk in _tmp_agent(sb, sb.agent).download_tar("/tmp", contents=True):
                    f.write(chunk)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    async def _restore_tmp(self, sb: _Sandbox, agent: AgentClient) -> None:
        path = self._tmp_path(sb.id)
        if not path.exists():
            return
        with open(path, "rb") as f:
            await _tmp_agent(sb, agent).upload_tar("/tmp", f, owners=sb.spec.root)

    async def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> SnapshotArtifact:
        """Keep the sandbox's filesystem as it is now (its processes frozen for the copy; /tmp and /dev/shm,
        which are memory, are not in it) as an artifact that `create(source=...)` starts sandboxes from."""
        sb = self._lookup(sandbox_id)
        snapshot_id = snapshot_id or f"snap-{secrets.token_hex(8)}"
        async with sb.lock:
            artifact = await self.backend.snapshot(sb.record, snapshot_id)
        logger.info("sandbox.snapshot", extra={"sandbox": sb.id, "snapshot": snapshot_id,
                                               "bytes": artifact.size_bytes})
        return artifact

    async def delete_snapshot(self, artifact: SnapshotArtifact) -> None:
        """Remove a snapshot; sandboxes started from it keep what they use."""
        await self.backend.delete_snapshot(artifact)

    async def fork(self, sandbox_id: str, *, child_id: str | None = None,
                   spec: SandboxSpec | None = None) -> SandboxHandle:
        """A new running sandbox with the parent's files at this instant (`spec`: the parent's, by default),
        independent from then on: a snapshot that lives only as long as the child's create."""
        return (await self.fork_many(sandbox_id, [child_id or f"sb-{secrets.token_hex(8)}"], spec=spec))[0]

    async def fork_many(self, sandbox_id: str, child_ids: builtins.list[str], *,
                        spec: SandboxSpec | None = None) -> builtins.list[SandboxHandle]:
        """`len(child_ids)` forks of one instant: the parent is frozen and copied once, the children start
        together. All or nothing: if one cannot start, those that did are destroyed and its error is raised."""
        parent = self._lookup(sandbox_id)
        artifact = await self.snapshot(sandbox_id)
        try:
            made = await asyncio.gather(*(self.create(spec or parent.spec, sandbox_id=child, source=artifact)
                                          for child in child_ids), return_exceptions=True)
        finally:
            await asyncio.shield(self.delete_snapshot(artifact))
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            started = [m for m in made if isinstance(m, SandboxHandle)]
            await asyncio.shield(asyncio.gather(*(h.destroy() for h in started), return_exceptions=True))
            raise failed[0]
        return [m for m in made if isinstance(m, SandboxHandle)]

    def set_timeout(self, sandbox_id: str, seconds: float) -> SandboxInfo:
        """Make the sandbox expire `seconds` from now (paused to disk: `seconds` after it resumes)."""
        if not 0 <= seconds <= 7 * 24 * 3600:
            raise InvalidRequestError("timeout must be between 0 (end now) and 604800 seconds")
        sb = self._lookup(sandbox_id)
        if sb.paused_to_disk:
            sb.ttl_left = seconds
        else:
            sb.expires_at = time.time() + seconds
        self._save(sb)
        return sb.info()

    # -- inside a sandbox -------------------------------------------------------------------------

    async def exec(self, sandbox_id: str, cmd: str | builtins.list[str], *, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: Source | None = None, timeout: float | None = None,
                   max_output: int | None = None, on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None, on_start: StartCallback | None = None,
                   detached: bool = False, tag: str | None = None, pty: PtySize | None = None,
                   keep_stdin: bool = False, user: str | None = None) -> ExecResult:
        """Run a shell string (`bash -lc`) or an argv list. Never raises for exit codes, timeouts or OOM.

        `env` is the command's own, over the sandbox's (and never seen by a later command); `on_start(id, pid)`
        comes before any output; `tag` names the process while it runs (unique: `ConflictError`). `user`: who
        runs it, None the sandbox user, "root" only in a sandbox created with root (`PermissionDeniedError`).
        `detached`: the command is a background process that this call follows: cancelling the call only stops
        following, and the process goes on, listed and addressable by id, pid or tag (E2B runs every command
        so). Only a detached command may run in a terminal (`pty`: its output is stdout) or `keep_stdin` open
        for `processes.send_stdin`."""
        if not detached and (pty is not None or keep_stdin):
            raise InvalidRequestError("pty and keep_stdin need a detached command (a terminal bound to its caller "
                                      "is SandboxHandle.pty)")
        sb = self._running(sandbox_id)
        agent = sb.agent.as_user(check_user(user))
        before = await self.backend.oom_kills(sb.record)
        started = time.time()
        if detached:
            result = await agent.exec_detached(
                cmd, cwd=cwd, env=self._env(sb, None), cmd_env=env or None, stdin=stdin, keep_stdin=keep_stdin,
                timeout=timeout, max_output=max_output, tag=tag, pty=pty, on_start=on_start, on_stdout=on_stdout,
                on_stderr=on_stderr)
        else:
            result = await agent.exec(cmd, cwd=cwd, env=self._env(sb, None), cmd_env=env or None, stdin=stdin,
                                         timeout=timeout, max_output=max_output, on_stdout=on_stdout,
                                         on_stderr=on_stderr, on_start=on_start, tag=tag)
        return await self._with_denials(sb, await self._with_oom(sb, result, before), started)

    async def run_code(self, sandbox_id: str, code: str, *, language: str = "python",
                       session: str | None = None, context: str | None = None, timeout: float | None = None,
                       stdin: bytes | None = None, env: Mapping[str, str] | None = None, cwd: str | None = None,
                       show_saved_images: bool = False, on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None, on_result: ResultCallback | None = None,
                       max_output: int | None = None) -> CodeResult:
        """Run a cell in a stateful session (docs/code.md). Never raises for the cell's errors, timeouts or OOM.

        `session` None: the language's own default context (`default_context(language)`: "default" for python,
        the language's name for the others, as in E2B), so cells of two languages never meet in one. `context`:
        run in that context (made by `create_code_context`, listed by `code_contexts`, or a language's default),
        in its own language (`language` is ignored); java and typescript run there as sessions, not as compiled
        programs. `env`: environment variables for this cell only, on top of the sandbox's. `cwd` and
        `show_saved_images` apply if this call makes the context (`cwd` None: /workspace). Of each stream the
        result keeps `max_output` bytes (None: 16 MiB), its first three quarters and last quarter (`truncated`);
        `on_stdout`/`on_stderr` get every byte."""
        sb = self._running(sandbox_id)
        before = await self.backend.oom_kills(sb.record)
        result = await sb.agent.run_code(code, language=None if context is not None else language,
                                         session=session, context=context,
                                         timeout=timeout, stdin=stdin, env=self._env(sb, None), cell_env=env,
                                         cwd=cwd, show_saved_images=show_saved_images, on_stdout=on_stdout,
                                         on_stderr=on_stderr, on_result=on_result, max_output=max_output)
        return await self._code_with_oom(sb, result, before)

    async def create_code_context(self, sandbox_id: str, language: str = "python", *, cwd: str | None = None,
                                  name: str | None = None, show_saved_images: bool = False) -> CodeSession:
        """A new code context (its session starts with its first cell): its id is `name`, else a new UUID. `cwd`
        must be a directory (None: /workspace); that the sandbox user may enter it shows when a cell runs."""
        sb = self._running(sandbox_id)
        return await sb.agent.create_code_context(language, cwd=cwd, name=name, env=self._env(sb, None),
                                                  show_saved_images=show_saved_images)

    async def code_contexts(self, sandbox_id: str, *, cwd: str | None = None,
                            show_saved_images: bool = False) -> builtins.list[CodeSession]:
        """Every code context of the sandbox, the default python and javascript ones first (made here, with `cwd`
        and `show_saved_images`, if they do not exist yet), then the others in the order they were made."""
        sb = self._running(sandbox_id)
        return await sb.agent.code_contexts(cwd=cwd, env=self._env(sb, None), show_saved_images=show_saved_images)

    async def _code_with_oom(self, sb: _Sandbox, result: CodeResult, before: int) -> CodeResult:
        # As for exec: the session's process died of a SIGKILL we did not send while the OOM counter moved.
        if result.signal == 9 and not result.killed and await self.backend.oom_kills(sb.record) > before:
            error = CodeError("MemoryError", "the session ran out of memory and was killed (the sandbox's memory "
                              "limit); its state is lost, and the next call starts a fresh session", "")
            return replace(result, oom_killed=True, error=error)
        return result

    async def code_sessions(self, sandbox_id: str) -> builtins.list[CodeSession]:
        return await self._running(sandbox_id).agent.code_sessions()

    async def interrupt_code(self, sandbox_id: str, session: str = "default") -> None:
        await self._running(sandbox_id).agent.interrupt_code(session)

    async def restart_code(self, sandbox_id: str, session: str = "default") -> None:
        sb = self._running(sandbox_id)
        await sb.agent.restart_code(session, env=self._env(sb, None))

    async def close_code(self, sandbox_id: str, session: str = "default") -> None:
        await self._running(sandbox_id).agent.close_code(session)

    async def _with_denials(self, sb: _Sandbox, result: ExecResult, since: float) -> ExecResult:
        if self._remote_egress is not None:  # refused by a proxy of another process: it recorded them first
            denials = await self._remote_denials(sb.id, since)
        elif self.egress is not None:
            denials = self.egress.denials(sb.id, since)
        else:
            return result
        return replace(result, egress_denials=tuple(denials)) if denials else result

    async def _remote_denials(self, sandbox_id: str, since: float) -> Sequence[EgressEvent]:
        if self.remote_denials is None:
            return ()
        try:
            return await self.remote_denials(sandbox_id, since)
        except CorralError as exc:  # the command ran; only the notice of its refusals is lost
            logger.warning("egress refusals of sandbox %s unavailable: %s", sandbox_id, exc.message)
            return ()

    def set_network(self, sandbox_id: str, network: str | builtins.list[str],
                    private: builtins.list[str] | None = None) -> SandboxSpec:
        """Change a live sandbox's egress policy; new connections follow it (open ones keep going)."""
        sb = self._lookup(sandbox_id)
        update: dict[str, Any] = {"network": network if isinstance(network, str) else tuple(network)}
        if private is not None:
            update["network_private"] = tuple(private)
        spec = SandboxSpec.model_validate({**sb.spec.model_dump(), **update})
        sb.spec = spec
        self._save(sb)
        if self.egress is not None:
            self.egress.set_policy(sb.id, self._policy(spec))
        return spec

    # -- volumes (docs/volumes.md): the backend's; sandboxes mount them by id through `SandboxSpec.volumes` --------

    async def create_volume(self, volume_id: str, size: int) -> None:
        """An empty volume of `size` bytes, a hard limit."""
        await self.backend.create_volume(volume_id, size)

    async def delete_volume(self, volume_id: str) -> None:
        """Remove a volume no sandbox mounts (`ConflictError` naming them otherwise). Idempotent."""
        await self.backend.delete_volume(volume_id)

    async def volume_used(self, volume_id: str) -> int:
        """Bytes the volume's files take now."""
        return await self.backend.volume_used(volume_id)

    async def _attach_egress(self, sandbox_id: str, record: BackendRecord, spec: SandboxSpec) -> None:
        # A backend whose sandboxes reach a proxy of their own platform (`RemoteEgress`) has no socket here.
        if self.egress is not None and self._remote_egress is None:
            endpoint = self.backend.egress_endpoint(record)
            await self.egress.attach(sandbox_id, Path(endpoint.path), self._policy(spec))
            self._write_trust(record, spec)

    # -- secrets (docs/secrets.md): values only in the proxy's policy, placeholders and the CA in the sandbox ----

    @property
    def keyring(self) -> SecretKeyring:
        """What seals and opens secret values (`CORRAL_SECRETS_KEY`, else `<home>/secrets.key`)."""
        if self._keyring is None:
            from ..egress._keyring import SecretKeyring  # `cryptography` loads only where secrets are used

            self._keyring = SecretKeyring.from_environment(self.home)
        return self._keyring

    def _policy(self, spec: SandboxSpec) -> EgressPolicy:
        return spec.egress_policy(self.keyring if spec.secrets else None)

    def check_secrets(self, spec: SandboxSpec) -> None:
        if spec.secrets:
            self.check_secrets_supported()

    def check_secrets_supported(self) -> None:
        """Refuse secrets where no proxy of ours could put them in (the Kubernetes backend's, for now)."""
        if self.egress is None or self.egress.ca is None or self._remote_egress is not None:
            raise InvalidRequestError(f"secrets need the egress proxy of the local or docker backend, with its CA; "
                                      f"the {self.backend.name} backend here has none (docs/secrets.md)")

    def _write_trust(self, record: BackendRecord, spec: SandboxSpec) -> None:
        """The deployment's CA where the sandbox reads it (`/.corral/egress`, beside the proxy's socket): alone,
        and after the host's trust store. Rewritten at every attach, so a rotated CA reaches live sandboxes."""
        ca = self.egress.ca if self.egress is not None else None
        if not spec.secrets or ca is None or self._remote_egress is not None:
            return
        directory = Path(self.backend.egress_endpoint(record).path).parent
        write_atomic(directory / TRUST_CA, ca.pem, mode=0o644, durable=False)
        write_atomic(directory / TRUST_BUNDLE, _host_bundle() + b"\n" + ca.pem, mode=0o644, durable=False)

    async def _with_oom(self, sb: _Sandbox, result: ExecResult, before: int) -> ExecResult:
        # A SIGKILL we did not send, with the OOM counter moved meanwhile, is the OOM killer.
        if result.signal == 9 and not (result.timed_out or result.killed):
            if await self.backend.oom_kills(sb.record) > before:
                return replace(result, oom_killed=True)
        return result

    async def open_port(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to `port` inside a running sandbox, through its agent (the sandbox's network stays
        loopback-only): a connected, non-blocking socket, from now on a raw byte pipe to that port; the caller
        closes it. Nothing listening there is `AgentError` naming the port; a paused sandbox `ConflictError`."""
        return await self._running(sandbox_id).agent.open_port(port)

    async def alive(self, sandbox_id: str, *, wait: float = 5.0) -> bool:
        """Whether this engine runs the sandbox and its agent answers a ping within `wait` seconds."""
        try:
            sb = self._running(sandbox_id)
            async with asyncio.timeout(wait):
                await self.agent(sb.id).ping()
        except (CorralError, TimeoutError):
            return False
        return True

    def agent(self, sandbox_id: str) -> AgentClient:
        return self._running(sandbox_id).agent

    def spec(self, sandbox_id: str) -> SandboxSpec:
        """What the sandbox was created with."""
        return self._lookup(sandbox_id).spec

    def sandbox_env(self, sandbox_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return self._env(self._lookup(sandbox_id), extra)

    # -- usage (the service's metrics sampler reads it every few seconds per sandbox) --------------------------

    def states(self) -> dict[str, SandboxState]:
        """Every sandbox this engine holds (the warm pool aside) and its state: one cheap call for a poller."""
        return {sandbox_id: sb.state for sandbox_id, sb in self._sandboxes.items()}

    async def sandbox_usage(self, sandbox_id: str) -> SandboxUsage | None:
        """What the sandbox uses now (`Backend.usage`): CPU time, memory, disk, limits. None when nothing of it
        runs to measure (paused to disk; stopping). Not under the sandbox's lock: a reading never waits for a
        snapshot's copy."""
        sb = self._lookup(sandbox_id)
        if sb.paused_to_disk:  # never ask a stopped sandbox anything
            return None
        return await self.backend.usage(sb.record)

    # -- internals ---------------------------------------------------------------------------------

    def _env(self, sb: _Sandbox, extra: dict[str, str] | None) -> dict[str, str]:
        packages = _grants_packages(sb.spec.network, sb.spec.network_private)
        if self._remote_egress is not None:
            proxy, mirror = dict(self._remote_egress.egress_env(sb.record, packages=packages)), {}
        else:
            proxy, mirror = EGRESS_ENV, MIRROR_ENV if packages else {}
        env = {**proxy, **mirror, **sb.template_env, **sb.spec.env}
        if sb.spec.secrets:
            env.update(TRUST_ENV)
            env.update({s.name: s.placeholder for s in sb.spec.secrets})
        if extra:
            env.update(extra)
        return env

    def _agent_client(self, sandbox_id: str, address: AgentAddress) -> AgentClient:
        return AgentClient(address.endpoint, address.token, label=f"sandbox {sandbox_id}", liveness=self.liveness,
                           sandbox_id=sandbox_id)

    def _lookup(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None:
            return sb
        reason = self._tombstones.get(sandbox_id)
        if reason == "timeout":
            raise SandboxTimeoutError(f"sandbox {sandbox_id} reached its timeout and was destroyed; "
                                      "create a new one, or extend the timeout with set_timeout next time")
        raise NotFoundError(f"no sandbox {sandbox_id!r}" + (f" (it was {reason})" if reason else ""))

    def _running(self, sandbox_id: str) -> _Sandbox:
        sb = self._lookup(sandbox_id)
        if sb.state == SandboxState.PAUSED:
            how = "paused to disk" if sb.paused_to_disk else "paused"
            raise ConflictError(f"sandbox {sandbox_id} is {how}; resume it first (or connect, which resumes it)")
        return sb

    async def _destroy(self, sb: _Sandbox, *, reason: str) -> None:
        self._sandboxes.pop(sb.id, None)
        self._tombstones[sb.id] = "timeout" if reason == "timeout" else "destroyed"
        while len(self._tombstones) > TOMBSTONES_KEPT:
            self._tombstones.pop(next(iter(self._tombstones)))
        sb.state = SandboxState.STOPPED
        self._save(sb)  # should `destroy` fail, the next start sweeps it rather than reattaching it
        if self.egress is not None:
            await self.egress.detach(sb.id)
        await self.backend.destroy(sb.record)
        self._state_path(sb.id).unlink(missing_ok=True)
        self._tmp_path(sb.id).unlink(missing_ok=True)
        logger.info("sandbox.destroyed", extra={"sandbox": sb.id, "reason": reason})

    def _state_path(self, sandbox_id: str) -> Path:
        return self._state_dir / f"{sandbox_id}.json"

    def _save(self, sb: _Sandbox) -> None:
        # Inline: one small file. Not durable (no fsync): a machine crash takes the sandbox's processes with it,
        # so the file need only never be torn (a lost or stale one means the sandbox is swept at the next start).
        write_json_atomic(self._state_path(sb.id), sb.to_json(self.backend.name), durable=False)

    async def _recover(self) -> None:
        """Reattach to running sandboxes; have the backend sweep the half-created, the dead, the expired and
        old pool ones; forget their state files."""
        known: set[str] = set()
        stale: builtins.list[Path] = []
        for path in sorted(self._state_dir.glob("*.json")):  # inline: a few small files, once at start
            data = _read_state(path)
            if data is not None and data.get("backend") != self.backend.name:
                # Another backend's sandbox (this home served with another `--backend` before): not ours to
                # sweep nor to forget.
                logger.warning("sandbox.other_backend", extra={"sandbox": path.stem, "backend": data.get("backend")})
                continue
            sb = None if data is None else self._load(data)
            if sb is not None and sb.paused_to_disk:  # asleep: nothing runs to check, and no clock runs out
                await self.backend.adopt(sb.record)
                self._sandboxes[sb.id] = sb
                known.add(sb.id)
                logger.info("sandbox.kept_paused", extra={"sandbox": sb.id})
                continue
            if sb is None or sb.pooled or sb.state == SandboxState.STOPPED or sb.expires_at <= time.time() \
                    or not await self.backend.alive(sb.record):
                stale.append(path)
                continue
            await self.backend.adopt(sb.record)
            self._sandboxes[sb.id] = sb
            await self._attach_egress(sb.id, sb.record, sb.spec)
            known.add(sb.id)
            logger.info("sandbox.reattached", extra={"sandbox": sb.id})
        for sid in await self.backend.sweep(known):
            logger.info("sandbox.swept", extra={"sandbox": sid})
        saved = [p for p in self._state_dir.glob("*.tmp.tar") if p.name.removesuffix(".tmp.tar") not in known]
        for path in [*stale, *saved, *self._state_dir.glob(".*.tmp-*"), *self._state_dir.glob("*.partial")]:
            path.unlink(missing_ok=True)

    def _load(self, data: dict[str, Any]) -> _Sandbox | None:
        try:
            sandbox_id = str(data["id"])
            _check_sandbox_id(sandbox_id)
            record = self.backend.restore(data["record"])
            if record.sandbox_id != sandbox_id:
                return None
            return _Sandbox(id=sandbox_id, spec=SandboxSpec.model_validate(data["spec"]), record=record,
                            agent=self._agent_client(sandbox_id, self.backend.agent_address(record)),
                            created_at=float(data["created_at"]), expires_at=float(data["expires_at"]),
                            state=SandboxState(data["state"]), template_env=dict(data.get("template_env", {})),
                            pooled=bool(data.get("pooled")), paused_to_disk=bool(data.get("paused_to_disk")),
                            ttl_left=float(data.get("ttl_left", 0.0)))
        except (ValueError, KeyError, TypeError, CorralError):
            return None

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.time()
            for sb in [s for s in self._sandboxes.values() if s.expires_at <= now and not s.paused_to_disk]:
                try:
                    async with sb.lock:
                        if sb.id not in self._sandboxes or sb.paused_to_disk:
                            continue  # destroyed or paused meanwhile
                        if sb.spec.on_timeout == "pause":
                            await self._pause_to_disk(sb)
                            continue
                        await self._destroy(sb, reason="timeout")
                except CorralError:
                    logger.exception("sandbox.reap_failed", extra={"sandbox": sb.id})

    async def _pool_filler(self) -> None:
        """Keep the pools full in idle time: start members while no caller's create is starting and none came in
        the last `_POOL_QUIET` seconds, at most one per core at once and each pool's refill rate; give members
        back while the backend's available memory is under `pool_memory_floor`."""
        while True:
            self._pool_wake.clear()
            delay = await self._pool_step()
            # `asyncio.timeout`, not `wait_for`: on 3.11 a cancel that lands as the event is set is lost by
            # `wait_for`, and `close` then waits for this loop forever (a test caught it).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._pool_wake.wait()

    async def _pool_step(self) -> float:
        """Start what the pools lack now; the seconds until the next look."""
        try:
            figures = await self.backend.capacity()
        except Exception:
            logger.exception("pool.capacity_failed")
            return 5.0
        floor = self._pool_memory_floor(figures)
        available = figures.memory_available
        if available is not None and available < floor:
            if self._evict_one():
                logger.warning("pool.memory_pressure", extra={"available": available, "floor": floor})
            return _POOL_PRESSURE_POLL
        quiet = self._last_demand + _POOL_QUIET - time.monotonic()
        if quiet > 0 or any(sandbox_id not in self._pool_starting for sandbox_id in self._creating):
            return max(quiet, _POOL_QUIET / 4)
        if available is not None and available < 2 * floor:
            return _POOL_PRESSURE_POLL
        now, delay = time.monotonic(), _POOL_IDLE_POLL
        for state in sorted(self._pools.values(), key=lambda st: len(st.members) / max(1, st.pool.size)):
            while state.deficit() > 0 and len(self._pool_tasks) < _POOL_PARALLEL:
                if now < state.next_start:
                    delay = min(delay, state.next_start - now)
                    break
                state.next_start = now + (1 / state.pool.refill if state.pool.refill else 0)
                state.starting += 1
                task = asyncio.create_task(self._make_member(state), name="corral-pool-member")
                self._pool_tasks.add(task)
                task.add_done_callback(self._pool_tasks.discard)
        return delay

    async def _make_member(self, state: PoolState) -> None:
        sandbox_id = f"sb-{secrets.token_hex(8)}"
        self._pool_starting.add(sandbox_id)
        try:
            template = self.templates.get(state.pool.spec.template)
            sb = await self._create(state.pool.spec, template, pooled=True, sandbox_id=sandbox_id)
        except Exception:
            state.stats.failed += 1
            state.next_start = time.monotonic() + _POOL_RETRY  # a broken template must not spin
            logger.exception("pool.fill_failed", extra={"pool": state.pool.describe()})
        else:
            state.stats.made += 1
            if self._pools.get(self._pool_key(state.pool.spec)) is state and len(state.members) < state.pool.size:
                state.members.append(sb.id)
                self._pooled[sb.id] = sb
            else:
                self._evict(sb, None)
        finally:
            state.starting -= 1
            self._pool_starting.discard(sandbox_id)
            self._pool_wake.set()

    def _pool_memory_floor(self, figures: BackendCapacity) -> int:
        if self.pool_memory_floor is not None:
            return self.pool_memory_floor
        return max(_GiB, int((figures.memory_total or 0) * 0.1))

    def _evict_one(self) -> bool:
        """Give back the oldest ready member of the fullest pool; False when every pool is empty."""
        candidates = [st for st in self._pools.values() if st.members]
        if not candidates:
            return False
        state = max(candidates, key=lambda st: len(st.members) / max(1, st.pool.size))
        self._evict(self._pooled.pop(state.members.pop(0)), state)
        return True

    def _evict(self, sb: _Sandbox, state: PoolState | None) -> None:
        """Destroy a pool member in the background; its room counts as free at once (`usage` no longer has it)."""
        if state is not None:
            state.stats.evicted += 1
        task = asyncio.create_task(self._destroy(sb, reason="pool member given back"), name="corral-pool-evict")
        self._pool_tasks.add(task)
        task.add_done_callback(self._pool_tasks.discard)

    @property
    def pool_ready(self) -> int:
        return len(self._pooled)


class SandboxHandle:
    """One sandbox: `exec`, `files`, `processes`, `pty`, `pause`/`resume`, `destroy`."""

    def __init__(self, engine: Engine, sandbox_id: str) -> None:
        self._engine = engine
        self.id = sandbox_id
        self.files = Files(engine, sandbox_id)
        self.processes = Processes(engine, sandbox_id)

    def __repr__(self) -> str:
        return f"<SandboxHandle {self.id}>"

    @property
    def info(self) -> SandboxInfo:
        return self._engine.info(self.id)

    async def exec(self, cmd: str | list[str], **kwargs: Any) -> ExecResult:
        return await self._engine.exec(self.id, cmd, **kwargs)

    async def run_code(self, code: str, **kwargs: Any) -> CodeResult:
        return await self._engine.run_code(self.id, code, **kwargs)

    async def pty(self, cmd: str | list[str] = "bash", *, rows: int = 24, cols: int = 80,
                  cwd: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, user: str | None = None) -> PtySession:
        agent = self._engine.agent(self.id).as_user(check_user(user))
        return await agent.pty(cmd, rows=rows, cols=cols, cwd=cwd, env=self._engine.sandbox_env(self.id),
                               cmd_env=env, timeout=timeout)

    async def pause(self, *, memory: bool = True) -> None:
        await self._engine.pause(self.id, memory=memory)

    async def snapshot(self) -> SnapshotArtifact:
        return await self._engine.snapshot(self.id)

    async def fork(self) -> SandboxHandle:
        return await self._engine.fork(self.id)

    async def resume(self) -> None:
        await self._engine.resume(self.id)

    def set_timeout(self, seconds: float) -> SandboxInfo:
        return self._engine.set_timeout(self.id, seconds)

    async def destroy(self) -> None:
        await self._engine.destroy(self.id)

    async def __aenter__(self) -> SandboxHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError, SandboxTimeoutError):
            await self.destroy()


def _tmp_agent(sb: _Sandbox, agent: AgentClient) -> AgentClient:
    """Who saves and restores a sandbox's /tmp across a pause to disk: root where the sandbox has it (its files
    there keep their owners), else the user, who owns or may read everything there."""
    return agent.as_user("root") if sb.spec.root else agent


def read_agent_address(home: str | os.PathLike[str], sandbox_id: str) -> AgentAddress:
    """Where a sandbox's agent listens and its token, read from the engine state in `home` (for `corral check`
    beside a running server, which owns that home). `NotFoundError` if that engine has no such sandbox;
    `ValueError` if its state or the backend's record in it is not readable."""
    home = Path(home)
    _check_sandbox_id(sandbox_id)
    data = _read_state(home / STATE_DIR / f"{sandbox_id}.json")
    if data is None:
        raise NotFoundError(f"no readable engine state of sandbox {sandbox_id} under {home / STATE_DIR}")
    backend = load_backend(str(data.get("backend")), home)
    return backend.agent_address(backend.restore(data["record"]))


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_SANDBOX_ID = re.compile(r"sb-[a-z0-9][a-z0-9-]{3,62}")


def _check_sandbox_id(sandbox_id: str) -> None:
    # It names a directory, a runc container and a cgroup: keep it to a safe alphabet.
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidRequestError(f"sandbox id {sandbox_id!r} must match sb-[a-z0-9][a-z0-9-]{{3,62}}")


WORKSPACE = "/workspace"


def sandbox_path(path: str) -> str:
    """Relative paths resolve against /workspace; the agent validates the rest (NUL, encoding)."""
    if not isinstance(path, str):
        raise InvalidRequestError("path must be a string")
    if "\x00" in path:
        raise InvalidRequestError("path contains a NUL byte")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError("path is not valid UTF-8") from exc
    if not path:
        raise InvalidRequestError("path is empty")
    return path if path.startswith("/") else f"{WORKSPACE}/{path}"


class Files:
    """File operations, resolved inside the sandbox.

    `roots`: the directories they may touch, if the caller holds them (the service: the sandbox's store record);
    None: the spec the engine created the sandbox with. `user`: who opens the files (the kernel checks each path
    as that user's, and what it makes is that user's): None the sandbox user, "root" only in a sandbox created
    with root (`PermissionDeniedError`)."""

    def __init__(self, engine: Engine, sandbox_id: str, *, roots: list[str] | None = None,
                 user: str | None = None) -> None:
        self._engine = engine
        self._id = sandbox_id
        self._given_roots = roots
        self._user = check_user(user)

    def _agent(self) -> AgentClient:
        agent = self._engine.agent(self._id)
        return agent if self._user is None else agent.as_user(self._user)

    def _roots(self) -> list[str] | None:
        if self._given_roots is not None:
            return list(self._given_roots)
        roots = self._engine.spec(self._id).file_roots
        return None if roots is None else list(roots)

    async def read(self, path: str) -> bytes:
        return await self._agent().read_file(sandbox_path(path), roots=self._roots())

    async def iter_read(self, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent().iter_file(sandbox_path(path), roots=self._roots()):
            yield chunk

    async def write(self, path: str, data: Source, *, mode: int = 0o644, in_place: bool = False,
                    metadata: dict[str, str] | None = None) -> int:
        """Write `data` to `path`. Whole or not at all (a temporary file renamed over it), or `in_place` as E2B's
        envd writes (the file itself, opened and truncated: a watcher sees its own name change). `metadata`:
        the file's user.e2b.* attributes, replacing any it had; refused before anything is written if invalid
        or if the file system keeps none."""
        return await self._agent().write_file(sandbox_path(path), data, mode=mode, roots=self._roots(),
                                              in_place=in_place, metadata=metadata)

    async def list(self, path: str = WORKSPACE, *, depth: int = 1) -> list[Entry]:
        """The entries below `path`, `depth` levels deep (1: its own), depth first in name order; symlinks are
        listed, not followed."""
        return await self._agent().list(sandbox_path(path), roots=self._roots(), depth=depth)

    async def stat(self, path: str) -> Entry:
        return await self._agent().stat(sandbox_path(path), roots=self._roots())

    async def exists(self, path: str) -> bool:
        return await self._agent().exists(sandbox_path(path), roots=self._roots())

    async def make_dir(self, path: str, *, parents: bool = True) -> bool:
        return await self._agent().make_dir(sandbox_path(path), parents=parents, roots=self._roots())

    async def remove(self, path: str, *, recursive: bool = True) -> None:
        await self._agent().remove(sandbox_path(path), recursive=recursive, roots=self._roots())

    async def rename(self, src: str, dst: str, *, overwrite: bool = False, parents: bool = False) -> Entry:
        """Move `src` to `dst`; `parents`: make dst's missing parent directories (E2B's Move). The entry at dst."""
        return await self._agent().rename(sandbox_path(src), sandbox_path(dst), overwrite=overwrite,
                                          roots=self._roots(), parents=parents)

    # -- watching directories ----------------------------------------------------------------------------

    async def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False) -> WatchStream:
        """Events in the directory `path` as they happen, until the stream is closed (`aclose()`). Refusals
        (missing: not found; a file: invalid request; outside the roots; too many watches) raise here."""
        return await self._agent().watch(sandbox_path(path), recursive=recursive, include_entry=include_entry,
                                         roots=self._roots())

    async def create_watcher(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                             owner: str = "") -> str:
        """A watcher the agent keeps, polled with `watcher_events` (by `owner` only); its id. Refusals as
        `watch`; a watcher nobody polls for 10 minutes goes away."""
        return await self._agent().create_watcher(sandbox_path(path), recursive=recursive,
                                                  include_entry=include_entry, owner=owner, roots=self._roots())

    async def watcher_events(self, watcher_id: str, *, owner: str = "") -> builtins.list[WatchEvent]:
        """The watcher's events since the last poll: every change that finished before this call is in them."""
        return await self._agent().watcher_events(watcher_id, owner=owner)

    async def remove_watcher(self, watcher_id: str, *, owner: str = "") -> None:
        await self._agent().remove_watcher(watcher_id, owner=owner)

    async def download_tar(self, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent().download_tar(sandbox_path(path), roots=self._roots()):
            yield chunk

    async def upload_tar(self, path: str, data: Source) -> int:
        return await self._agent().upload_tar(sandbox_path(path), data, roots=self._roots())


class Processes:
    """Background processes: start, list, get, send stdin, resize, kill, wait, follow.

    Each method that names a process takes a `ProcessSelector`: Corral's id as a `str`, or a `ProcessRef` by
    id, pid (inside the sandbox) or tag. An unknown one is `NotFoundError`."""

    def __init__(self, engine: Engine, sandbox_id: str) -> None:
        self._engine = engine
        self._id = sandbox_id

    def _agent(self) -> AgentClient:
        return self._engine.agent(self._id)

    async def start(self, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                    timeout: float | None = None, max_output: int | None = None,
                    stdin: bool = False, tag: str | None = None, pty: PtySize | None = None,
                    user: str | None = None) -> ProcessInfo:
        """Start `cmd` in the background (in a terminal of size `pty`, if given; named `tag`, if given), as `user`
        (None: the sandbox user; "root" only in a sandbox created with root)."""
        return await self._agent().as_user(check_user(user)).start(
            cmd, cwd=cwd, env=self._engine.sandbox_env(self._id), cmd_env=env or None, timeout=timeout,
            max_output=max_output, stdin=stdin, tag=tag, pty=pty)

    async def list(self) -> list[ProcessInfo]:
        return await self._agent().ps()

    async def get(self, ref: ProcessSelector) -> ProcessInfo:
        return await self._agent().process(ref)

    async def send_stdin(self, ref: ProcessSelector, data: bytes, *, eof: bool = False) -> None:
        await self._agent().send_stdin(ref, data, eof=eof)

    async def close_stdin(self, ref: ProcessSelector) -> None:
        """EOF on the process's stdin; a terminal's is refused (`InvalidRequestError`: send Ctrl-D, 0x04)."""
        await self._agent().close_stdin(ref)

    async def resize(self, ref: ProcessSelector, rows: int, cols: int) -> None:
        await self._agent().resize(ref, rows, cols)

    async def kill(self, ref: ProcessSelector, signal: int | None = None) -> None:
        """`signal` to the process's group; None (SIGKILL): its whole tree, answered once its pid is free."""
        await self._agent().kill(ref, signal)

    async def wait(self, ref: ProcessSelector, timeout: float | None = None) -> ExecResult | None:
        return await self._agent().wait(ref, timeout)

    async def attach(self, ref: ProcessSelector, on_stdout: OutputCallback | None = None,
                     on_stderr: OutputCallback | None = None, *, replay: bool = True,
                     on_start: StartCallback | None = None) -> ExecResult:
        """Follow the process to its end: the output kept so far (not with `replay=False`: only what comes
        after), then every new byte. Cancelling only detaches."""
        return await self._agent().attach(ref, on_stdout, on_stderr, replay=replay, on_start=on_start)


def _liveness_from_settings() -> Liveness:
    """`Liveness` from the environment (`_settings.agent_seconds`), else its defaults; an idle timeout of 0 is
    none."""
    default = Liveness()
    interval = agent_seconds("HEARTBEAT_INTERVAL")
    idle = agent_seconds("IDLE_TIMEOUT")
    return Liveness(heartbeat_interval=interval or default.heartbeat_interval,
                    idle_timeout=default.idle_timeout if idle is None else (idle or None))
