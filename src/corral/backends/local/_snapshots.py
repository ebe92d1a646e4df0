"""Snapshots of a local sandbox (docs/lifecycle.md): its upper directory copied into a layer (`_layers`) that
other sandboxes start on. A part of `LocalBackend`, kept beside the freeze it shares with checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from ..._exceptions import ConflictError, NotFoundError, ServerError
from ...templates import Template
from .._contract import BackendRecord, SnapshotArtifact
from .._spec import Runtime
from . import _cgroups, _disk
from ._layers import MAX_DEPTH, Layers, check_layers
from ._record import LocalRecord, local_record
from ._runtime import OCIRuntime

__all__ = ["LocalSnapshots", "processes_frozen"]


@contextlib.asynccontextmanager
async def processes_frozen(runtime: OCIRuntime, rec: LocalRecord) -> AsyncIterator[None]:
    """Every process of the sandbox frozen meanwhile (as it was, if frozen already): nothing writes.

    runc's freezer is the cgroup's: whether it is frozen already is one small read of it, not a `runc state`
    (a Go binary's start-up, ~10 ms); runsc's is its own, so runsc is asked."""
    frozen_already = _cgroups.frozen(rec.cgroups_path) if rec.runtime == Runtime.RUNC else None
    if frozen_already is None:
        state = await runtime.state(rec.sandbox_id)
        frozen_already = state is not None and state.get("status") == "paused"
    if not frozen_already:
        await runtime.pause(rec.sandbox_id)
    try:
        yield
    finally:
        if not frozen_already:
            await asyncio.shield(runtime.resume(rec.sandbox_id))


class LocalSnapshots:
    """`LocalBackend`'s snapshots."""

    runtimes: dict[Runtime, OCIRuntime]
    layers: Layers
    # sandbox id -> (layer, KiB written to its disk when that layer was copied): a snapshot of a sandbox
    # whose disk has not been written since takes the same layer again instead of a copy (forks of one state).
    _captured: dict[str, tuple[str, int]]

    async def snapshot(self, record: BackendRecord, snapshot_id: str) -> SnapshotArtifact:
        rec = local_record(record)
        if len(rec.layers) + 1 > MAX_DEPTH:
            raise ConflictError(f"sandbox {rec.sandbox_id} already stands on {len(rec.layers)} snapshot layers; "
                                f"a snapshot of it would have more than {MAX_DEPTH}")
        if not rec.template:
            raise ConflictError(f"sandbox {rec.sandbox_id} was made by an older Corral and cannot be snapshotted")
        upper = rec.dir / "disk" / "upper"
        if _disk.is_mounted(rec.dir / "disk"):
            layer = await self._capture_frozen(rec, upper, snapshot_id)
        else:  # paused to disk: nothing runs, nothing to freeze
            await _disk.mount_image(rec.dir / "disk.img", rec.dir / "disk")
            try:
                layer = await self.layers.capture(upper, rec.uid_base, snapshot_id)
            finally:
                await _disk.unmount_all([rec.dir / "disk"])
        try:
            for below in rec.layers:
                self.layers.add_ref(below, snapshot_id)
        except BaseException:
            await self.delete_snapshot(SnapshotArtifact(snapshot_id, rec.template, 0,
                                                        {"layers": [layer, *rec.layers]}))
            raise
        return SnapshotArtifact(snapshot_id=snapshot_id, template=rec.template, size_bytes=self.layers.size(layer),
                                data={"layers": [layer, *rec.layers]})

    async def _capture_frozen(self, rec: LocalRecord, upper: Path, snapshot_id: str) -> str:
        """Copy the upper layer with every process of the sandbox frozen: a consistent instant, never torn."""
        async with processes_frozen(self.runtimes[rec.runtime], rec):
            written = await _disk.in_thread(_disk.written_kbytes, rec.dir / "disk")
            last = self._captured.get(rec.sandbox_id)
            if written is not None and last is not None and last[1] == written:
                with contextlib.suppress(NotFoundError):  # gone with its last holder: copy again
                    self.layers.add_ref(last[0], snapshot_id)
                    return last[0]
            layer = await self.layers.capture(upper, rec.uid_base, snapshot_id)
            if written is not None:
                await self._remember_capture(rec.sandbox_id, layer, written)
            return layer

    async def _remember_capture(self, sandbox_id: str, layer: str, written: int) -> None:
        """The sandbox holds its latest layer while it lives, so that the next snapshot of an unchanged disk
        (ten forks of one state) takes it again even if every snapshot and child of it is gone by then."""
        self.layers.add_ref(layer, sandbox_id)
        previous = self._captured.get(sandbox_id)
        self._captured[sandbox_id] = (layer, written)
        if previous is not None and previous[0] != layer:
            await self.layers.drop_ref(previous[0], sandbox_id)

    async def delete_snapshot(self, snapshot: SnapshotArtifact) -> None:
        for layer in check_layers(snapshot.data.get("layers", [])):
            await self.layers.drop_ref(layer, snapshot.snapshot_id)

    def _source_layers(self, source: SnapshotArtifact | None, template: Template) -> tuple[str, ...]:
        if source is None:
            return ()
        if source.template != template.digest:
            raise ConflictError(f"snapshot {source.snapshot_id} was taken on template {source.template[:12]}, "
                                f"not {template.digest[:12]}")
        try:
            return check_layers(source.data.get("layers"))
        except ValueError as exc:
            raise ServerError(f"snapshot {source.snapshot_id} is not one of this backend's: {exc}") from None
