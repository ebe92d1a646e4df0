"""`FakeCheckpointing`: the backend's optional `Checkpointing`, over the fake agent's file tree (`<World.dir>/<id>.fs`).

A checkpoint is a copy of that tree (symlinks as links, /tmp left out as the real backends leave tmpfs out) in
`<World.dir>/<id>.ckpt/<checkpoint id>`; restore copies it (or some paths of it) back; changes compare two trees
(or one and the tree now). `size_bytes` is the bytes of the regular files it holds. `checkpoint_room` (bytes all
of a sandbox's checkpoints may hold; None: no bound) makes a checkpoint that does not fit a `CapacityError`, as a
full disk would.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from corral import CapacityError, NotFoundError
from corral.backends import BackendRecord, CheckpointArtifact, PathChange

if TYPE_CHECKING:
    from .fakes import World

__all__ = ["FakeCheckpointing"]

_LEFT_OUT = ("tmp",)  # memory in a real sandbox: never part of a checkpoint


def _entries(root: Path) -> dict[str, os.stat_result]:
    """Sandbox path -> lstat of every entry under `root` (but /tmp)."""
    found: dict[str, os.stat_result] = {}
    if not root.is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d not in _LEFT_OUT]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            found["/" + (rel / name).as_posix().removeprefix("./")] = path.lstat()
    return found


def _type(st: os.stat_result) -> Literal["file", "dir", "symlink", "other"]:
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return "symlink" if stat.S_ISLNK(st.st_mode) else "other"


def _size(st: os.stat_result) -> int:
    return st.st_size if not stat.S_ISDIR(st.st_mode) else 0


class FakeCheckpointing:
    world: World
    calls: list[tuple[str, str]]
    checkpoint_room: int | None = None

    def _fs(self, sandbox_id: str) -> Path:
        return self.world.dir / f"{sandbox_id}.fs"

    def _kept(self, sandbox_id: str, checkpoint_id: str | None = None) -> Path:
        base = self.world.dir / f"{sandbox_id}.ckpt"
        return base if checkpoint_id is None else base / checkpoint_id

    def _existing(self, record: BackendRecord, checkpoint: CheckpointArtifact) -> Path:
        kept = self._kept(record.sandbox_id, checkpoint.checkpoint_id)
        if not kept.is_dir():
            raise NotFoundError(f"the fake backend has no checkpoint {checkpoint.checkpoint_id}")
        return kept

    async def checkpoint(self, record: BackendRecord, checkpoint_id: str) -> CheckpointArtifact:
        self.calls.append(("checkpoint", record.sandbox_id))
        source = self._fs(record.sandbox_id)
        size = sum(st.st_size for st in _entries(source).values() if stat.S_ISREG(st.st_mode))
        if self.checkpoint_room is not None and await self.checkpoints_size(record) + size > self.checkpoint_room:
            raise CapacityError(f"the fake disk of {record.sandbox_id} has no room for a checkpoint of {size} bytes")
        target = self._kept(record.sandbox_id, checkpoint_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=lambda d, _: _LEFT_OUT if Path(d) == source else ())
        else:
            target.mkdir()
        return CheckpointArtifact(checkpoint_id=checkpoint_id, size_bytes=size, data={"fake": True})

    async def restore_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact,
                                 paths: Sequence[str] | None = None) -> None:
        self.calls.append(("restore_checkpoint", record.sandbox_id))
        kept, live = self._existing(record, checkpoint), self._fs(record.sandbox_id)
        for path in paths if paths is not None else ["/" + p.name for p in [*kept.iterdir(), *live.iterdir()]
                                                     if p.name not in _LEFT_OUT]:
            rel = path.strip("/")
            here, there = live / rel, kept / rel
            if here.is_symlink() or here.is_file():
                here.unlink()
            elif here.is_dir():
                shutil.rmtree(here)
            if there.is_symlink() or there.is_file():
                here.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(there, here, follow_symlinks=False)
            elif there.is_dir():
                shutil.copytree(there, here, symlinks=True)

    async def checkpoint_changes(self, record: BackendRecord, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> list[PathChange]:
        before = _entries(self._existing(record, since))
        after = _entries(self._fs(record.sandbox_id) if until is None else self._existing(record, until))
        changes: list[PathChange] = []
        for path in sorted(before.keys() | after.keys()):
            old, new = before.get(path), after.get(path)
            if old is None and new is not None:
                changes.append(PathChange(path, "added", _size(new), None, _type(new)))
            elif new is None and old is not None:
                changes.append(PathChange(path, "deleted", None, _size(old), _type(old)))
            elif old is not None and new is not None:
                if _type(old) != _type(new) or (stat.S_ISREG(new.st_mode) and not self._same(
                        record, since, until, path, old, new)):
                    changes.append(PathChange(path, "modified", _size(new), _size(old), _type(new)))
                elif stat.S_IMODE(old.st_mode) != stat.S_IMODE(new.st_mode):
                    changes.append(PathChange(path, "mode", _size(new), _size(old), _type(new)))
        return changes

    def _same(self, record: BackendRecord, since: CheckpointArtifact, until: CheckpointArtifact | None, path: str,
              old: os.stat_result, new: os.stat_result) -> bool:
        """Same contents (compared, not by mtime: the fake agent rewrites /etc/passwd as it starts)."""
        if old.st_size != new.st_size:
            return False
        rel = path.strip("/")
        after = self._fs(record.sandbox_id) if until is None else self._existing(record, until)
        return (self._existing(record, since) / rel).read_bytes() == (after / rel).read_bytes()

    async def checkpoint_read(self, record: BackendRecord, checkpoint: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None:
        file = self._existing(record, checkpoint) / path.strip("/")
        if file.is_symlink() or not file.is_file():
            return None
        with file.open("rb") as f:
            return f.read(limit)

    async def delete_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact) -> None:
        self.calls.append(("delete_checkpoint", checkpoint.checkpoint_id))
        shutil.rmtree(self._kept(record.sandbox_id, checkpoint.checkpoint_id), ignore_errors=True)

    async def checkpoints_size(self, record: BackendRecord) -> int:
        return sum(st.st_size for st in _entries(self._kept(record.sandbox_id)).values()
                   if stat.S_ISREG(st.st_mode))

    def forget_checkpoints(self, sandbox_id: str) -> None:
        """The sandbox is destroyed: its checkpoints went with its disk."""
        shutil.rmtree(self._kept(sandbox_id), ignore_errors=True)
