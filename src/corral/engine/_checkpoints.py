"""Checkpoints over the backend contract (docs/lifecycle.md, "Checkpoints"): take, restore in place, compare.

The backend keeps the files (`corral.backends.Checkpointing`); this module adds what only the engine knows: the
sandbox's lock (a checkpoint must not race a pause that unmounts its disk), and what a restore does around the
backend's call. A backend restores only a stopped sandbox (overlayfs forbids changing its layers under a
mount), so a running one is paused to disk first (its /tmp saved, egress detached, processes ended) and booted
again after (agent, egress, /tmp back): the same sandbox, id, limits, policy and volumes, new processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from .._exceptions import ConflictError, CorralError
from ..backends import (
    CHECKPOINTS_LIMITATION,
    CheckpointArtifact,
    Checkpointing,
    PathChange,
    backend_limitations,
    supports_checkpoints,
)
from ._models import SandboxState
from ._runtime import Runtime
from ._sandbox import LiveSandbox

logger = logging.getLogger("corral.engine")


class Checkpoints:
    """The engine's checkpoint operations on one runtime's sandboxes."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @property
    def supported(self) -> bool:
        return supports_checkpoints(self.runtime.backend)

    def _backend(self) -> Checkpointing:
        backend = self.runtime.backend
        if not supports_checkpoints(backend) or not isinstance(backend, Checkpointing):
            reason = backend_limitations(backend).get(CHECKPOINTS_LIMITATION, "it does not implement them")
            raise ConflictError(f"the {backend.name} backend cannot keep checkpoints: {reason}",
                                details={"limitation": CHECKPOINTS_LIMITATION})
        return backend

    async def checkpoint(self, sandbox_id: str, checkpoint_id: str) -> CheckpointArtifact:
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            artifact = await backend.checkpoint(sb.record, checkpoint_id)
        logger.info("sandbox.checkpoint", extra={"sandbox": sb.id, "checkpoint": checkpoint_id,
                                                 "bytes": artifact.size_bytes})
        return artifact

    async def restore(self, sandbox_id: str, artifact: CheckpointArtifact,
                      paths: Sequence[str] | None = None) -> None:
        """Running: stopped, restored, booted again. Paused to disk: restored, still paused. Paused in memory:
        refused (its frozen processes would wake on files changed under them)."""
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            if sb.paused_to_disk:
                await backend.restore_checkpoint(sb.record, artifact, paths)
            elif sb.state == SandboxState.PAUSED:
                raise ConflictError(f"sandbox {sandbox_id} is paused in memory: resume it, or pause it to disk, "
                                    "then restore", details={"sandbox_id": sandbox_id})
            else:
                await self._restore_running(backend, sb, artifact, paths)
        logger.info("sandbox.restored", extra={"sandbox": sb.id, "checkpoint": artifact.checkpoint_id,
                                               "paths": list(paths) if paths is not None else None})

    async def _restore_running(self, backend: Checkpointing, sb: LiveSandbox, artifact: CheckpointArtifact,
                               paths: Sequence[str] | None) -> None:
        """Under the lock: pause to disk, restore, boot. A failed restore still boots the sandbox (as it was, or
        as far as the restore got) and raises the restore's error."""
        await self.runtime.pause_to_disk(sb)
        try:
            await backend.restore_checkpoint(sb.record, artifact, paths)
        except BaseException:
            try:
                await asyncio.shield(self.runtime.boot(sb))
            except CorralError:
                logger.exception("sandbox.boot_after_failed_restore", extra={"sandbox": sb.id})
            raise
        await self.runtime.boot(sb)

    async def changes(self, sandbox_id: str, since: CheckpointArtifact,
                      until: CheckpointArtifact | None = None) -> list[PathChange]:
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            return await backend.checkpoint_changes(sb.record, since, until)

    async def read(self, sandbox_id: str, artifact: CheckpointArtifact, path: str, limit: int) -> bytes | None:
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            return await backend.checkpoint_read(sb.record, artifact, path, limit)

    async def delete(self, sandbox_id: str, artifact: CheckpointArtifact) -> None:
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            await backend.delete_checkpoint(sb.record, artifact)

    async def size(self, sandbox_id: str) -> int:
        backend = self._backend()
        sb = self.runtime.lookup(sandbox_id)
        async with sb.lock:
            return await backend.checkpoints_size(sb.record)


class EngineCheckpoints:
    """`Engine`'s checkpoint methods (a part of its class, kept here beside what they call)."""

    checkpointing: Checkpoints

    # -- checkpoints (docs/lifecycle.md, "Checkpoints"): the backend's `Checkpointing`, under the sandbox's lock -----

    @property
    def checkpoints_supported(self) -> bool:
        """The backend implements `Checkpointing` and declares no `checkpoints` limitation."""
        return self.checkpointing.supported

    async def checkpoint(self, sandbox_id: str, checkpoint_id: str) -> CheckpointArtifact:
        """Keep the sandbox's writable filesystem now (processes frozen for it; /tmp, /dev/shm, volumes not)."""
        return await self.checkpointing.checkpoint(sandbox_id, checkpoint_id)

    async def restore_checkpoint(self, sandbox_id: str, artifact: CheckpointArtifact, *,
                                 paths: Sequence[str] | None = None) -> None:
        """Put the files back as at `artifact`, in place. A running sandbox is stopped and booted again (every
        process ends; /tmp kept); one paused to disk stays so; one paused in memory is refused (`ConflictError`)."""
        await self.checkpointing.restore(sandbox_id, artifact, paths)

    async def checkpoint_changes(self, sandbox_id: str, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> list[PathChange]:
        """What changed between two checkpoints (`until` None: now), sorted by path."""
        return await self.checkpointing.changes(sandbox_id, since, until)

    async def checkpoint_read(self, sandbox_id: str, artifact: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None:
        """Up to `limit` bytes of the file at `path` as it was at `artifact`; None if it was no regular file."""
        return await self.checkpointing.read(sandbox_id, artifact, path, limit)

    async def delete_checkpoint(self, sandbox_id: str, artifact: CheckpointArtifact) -> None:
        await self.checkpointing.delete(sandbox_id, artifact)

    async def checkpoints_size(self, sandbox_id: str) -> int:
        """Bytes all the sandbox's checkpoints hold now."""
        return await self.checkpointing.size(sandbox_id)
