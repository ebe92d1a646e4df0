"""Checkpoints of a Docker sandbox (docs/lifecycle.md, "Checkpoints"): `Checkpointing` over the neutral store.

A Docker sandbox's root filesystem is its image, read only; everything it can write (bar /tmp and /dev/shm,
memory) is on its own loop-mounted disk, one directory per writable path (`_container.WRITABLE`: `workspace/` at
/workspace, `home/` at /home/user, `var-tmp/` at /var/tmp), bind-mounted into the container. That disk is the
tree a checkpoint records (there is no overlay, so no whiteouts: a deleted file is simply absent; owners are the
host's own, uid base 0). The store lives under the Corral home, `docker-checkpoints/<sandbox id>/`, outside
the disk: it does not count against `limits.disk` (the tenant's snapshot bytes count it, through the service),
and a restore never has to step around it. A capture freezes the container; a restore runs on a stopped
sandbox, its disk mounted for the call (as `boot` mounts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from ..._exceptions import ConflictError
from .._checkpoints import CheckpointStore
from .._contract import BackendRecord, CheckpointArtifact, PathChange
from ..local import _disk
from ._api import DockerAPI
from ._container import WRITABLE
from ._record import docker_record as _rec
from ._volume import release_disk

__all__ = ["DockerCheckpoints", "disk_path", "sandbox_path"]

_ON_DISK = {d.path: d.name for d in WRITABLE}  # /home/user -> home


def disk_path(path: str) -> str | None:
    """The sandbox path `path` as a path on its disk ("/home/user/a" -> "/home/a"); None when it is on the image
    (read only: it never changes, so nothing of it is in a checkpoint)."""
    for mount, name in _ON_DISK.items():
        if path == mount or path.startswith(mount + "/"):
            return "/" + name + path[len(mount):]
    return None


def sandbox_path(path: str) -> str | None:
    """The inverse of `disk_path`; None for what is on the disk but not in the sandbox (`lost+found`)."""
    for mount, name in _ON_DISK.items():
        if path == "/" + name or path.startswith("/" + name + "/"):
            return mount + path[len(name) + 1:]
    return None


class DockerCheckpoints:
    """`DockerBackend`'s `Checkpointing`."""

    home: Path
    api: DockerAPI


    async def pause(self, record: BackendRecord) -> None:
        raise NotImplementedError  # the backend's (`DockerBackend.pause`, with its retries)

    async def checkpoint(self, record: BackendRecord, checkpoint_id: str) -> CheckpointArtifact:
        rec = _rec(record)
        async with self._mounted(rec.dir) as disk:
            async with self._frozen(record):
                size = await _disk.in_thread(self._store(rec.sandbox_id).capture, disk, 0, checkpoint_id)
        return CheckpointArtifact(checkpoint_id=checkpoint_id, size_bytes=size, data={"store": "home"})

    async def restore_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact,
                                 paths: Sequence[str] | None = None) -> None:
        rec = _rec(record)
        if await self._running(record):
            raise ConflictError(f"sandbox {rec.sandbox_id} runs: stop it (pause it to disk) before a restore")
        mapped = None if paths is None else [p for p in (disk_path(q) for q in paths) if p is not None]
        if mapped == []:
            return  # only paths of the image, which never change
        async with self._mounted(rec.dir) as disk:
            await _disk.in_thread(self._store(rec.sandbox_id).restore, disk, 0, checkpoint.checkpoint_id, mapped)

    async def checkpoint_changes(self, record: BackendRecord, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> list[PathChange]:
        rec = _rec(record)
        until_id = until.checkpoint_id if until is not None else None
        async with self._mounted(rec.dir) as disk:
            found = await _disk.in_thread(self._store(rec.sandbox_id).changes, since.checkpoint_id, until_id,
                                          disk, 0, [])
        shown = ((sandbox_path(c.path), c) for c in found)
        return sorted((_moved(c, p) for p, c in shown if p is not None and p not in _ON_DISK),
                      key=lambda c: c.path)

    async def checkpoint_read(self, record: BackendRecord, checkpoint: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None:
        rec = _rec(record)
        on_disk = disk_path(path)
        if on_disk is None:
            return None
        async with self._mounted(rec.dir):
            return await _disk.in_thread(self._store(rec.sandbox_id).read, checkpoint.checkpoint_id, on_disk,
                                         limit, [])

    async def delete_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact) -> None:
        store = self._store(_rec(record).sandbox_id)
        if store.root.is_dir():
            await _disk.in_thread(store.delete, checkpoint.checkpoint_id)

    async def checkpoints_size(self, record: BackendRecord) -> int:
        return await _disk.in_thread(self._store(_rec(record).sandbox_id).size)

    async def drop_checkpoints(self, sandbox_id: str) -> None:
        """Every checkpoint of a sandbox being destroyed."""
        await asyncio.to_thread(shutil.rmtree, self._store(sandbox_id).root, True)

    def _store(self, sandbox_id: str) -> CheckpointStore:
        root = self.home / "docker-checkpoints"
        root.mkdir(mode=0o700, exist_ok=True)
        return CheckpointStore(root / sandbox_id)

    async def _running(self, record: BackendRecord) -> bool:
        state = ((await self.api.inspect(_rec(record).name)) or {}).get("State") or {}
        return state.get("Status") in ("running", "paused")

    @contextlib.asynccontextmanager
    async def _frozen(self, record: BackendRecord) -> AsyncIterator[None]:
        """The container frozen meanwhile if it runs (one paused already stays so; a stopped one has nothing)."""
        state = ((await self.api.inspect(_rec(record).name)) or {}).get("State") or {}
        freeze = state.get("Status") == "running" and not state.get("Paused")
        if freeze:
            await self.pause(record)
        try:
            yield
        finally:
            if freeze:
                await asyncio.shield(self.api.unpause(_rec(record).name))

    @contextlib.asynccontextmanager
    async def _mounted(self, sbdir: Path) -> AsyncIterator[Path]:
        """The sandbox's disk, mounted meanwhile if it was not (stopped)."""
        disk = sbdir / "disk"
        if _disk.is_mounted(disk):
            yield disk
            return
        await release_disk(sbdir / "disk.img", disk)  # a stop that gave up waiting for it
        await _disk.mount_image(sbdir / "disk.img", disk)
        try:
            yield disk
        finally:
            await release_disk(sbdir / "disk.img", disk)


def _moved(change: PathChange, path: str) -> PathChange:
    return PathChange(path=path, kind=change.kind, size=change.size, old_size=change.old_size, type=change.type)
