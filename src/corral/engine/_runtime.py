"""The runtime: sandboxes' lifecycle over the backend contract (create, destroy, pause, resume, snapshot, fork).

Around the backend's calls it waits for each new sandbox's agent, attaches the egress proxy
(`EgressAttachment`), checks capacity, undoes a create that fails half-way, and keeps the state files the
backend needs to find its sandboxes again after a restart (`StateFiles`, `recover`). It holds the warm pools
(`Pools`), whose members take room as any sandbox does.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._exceptions import (
    AgentError,
    CapacityError,
    ConflictError,
    NotFoundError,
)
from ..backends import Backend, BackendCapacity, BackendRecord, Resizable, SnapshotArtifact
from ..templates import Template, TemplateStore
from ._agent_client import AgentClient, Liveness
from ._capacity import Capacity, MachineUsage
from ._egress_attach import EgressAttachment
from ._models import SandboxInfo, SandboxSpec, SandboxState
from ._pool import Pools, WarmPool
from ._records import Adoption, StateFiles
from ._sandbox import LiveSandbox, agent_client, check_sandbox_id

logger = logging.getLogger("corral.engine")

TOMBSTONES_KEPT = 1000
_READY_POLL = 0.02  # seconds between pings while a new sandbox's agent starts
_ALIVE_POLL = 0.25  # ... and between asking the backend whether it still runs at all
_RETRY_AFTER = 10  # seconds a bare engine's `CapacityError` suggests waiting


class Runtime:
    """The sandboxes of one backend: what runs, what is being created, what was destroyed (tombstones)."""

    def __init__(self, home: Path, backend: Backend, *, templates: TemplateStore, capacity: Capacity,
                 attachment: EgressAttachment, liveness: Liveness, pools: Sequence[WarmPool] = ()) -> None:
        self.backend = backend
        self.templates = templates
        self.capacity = capacity
        self.attachment = attachment
        self.liveness = liveness
        self.records = StateFiles(home, backend, liveness)
        self.resizable = backend if isinstance(backend, Resizable) else None
        self.sandboxes: dict[str, LiveSandbox] = {}
        self.tombstones: dict[str, str] = {}
        self.creating: dict[str, int] = {}  # sandbox id -> memory limit, while the backend creates it
        self.pools = Pools(pools, resizable=self.resizable is not None, make=self._make_member,
                           destroy=self.destroy_now, capacity=backend.capacity, creating=self.creating,
                           room=lambda memory, figures: self.capacity.room(self.usage(), memory, figures))

    # -- creating -----------------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, template: Template, *, pooled: bool = False,
                     sandbox_id: str | None = None, source: SnapshotArtifact | None = None) -> LiveSandbox:
        """Create a sandbox and wait until its agent answers. Fails closed; a failure leaves nothing."""
        sandbox_id = sandbox_id or f"sb-{secrets.token_hex(8)}"
        await self.backend.check(spec)
        figures = await self.backend.capacity()
        # Checked and counted with no await in between, so concurrent creates cannot all squeeze past the check
        # (nor two of them take the same id).
        self.check_unused(sandbox_id)
        self._check_capacity(spec, figures, pooled=pooled)
        self.creating[sandbox_id] = spec.limits.memory
        try:
            record = await self.backend.create(sandbox_id, spec, template, source)
            try:
                agent = self._agent(sandbox_id, record)
                await self._wait_ready(sandbox_id, record, agent)
                await self.attachment.attach(sandbox_id, record, spec)
                sb = LiveSandbox(id=sandbox_id, spec=spec, record=record, agent=agent, created_at=time.time(),
                                 template_env=dict(template.env))
                self.records.save(sb)
            except BaseException:
                await asyncio.shield(self._discard(sandbox_id, record))
                raise
        finally:
            self.creating.pop(sandbox_id, None)
        if not pooled:
            self.sandboxes[sb.id] = sb
        return sb

    async def _make_member(self, spec: SandboxSpec, sandbox_id: str) -> LiveSandbox:
        return await self.create(spec, self.templates.get(spec.template), pooled=True, sandbox_id=sandbox_id)

    def check_unused(self, sandbox_id: str) -> None:
        check_sandbox_id(sandbox_id)
        if sandbox_id in self.sandboxes or sandbox_id in self.creating or self.records.path(sandbox_id).exists():
            raise ConflictError(f"sandbox {sandbox_id} already exists")

    def check_capacity(self, memory: int, figures: BackendCapacity) -> None:
        # When a slot frees up is the store's to know (the service answers with its own Retry-After).
        self.capacity.check(self.usage(), memory, figures, retry_after=_RETRY_AFTER)

    def _check_capacity(self, spec: SandboxSpec, figures: BackendCapacity, *, pooled: bool) -> None:
        """`Capacity.check`; a caller's create that does not fit takes the room of ready pool members first."""
        while True:
            try:
                self.check_capacity(spec.limits.memory, figures)
                return
            except CapacityError:
                if pooled or not self.pools.evict_one():
                    raise

    def _agent(self, sandbox_id: str, record: BackendRecord) -> AgentClient:
        return agent_client(sandbox_id, self.backend.agent_address(record), self.liveness)

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
            await self.attachment.detach(sandbox_id)
            await self.backend.destroy(record)
            self.records.path(sandbox_id).unlink(missing_ok=True)
        except Exception:
            # The create's own error is what the caller needs; this one goes to the log (and `sweep` at the
            # next start takes what is left).
            logger.exception("sandbox.discard_failed", extra={"sandbox": sandbox_id})

    def usage(self) -> MachineUsage:
        """Sandboxes and memory limits promised on this machine: running, pooled and being created."""
        held = [*(sb for sb in self.sandboxes.values() if not sb.paused_to_disk), *self.pools.held()]
        return MachineUsage(sandboxes=len(held) + len(self.creating),
                            memory=sum(sb.spec.limits.memory for sb in held) + sum(self.creating.values()))

    # -- finding ------------------------------------------------------------------------------------------

    def lookup(self, sandbox_id: str) -> LiveSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None:
            return sb
        reason = self.tombstones.get(sandbox_id)
        raise NotFoundError(f"no sandbox {sandbox_id!r}" + (f" (it was {reason})" if reason else ""))

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self.lookup(sandbox_id).info()

    def list(self) -> builtins.list[SandboxInfo]:
        return [sb.info() for sb in sorted(self.sandboxes.values(), key=lambda s: s.created_at)]

    # -- destroying, pausing, resuming --------------------------------------------------------------------

    async def destroy(self, sandbox_id: str) -> None:
        sb = self.lookup(sandbox_id)
        async with sb.lock:
            await self.destroy_now(sb, "destroyed")

    async def destroy_now(self, sb: LiveSandbox, reason: str) -> None:
        """Destroy without the sandbox's lock (the caller holds it, or the sandbox is a pool member)."""
        self.sandboxes.pop(sb.id, None)
        self.tombstones[sb.id] = "destroyed"
        while len(self.tombstones) > TOMBSTONES_KEPT:
            self.tombstones.pop(next(iter(self.tombstones)))
        sb.state = SandboxState.STOPPED
        await self.attachment.detach(sb.id)
        await self.backend.destroy(sb.record)
        self.records.forget(sb.id)
        logger.info("sandbox.destroyed", extra={"sandbox": sb.id, "reason": reason})

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        """Pause: with `memory`, every process frozen in place; without, paused to disk (docs/lifecycle.md):
        processes ended, memory and cgroup released, the filesystem (and /tmp, saved beside it) kept."""
        sb = self.lookup(sandbox_id)
        async with sb.lock:
            if sb.paused_to_disk:
                raise ConflictError(f"sandbox {sandbox_id} is paused to disk already")
            if not memory:
                await self.pause_to_disk(sb)
                return
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

    async def pause_to_disk(self, sb: LiveSandbox) -> None:
        """Under the sandbox's lock: save /tmp, stop it, keep its disk."""
        if sb.state == SandboxState.PAUSED:  # frozen: thaw it so its agent can save /tmp, then stop it
            await self.backend.resume(sb.record)
            sb.agent.thaw()
            sb.state = SandboxState.RUNNING
        await self._save_tmp(sb)
        await self.attachment.detach(sb.id)
        await self.backend.stop(sb.record)
        sb.state, sb.paused_to_disk = SandboxState.PAUSED, True
        logger.info("sandbox.paused_to_disk", extra={"sandbox": sb.id})

    async def resume(self, sandbox_id: str) -> None:
        sb = self.lookup(sandbox_id)
        async with sb.lock:
            if sb.state != SandboxState.PAUSED:
                raise ConflictError(f"sandbox {sandbox_id} is not paused")
            if sb.paused_to_disk:
                await self.boot(sb)
                return
            await self.backend.resume(sb.record)
            sb.agent.thaw()
            sb.state = SandboxState.RUNNING

    async def boot(self, sb: LiveSandbox) -> None:
        """Under the sandbox's lock: start a sandbox paused to disk again: capacity first (it takes memory
        again), then the backend, the agent, egress, its /tmp."""
        self.check_capacity(sb.spec.limits.memory, await self.backend.capacity())
        self.creating[sb.id] = sb.spec.limits.memory
        try:
            record = await self.backend.boot(sb.record, sb.spec)
            try:
                agent = self._agent(sb.id, record)
                await self._wait_ready(sb.id, record, agent)
                await self.attachment.attach(sb.id, record, sb.spec)
                await self._restore_tmp(sb, agent)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.backend.stop(record))
                raise
        finally:
            self.creating.pop(sb.id, None)
        sb.record, sb.agent = record, agent
        sb.state, sb.paused_to_disk = SandboxState.RUNNING, False
        self.records.save(sb)  # the backend's new record
        self.records.tmp_path(sb.id).unlink(missing_ok=True)
        logger.info("sandbox.resumed_from_disk", extra={"sandbox": sb.id})

    async def _save_tmp(self, sb: LiveSandbox) -> None:
        """/tmp is a tmpfs (memory): its files go to a tar beside the engine's state, through the agent (which
        reads them as the sandbox's user would: nothing there is beyond its reach; in a sandbox with root, as root,
        whose files there may be its own)."""
        path = self.records.tmp_path(sb.id)
        partial = path.with_suffix(".partial")
        try:
            with open(partial, "wb") as f:
                async for chunk in sb.tmp_agent().download_tar("/tmp", contents=True):
                    f.write(chunk)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    async def _restore_tmp(self, sb: LiveSandbox, agent: AgentClient) -> None:
        path = self.records.tmp_path(sb.id)
        if not path.exists():
            return
        with open(path, "rb") as f:
            await sb.tmp_agent(agent).upload_tar("/tmp", f, owners=sb.spec.root)

    # -- snapshots ----------------------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> SnapshotArtifact:
        """Keep the sandbox's filesystem as it is now (its processes frozen for the copy; /tmp and /dev/shm,
        which are memory, are not in it) as an artifact that `create(source=...)` starts sandboxes from."""
        sb = self.lookup(sandbox_id)
        snapshot_id = snapshot_id or f"snap-{secrets.token_hex(8)}"
        async with sb.lock:
            artifact = await self.backend.snapshot(sb.record, snapshot_id)
        logger.info("sandbox.snapshot", extra={"sandbox": sb.id, "snapshot": snapshot_id,
                                               "bytes": artifact.size_bytes})
        return artifact

    # -- after a restart ----------------------------------------------------------------------------------

    async def _agree(self, sb: LiveSandbox) -> None:
        """Make a sandbox found running agree with its record, the store's word: a server killed between a
        backend's pause (or resume, or stop) and the store's write left the two apart. Frozen or not as recorded;
        one recorded as paused to disk that still runs is paused to disk now (its /tmp saved first)."""
        frozen = await self.backend.frozen(sb.record)
        to_disk = sb.paused_to_disk
        wanted = sb.state
        if to_disk or wanted is SandboxState.RUNNING:
            if frozen:
                await self.backend.resume(sb.record)
                logger.info("sandbox.thawed_as_recorded", extra={"sandbox": sb.id})
            sb.state, sb.paused_to_disk = SandboxState.RUNNING, False
            await self.attachment.attach(sb.id, sb.record, sb.spec)
            if to_disk:
                logger.info("sandbox.stopped_as_recorded", extra={"sandbox": sb.id})
                async with sb.lock:
                    await self.pause_to_disk(sb)
            return
        if not frozen:
            await self.backend.pause(sb.record)
            logger.info("sandbox.frozen_as_recorded", extra={"sandbox": sb.id})
        sb.agent.freeze()  # calls wait for a resume rather than take its silence for a wedged agent
        await self.attachment.attach(sb.id, sb.record, sb.spec)

    async def recover(self, adopt: Mapping[str, Adoption]) -> None:
        """Reattach to the sandboxes the store says are live (`adopt`) and the backend still has; have the
        backend sweep the rest (half-created, dead, ended, old pool members); forget their state files. Expired
        ones are the reconciler's to end, from the store's records."""
        self.records.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        known: set[str] = set()
        stale: builtins.list[Path] = []
        for path, data in self.records.entries():
            adoption = adopt.get(path.stem)
            sb = None if data is None or adoption is None else self.records.load(data, adoption)
            if sb is not None and sb.paused_to_disk and not await self.backend.alive(sb.record):
                await self.backend.adopt(sb.record)  # asleep, as recorded: nothing runs to check
                self.sandboxes[sb.id] = sb
                known.add(sb.id)
                logger.info("sandbox.kept_paused", extra={"sandbox": sb.id})
                continue
            if sb is None or not await self.backend.alive(sb.record):
                stale.append(path)
                continue
            await self.backend.adopt(sb.record)
            self.sandboxes[sb.id] = sb
            known.add(sb.id)
            try:
                await self._agree(sb)
            except Exception:  # one sandbox's repair must not keep the server from starting: said, left as found
                logger.warning("sandbox.disagrees", exc_info=True, extra={"sandbox": sb.id})
            logger.info("sandbox.reattached", extra={"sandbox": sb.id, "state": sb.state.value,
                                                     "paused_to_disk": sb.paused_to_disk})
        for sid in await self.backend.sweep(known):
            logger.info("sandbox.swept", extra={"sandbox": sid})
        self.records.clean(stale, known)
