"""Checkpoints of a local sandbox (docs/lifecycle.md, "Checkpoints"): `Checkpointing` over the neutral store.

The store lives *inside the sandbox's disk image*, beside `upper/` and `work/` (`disk/checkpoints/`): its bytes
count against `limits.disk` by construction (a checkpoint that does not fit is a `CapacityError`, the disk
stays as it was), it goes with the sandbox and survives a restart of the engine, and the sandbox cannot see it
(it is not under the overlay). A sandbox paused to disk has its image mounted for the call, as `snapshot` does.
A capture runs with the sandbox's processes frozen; a restore only on a stopped sandbox (overlayfs forbids
changing its layers under a mount), which the engine arranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from ..._exceptions import ConflictError
from .._checkpoints import CheckpointStore
from .._contract import BackendRecord, CheckpointArtifact, PathChange
from .._spec import Runtime
from . import _disk
from ._layers import Layers
from ._record import LocalRecord, local_record
from ._runtime import OCIRuntime
from ._snapshots import processes_frozen

__all__ = ["LocalCheckpoints"]


class LocalCheckpoints:
    """`LocalBackend`'s `Checkpointing`."""

    layers: Layers
    runtimes: dict[Runtime, OCIRuntime]

    async def checkpoint(self, record: BackendRecord, checkpoint_id: str) -> CheckpointArtifact:
        rec = local_record(record)
        async with self._disk(rec) as (store, upper):
            if _disk.is_mounted(rec.dir / "rootfs"):
                async with processes_frozen(self.runtimes[rec.runtime], rec):
                    size = await _disk.in_thread(store.capture, upper, rec.uid_base, checkpoint_id)
            else:  # paused to disk: nothing runs, nothing to freeze
                size = await _disk.in_thread(store.capture, upper, rec.uid_base, checkpoint_id)
        return CheckpointArtifact(checkpoint_id=checkpoint_id, size_bytes=size, data={"store": "disk"})

    async def restore_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact,
                                 paths: Sequence[str] | None = None) -> None:
        rec = local_record(record)
        if _disk.is_mounted(rec.dir / "rootfs"):
            raise ConflictError(f"sandbox {rec.sandbox_id} runs: stop it (pause it to disk) before a restore")
        async with self._disk(rec) as (store, upper):
            await _disk.in_thread(store.restore, upper, rec.uid_base, checkpoint.checkpoint_id, paths)

    async def checkpoint_changes(self, record: BackendRecord, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> list[PathChange]:
        rec = local_record(record)
        until_id = until.checkpoint_id if until is not None else None
        async with self._disk(rec) as (store, upper):
            return await _disk.in_thread(store.changes, since.checkpoint_id, until_id, upper, rec.uid_base,
                                         self._lowers(rec))

    async def checkpoint_read(self, record: BackendRecord, checkpoint: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None:
        rec = local_record(record)
        async with self._disk(rec) as (store, _):
            return await _disk.in_thread(store.read, checkpoint.checkpoint_id, path, limit, self._lowers(rec))

    async def delete_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact) -> None:
        rec = local_record(record)
        if not (rec.dir / "disk.img").exists():
            return  # gone with its sandbox
        async with self._disk(rec) as (store, _):
            await _disk.in_thread(store.delete, checkpoint.checkpoint_id)

    async def checkpoints_size(self, record: BackendRecord) -> int:
        rec = local_record(record)
        async with self._disk(rec) as (store, _):
            return await _disk.in_thread(store.size)

    @contextlib.asynccontextmanager
    async def _disk(self, rec: LocalRecord) -> AsyncIterator[tuple[CheckpointStore, Path]]:
        """The sandbox's store and upper directory, its disk image mounted meanwhile if it was not."""
        disk = rec.dir / "disk"
        if _disk.is_mounted(disk):
            yield CheckpointStore(disk / "checkpoints"), disk / "upper"
            return
        await _disk.mount_image(rec.dir / "disk.img", disk)
        try:
            yield CheckpointStore(disk / "checkpoints"), disk / "upper"
        finally:
            await _disk.unmount_all([disk])

    def _lowers(self, rec: LocalRecord) -> list[Path]:
        """What the overlay has below the upper directory, topmost first: the snapshot layers, the template."""
        return [*(self.layers.tree(layer) for layer in rec.layers), Path(rec.template_rootfs)]
