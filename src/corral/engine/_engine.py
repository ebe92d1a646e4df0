"""The engine: the composer of a runtime, its warm pools, the egress attachment and one session per sandbox.

The control plane serves this API. It is async; every method is safe to call concurrently.

The engine never imports a backend implementation: it takes a `Backend` (docs/backends.md) or loads one by name.
Its parts (docs/architecture.md, "The engine"): `Runtime` (`_runtime.py`) runs the lifecycle over the backend,
`Pools` (`_pool.py`) the warm pools, `EgressAttachment` (`_egress_attach.py`) the proxy, trust files, keyring and
environment, `StateFiles` (`_records.py`) what a restarted engine needs to find its sandboxes again, and
`SandboxSession` (`_session.py`) every operation on a running sandbox.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._exceptions import ConflictError, CorralError
from .._settings import corral_home
from ..backends import Backend, SandboxUsage, SnapshotArtifact, load_backend
from ..templates import TemplateStore
from ._agent_client import AgentClient, Liveness
from ._capacity import Capacity, MachineUsage
from ._checkpoints import Checkpoints, EngineCheckpoints
from ._claim import member_answers, resized_for
from ._egress_attach import DenialSource, EgressAttachment
from ._models import SandboxInfo, SandboxSpec, SandboxState
from ._pool import PoolStats, WarmPool
from ._records import Adoption
from ._runtime import Runtime
from ._sandbox import LiveSandbox, liveness_from_settings
from ._session import SandboxSession

if TYPE_CHECKING:
    from ..egress import EgressProxy
    from ..egress._keyring import SecretKeyring

logger = logging.getLogger("corral.engine")

class Engine(EngineCheckpoints):
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
        self.backend: Backend = load_backend(backend, self.home) if isinstance(backend, str) else backend
        self.templates = templates or TemplateStore(self.home)
        if pool_size:
            pools = [*pools, WarmPool(pool_spec or SandboxSpec(), pool_size)]
        self.attachment = EgressAttachment(self.home, self.backend, egress, keyring)
        self.runtime = Runtime(self.home, self.backend, templates=self.templates, capacity=capacity or Capacity(),
                               attachment=self.attachment, liveness=liveness or liveness_from_settings(),
                               pools=pools)
        self.pool = self.runtime.pools
        self.checkpointing = Checkpoints(self.runtime)
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._lock_fd: int | None = None

    # The parts' settings, as callers have always reached them.
    @property
    def egress(self) -> EgressProxy | None:
        return self.attachment.proxy

    @property
    def remote_denials(self) -> DenialSource | None:
        """Where a `RemoteEgress` backend's refusals are found (the service: the shared audit trail)."""
        return self.attachment.remote_denials

    @remote_denials.setter
    def remote_denials(self, source: DenialSource | None) -> None:
        self.attachment.remote_denials = source

    @property
    def keyring(self) -> SecretKeyring:
        return self.attachment.keyring

    @property
    def capacity(self) -> Capacity:
        return self.runtime.capacity

    @capacity.setter
    def capacity(self, capacity: Capacity) -> None:
        self.runtime.capacity = capacity

    @property
    def liveness(self) -> Liveness:
        return self.runtime.liveness

    @property
    def pool_memory_floor(self) -> int | None:
        return self.pool.memory_floor

    @pool_memory_floor.setter
    def pool_memory_floor(self, floor: int | None) -> None:
        self.pool.memory_floor = floor

    # -- lifecycle of the engine itself ---------------------------------------------------------------

    async def start(self, adopt: Mapping[str, Adoption] | None = None) -> None:
        """Take the state directory, reattach what still runs, start the pool.

        `adopt`: the sandboxes a previous engine on this home ran that are still live, by id, with what the control
        store says they are (the service passes its live records); each one the backend still has is reattached,
        everything else swept. None (a bare engine, with no store): a previous engine's sandboxes are all swept.
        The engine ends no sandbox by itself: when one ends is the store's record, and the service's reconciler is
        the one reaper (a bare engine's sandboxes live until destroyed, or it closes with `destroy_all`).
        """
        if self._started:
            return
        self.runtime.records.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_ownership()
        self._started = True
        await self.runtime.recover(adopt or {})
        if self.pool.states:
            self._tasks.append(asyncio.create_task(self.pool.fill(), name="corral-pool"))

    async def close(self, *, destroy_all: bool = False) -> None:
        """Stop background work. Sandboxes keep running (a new engine reattaches) unless `destroy_all`."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        victims = await self.pool.drain()
        if destroy_all:
            victims += list(self.runtime.sandboxes.values())
        await asyncio.gather(*(self.runtime.destroy_now(sb, "engine closed") for sb in victims),
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
                     source: SnapshotArtifact | None = None) -> SandboxSession:
        """Create a sandbox and wait until its agent answers. Fails closed; a failure leaves nothing.

        `sandbox_id` lets the caller (the control plane, which records the sandbox first) choose the id. With
        `source` (a snapshot's artifact, from `snapshot`), it starts with the snapshot's files, on the template
        the snapshot was taken on.
        """
        spec = spec or SandboxSpec()
        if sandbox_id is not None:
            self.runtime.check_unused(sandbox_id)
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
        self.pool.demand()
        sb = await self.runtime.create(spec, template, sandbox_id=sandbox_id, source=source)
        logger.info("sandbox.created", extra={"sandbox": sb.id, "template": spec.template,
                                              "runtime": spec.runtime.value, "pooled": False})
        return SandboxSession(self, sb)

    # -- warm pools (docs/performance.md, "Warm pools") ----------------------------------------------------

    def claim(self, spec: SandboxSpec) -> str | None:
        """Take a ready pool member that can serve `spec` aside, and return its id (None: no pool for `spec`, or
        it is empty). The caller then `adopt`s it (with the id it was told, e.g. after recording it) or
        `release`s it; until then nobody sees it."""
        return self.pool.claim(spec)

    def is_claimed(self, sandbox_id: str) -> bool:
        """Claimed and neither adopted nor released yet."""
        return sandbox_id in self.pool.claimed

    def release(self, sandbox_id: str, *, reuse: bool = True) -> None:
        """Give a claimed member back unused (the caller's create failed before `adopt`): nothing ran in it. With
        `reuse=False` (its id was shown to someone, e.g. in a refused create's audit record) it is destroyed."""
        self.pool.release(sandbox_id, reuse=reuse)

    def pool_stats(self) -> dict[str, PoolStats]:
        """Each pool's figures, by its description (`default=50:10`)."""
        return self.pool.stats()

    @property
    def pools(self) -> builtins.list[WarmPool]:
        return [state.pool for state in self.pool.states.values()]

    @property
    def pool_ready(self) -> int:
        return len(self.pool.ready)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> SandboxSession:
        """Make a claimed member the sandbox `spec` asks for: its env, network policy, secrets' trust files,
        metadata and timeout, applied now. A member whose agent no longer answers is replaced by a sandbox
        created cold under the same id, so a claim never hands out a dead sandbox."""
        sb = self.pool.claimed.pop(sandbox_id)
        try:
            usable = await member_answers(sb) and await resized_for(self.runtime, sb, spec)
        except BaseException:  # cancelled: still the caller's to release
            self.pool.claimed[sandbox_id] = sb
            raise
        if not usable:
            await self.runtime.destroy_now(sb, "pool member unusable")
            self.runtime.tombstones.pop(sandbox_id, None)
            sb = await self.runtime.create(spec, self.templates.get(spec.template), sandbox_id=sandbox_id)
        else:
            sb.spec, sb.created_at = spec, time.time()
            self.attachment.apply(sb.id, sb.record, spec)
            self.runtime.records.save(sb)  # the caller's environment, for a restart
            self.runtime.sandboxes[sb.id] = sb
        logger.info("sandbox.created", extra={"sandbox": sb.id, "template": spec.template,
                                              "runtime": spec.runtime.value, "pooled": True})
        return SandboxSession(self, sb)

    # -- one sandbox ---------------------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxSession:
        """The session through which every operation on the sandbox goes (looked up once, here)."""
        return SandboxSession(self, self.runtime.lookup(sandbox_id))

    session = get

    def lookup(self, sandbox_id: str) -> LiveSandbox:
        return self.runtime.lookup(sandbox_id)

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self.runtime.info(sandbox_id)

    def list(self) -> builtins.list[SandboxInfo]:
        return self.runtime.list()

    def spec(self, sandbox_id: str) -> SandboxSpec:
        """What the sandbox was created with."""
        return self.runtime.lookup(sandbox_id).spec

    def usage(self) -> MachineUsage:
        return self.runtime.usage()

    async def destroy(self, sandbox_id: str) -> None:
        await self.runtime.destroy(sandbox_id)

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        await self.runtime.pause(sandbox_id, memory=memory)

    async def resume(self, sandbox_id: str) -> None:
        await self.runtime.resume(sandbox_id)

    async def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> SnapshotArtifact:
        return await self.runtime.snapshot(sandbox_id, snapshot_id)

    async def delete_snapshot(self, artifact: SnapshotArtifact) -> None:
        """Remove a snapshot; sandboxes started from it keep what they use."""
        await self.backend.delete_snapshot(artifact)

    async def fork(self, sandbox_id: str, *, child_id: str | None = None,
                   spec: SandboxSpec | None = None) -> SandboxSession:
        """A new running sandbox with the parent's files at this instant (`spec`: the parent's, by default),
        independent from then on: a snapshot that lives only as long as the child's create."""
        return (await self.fork_many(sandbox_id, [child_id or f"sb-{secrets.token_hex(8)}"], spec=spec))[0]

    async def fork_many(self, sandbox_id: str, child_ids: builtins.list[str], *,
                        spec: SandboxSpec | None = None) -> builtins.list[SandboxSession]:
        """`len(child_ids)` forks of one instant: the parent is frozen and copied once, the children start
        together. All or nothing: if one cannot start, those that did are destroyed and its error is raised."""
        parent = self.runtime.lookup(sandbox_id)
        artifact = await self.snapshot(sandbox_id)
        try:
            made = await asyncio.gather(*(self.create(spec or parent.spec, sandbox_id=child, source=artifact)
                                          for child in child_ids), return_exceptions=True)
        finally:
            await asyncio.shield(self.delete_snapshot(artifact))
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            started = [m for m in made if isinstance(m, SandboxSession)]
            await asyncio.shield(asyncio.gather(*(h.destroy() for h in started), return_exceptions=True))
            raise failed[0]
        return [m for m in made if isinstance(m, SandboxSession)]

    def set_network(self, sandbox_id: str, network: str | builtins.list[str],
                    private: builtins.list[str] | None = None) -> SandboxSpec:
        """Change a live sandbox's egress policy; new connections follow it (open ones keep going)."""
        sb = self.runtime.lookup(sandbox_id)
        update: dict[str, Any] = {"network": network if isinstance(network, str) else tuple(network)}
        if private is not None:
            update["network_private"] = tuple(private)
        spec = SandboxSpec.model_validate({**sb.spec.model_dump(), **update})
        sb.spec = spec
        if self.egress is not None:
            self.egress.set_policy(sb.id, self.attachment.policy(spec))
        return spec

    async def alive(self, sandbox_id: str, *, wait: float = 5.0) -> bool:
        """Whether this engine runs the sandbox and its agent answers a ping within `wait` seconds."""
        try:
            agent = self.get(sandbox_id).agent()
            async with asyncio.timeout(wait):
                await agent.ping()
        except (CorralError, TimeoutError):
            return False
        return True

    def agent(self, sandbox_id: str) -> AgentClient:
        return self.get(sandbox_id).agent()

    def sandbox_env(self, sandbox_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return self.get(sandbox_id).env(extra)

    def check_secrets(self, spec: SandboxSpec) -> None:
        if spec.secrets:
            self.attachment.check_secrets_supported()

    def check_secrets_supported(self) -> None:
        self.attachment.check_secrets_supported()

    # -- usage (the service's metrics sampler reads it every few seconds per sandbox) --------------------------

    def states(self) -> dict[str, SandboxState]:
        """Every sandbox this engine holds (the warm pool aside) and its state: one cheap call for a poller."""
        return {sandbox_id: sb.state for sandbox_id, sb in self.runtime.sandboxes.items()}

    async def sandbox_usage(self, sandbox_id: str) -> SandboxUsage | None:
        """What the sandbox uses now (`Backend.usage`): CPU time, memory, disk, limits. None when nothing of it
        runs to measure (paused to disk; stopping). Not under the sandbox's lock: a reading never waits for a
        snapshot's copy."""
        sb = self.runtime.lookup(sandbox_id)
        if sb.paused_to_disk:  # never ask a stopped sandbox anything
            return None
        return await self.backend.usage(sb.record)

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
