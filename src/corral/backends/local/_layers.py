"""Snapshot layers: a sandbox's writable layer at one instant, kept read-only to start other sandboxes on.

A snapshot of a local sandbox is the copy of its overlay's upper directory (its own files, whiteouts of deleted
template files, opaque directories) taken while its processes are frozen; a sandbox started from the snapshot
gets it as a lower layer between its own empty upper and the template. A sandbox started from a snapshot of a
sandbox that itself came from one has both layers: a chain, newest first, of at most `MAX_DEPTH`.

Layers live under `<home>/layers/<id>/`, beside `templates/` (not in it: a home may share another's templates
through a link, and its layers and their holders are its own):

    tree/    the files, owned canonically (`_idmap.CANONICAL_BASE + id`): the sandbox's own range is shifted
             out while copying (through an idmapped view of the upper), and every sandbox that uses the layer
             sees it through an idmapped mount onto its own range. No chown pass, in either direction.
    refs/    one empty file per holder: a snapshot (`snap-...`) or a sandbox (`sb-...`) using it. The layer is
             removed with its last reference, so deleting a snapshot never breaks a sandbox started from it.
    size     the bytes of `tree/` (the figure a tenant's snapshot quota counts)

Holders are files, not counts in memory: they survive a restart of the engine, and `sweep` can drop references
of sandboxes that no longer exist.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

from ..._exceptions import NotFoundError
from .. import _idmap
from ._disk import in_thread, unmount_all
from ._system import run

__all__ = ["MAX_DEPTH", "Layers"]

MAX_DEPTH = 32  # overlayfs takes up to 500 lower layers; each one costs an idmapped mount at every start
_LAYER_ID = re.compile(r"l-[0-9a-f]{16}")
_HOLDER = re.compile(r"(sb|snap)-[a-z0-9][a-z0-9-]{3,62}")
COPY_TIMEOUT = 600.0


class Layers:
    def __init__(self, root: Path) -> None:
        # Resolved: the mount table names mount points by their real path, and the copy's view is found there.
        self.root = root.resolve()

    def tree(self, layer_id: str) -> Path:
        path = self._dir(layer_id) / "tree"
        if not path.is_dir():
            raise NotFoundError(f"snapshot layer {layer_id} is gone from {self.root}")
        return path

    def size(self, layer_id: str) -> int:
        try:
            return int((self._dir(layer_id) / "size").read_text())
        except (OSError, ValueError):
            return 0

    async def capture(self, upper: Path, uid_base: int, holder: str) -> str:
        """Copy `upper` (a sandbox's, frozen by the caller) into a new layer held by `holder`; its id."""
        layer_id = f"l-{secrets.token_hex(8)}"
        path = self._dir(layer_id)
        (path / "refs").mkdir(parents=True, mode=0o700)
        os.chmod(self.root, 0o711)  # noqa: S103 - traverse only: overlayfs resolves lower layers as root anyway
        (path / "tree").mkdir(mode=0o755)
        view = path / "source"
        view.mkdir(mode=0o700)
        try:
            self.add_ref(layer_id, holder)
            await in_thread(_bind_view, upper, view, uid_base)
            try:
                # -a keeps owners (shifted by the view), modes, times, hard links, xattrs (overlayfs' opaque
                # and redirect marks) and device nodes (its whiteouts); reflinks where the filesystem can.
                await run(["cp", "-a", "--reflink=auto", "--", f"{view}/.", f"{path / 'tree'}/"],
                          what="copying the sandbox's files into a snapshot", timeout=COPY_TIMEOUT)
            finally:
                await unmount_all([view])
            view.rmdir()
            size = await in_thread(_tree_size, path / "tree")
            (path / "size").write_text(str(size))
        except BaseException:
            with contextlib.suppress(Exception):
                await unmount_all([view])
            await in_thread(shutil.rmtree, path, True)
            raise
        return layer_id

    def add_ref(self, layer_id: str, holder: str) -> None:
        if not _HOLDER.fullmatch(holder):
            raise ValueError(f"not a layer holder: {holder!r}")
        refs = self._dir(layer_id) / "refs"
        if not refs.is_dir():
            raise NotFoundError(f"snapshot layer {layer_id} is gone from {self.root}")
        (refs / holder).touch()

    async def drop_ref(self, layer_id: str, holder: str) -> None:
        """Forget `holder`; the layer goes with its last holder."""
        path = self._dir(layer_id)
        with contextlib.suppress(FileNotFoundError):
            (path / "refs" / holder).unlink()
        try:
            if any((path / "refs").iterdir()):
                return
        except FileNotFoundError:
            return
        await in_thread(shutil.rmtree, path, True)

    def holders(self) -> dict[str, list[str]]:
        """Every layer and its holders (for `sweep`)."""
        found: dict[str, list[str]] = {}
        if not self.root.is_dir():
            return found
        for entry in self.root.iterdir():
            if _LAYER_ID.fullmatch(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    found[entry.name] = sorted(p.name for p in (entry / "refs").iterdir())
        return found

    def _dir(self, layer_id: str) -> Path:
        if not _LAYER_ID.fullmatch(layer_id):
            raise ValueError(f"not a layer id: {layer_id!r}")
        return self.root / layer_id


def check_layers(layers: object) -> tuple[str, ...]:
    """The layer ids of a snapshot artifact's data, checked (`ValueError` if not a list of ids)."""
    if not isinstance(layers, list | tuple) or not all(isinstance(x, str) and _LAYER_ID.fullmatch(x) for x in layers):
        raise ValueError(f"not a list of layer ids: {layers!r}")
    if len(layers) > MAX_DEPTH:
        raise ValueError(f"{len(layers)} layers is more than {MAX_DEPTH}")
    return tuple(layers)


def mount_views(trees: list[Path], targets: list[Path], uid_base: int) -> None:
    """Mount each layer's tree on its target, idmapped onto the sandbox's range. Blocking: call it in a thread."""
    if not trees:
        return
    with _idmap.user_namespace(_idmap.canonical_to_sandbox(uid_base)) as userns:
        for tree, target in zip(trees, targets, strict=True):
            target.mkdir(mode=0o700, exist_ok=True)
            _idmap.idmapped_bind(tree, target, userns)


def _bind_view(upper: Path, view: Path, uid_base: int) -> None:
    with _idmap.user_namespace(_idmap.sandbox_to_canonical(uid_base)) as userns:
        _idmap.idmapped_bind(upper, view, userns, noatime=True)


def _tree_size(tree: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [*dirnames, *filenames]:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total
