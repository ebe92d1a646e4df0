"""A sandbox's checkpoint store: manifests, immutable objects and the index that makes a checkpoint cheap.

Layout under the store's root (root's, 0700; the sandbox never sees it):

    manifests/<ckpt-id>.json   every entry of the upper directory at that checkpoint (`_entries.Entry`)
    objects/o-<16 hex>         the bytes of one regular file as it was, shared by every manifest that has it
    index.json                 upper path -> (stat identity, object) as of the last checkpoint or restore

A checkpoint walks the upper directory with one lstat per entry; a file whose identity is the one in the index
takes the indexed object again without being read, so a checkpoint costs the walk plus what changed since the
last one. A restore rewrites only what differs (`_apply`). Objects no manifest names are removed when a
checkpoint is deleted (`delete`), and the index forgets them.

Every method is blocking (call it in a thread) and expects the caller to serialise calls on one store and to
have frozen (or stopped) whatever writes the upper directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._atomic import write_atomic
from ..._exceptions import NotFoundError
from .._contract import PathChange
from ._apply import apply, in_scope
from ._diff import Lowers, diff, hidden, read_lower
from ._entries import Entry, Identity, entry_from_stat, identity, walk
from ._objects import Objects, capacity_error, full_disk

__all__ = ["CheckpointStore", "relative"]

_CHECKPOINT_ID = re.compile(r"ckpt-[0-9a-z][0-9a-z-]{3,62}")
Index = dict[str, tuple[Identity, str]]


def relative(path: str) -> str:
    """A sandbox path ("/workspace/a") as a path in the upper directory ("workspace/a")."""
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise ValueError(f"not a normalised sandbox path: {path!r}")
    return "/".join(parts)


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = Objects(root / "objects")

    # -- taking one -----------------------------------------------------------------------------------

    def capture(self, upper: Path, uid_base: int, checkpoint_id: str) -> int:
        """Record `upper` as checkpoint `checkpoint_id`; the bytes it added (new objects and its manifest).
        `CapacityError` when they do not fit; then nothing of it is kept."""
        self._make_dirs()
        index = self._index()
        added: list[str] = []
        try:
            entries, new_index, size = self._scan(upper, uid_base, index, added)
            size += self._write_manifest(checkpoint_id, entries)
            self._write_index(new_index)
        except BaseException as exc:
            self.objects.remove(set(added))
            self._manifest_path(checkpoint_id).unlink(missing_ok=True)
            if isinstance(exc, OSError) and full_disk(exc):
                raise capacity_error(exc, f"checkpoint {checkpoint_id}") from exc
            raise
        return size

    def _scan(self, upper: Path, uid_base: int, index: Index, added: list[str]) -> tuple[list[Entry], Index, int]:
        entries: list[Entry] = []
        new_index: Index = {}
        size = 0
        first_name: dict[int, str] = {}  # inode -> the smallest path of a hard-linked file
        by_inode: dict[int, str] = {}  # inode -> its object, in this scan
        for rel, st in walk(upper):
            entry = entry_from_stat(upper, rel, st, uid_base)
            if entry.kind == "file":
                if st.st_nlink > 1:
                    first_name[st.st_ino] = min(first_name.get(st.st_ino, rel), rel)
                ident = identity(st)
                known = index.get(rel)
                if known is not None and tuple(known[0]) == ident:
                    object_id = known[1]
                elif st.st_nlink > 1 and st.st_ino in by_inode:  # another name of a file copied already
                    object_id = by_inode[st.st_ino]
                else:
                    object_id, stored = self.objects.store(upper / rel)
                    added.append(object_id)
                    size += stored
                new_index[rel] = (ident, object_id)
                by_inode[st.st_ino] = object_id
                entry = entry.with_object(object_id)
            entries.append(entry)
        return _link_names(entries, new_index, first_name), new_index, size

    # -- reading ones back -------------------------------------------------------------------------------

    def has(self, checkpoint_id: str) -> bool:
        return self._manifest_path(checkpoint_id).is_file()

    def manifest(self, checkpoint_id: str) -> dict[str, Entry]:
        try:
            data = json.loads(self._manifest_path(checkpoint_id).read_bytes())
        except FileNotFoundError:
            raise NotFoundError(f"checkpoint {checkpoint_id} is gone from this sandbox's store",
                                details={"checkpoint_id": checkpoint_id}) from None
        entries = (Entry.from_json(item) for item in data["entries"])
        return {entry.path: entry for entry in entries}

    def now(self, upper: Path, uid_base: int) -> dict[str, Entry]:
        """The upper directory as a manifest would have it, without copying: a file unchanged since the index
        has its object, a changed one a name no object has (so it differs from every checkpoint)."""
        index = self._index()
        found: dict[str, Entry] = {}
        for rel, st in walk(upper):
            entry = entry_from_stat(upper, rel, st, uid_base)
            if entry.kind == "file":
                known = index.get(rel)
                same = known is not None and tuple(known[0]) == identity(st)
                entry = entry.with_object(known[1] if same and known else f"changed:{st.st_ino}")
            found[rel] = entry
        return found

    def changes(self, since: str, until: str | None, upper: Path, uid_base: int,
                lowers: Lowers) -> list[PathChange]:
        before = self.manifest(since)
        after = self.manifest(until) if until is not None else self.now(upper, uid_base)
        return diff(before, after, lowers, self.objects, upper if until is None else None)

    def read(self, checkpoint_id: str, path: str, limit: int, lowers: Lowers) -> bytes | None:
        manifest = self.manifest(checkpoint_id)
        rel = relative(path)
        parts = rel.split("/")
        entry = manifest.get(rel)
        if entry is None:
            return None if hidden(manifest, parts) else read_lower(lowers, rel, limit)
        if entry.kind != "file" or entry.object is None:
            return None
        first = manifest.get(entry.link) if entry.link else entry
        return self.objects.read(first.object, limit) if first and first.object else None

    # -- restoring -----------------------------------------------------------------------------------------

    def restore(self, upper: Path, uid_base: int, checkpoint_id: str, paths: Sequence[str] | None = None) -> None:
        """Make `upper` what checkpoint `checkpoint_id` recorded (only `paths`, sandbox paths, if given).
        `CapacityError` if the disk cannot take it back (what was restored so far stays)."""
        manifest = self.manifest(checkpoint_id)
        scopes = None if paths is None else sorted({relative(p) for p in paths} - {""}) or None
        index = self._index()
        try:
            made = apply(upper, uid_base, manifest, index, self.objects, scopes)
        except OSError as exc:
            if full_disk(exc):
                raise capacity_error(exc, f"restoring checkpoint {checkpoint_id}") from exc
            raise
        kept = {p: v for p, v in index.items() if not in_scope(p, scopes)} if scopes is not None else {}
        self._write_index({**kept, **made})

    # -- deleting, size -----------------------------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        """Forget the checkpoint and remove the objects no other one names. Idempotent."""
        self._manifest_path(checkpoint_id).unlink(missing_ok=True)
        self.collect()

    def collect(self) -> None:
        referenced: set[str] = set()
        for name in self._manifest_names():
            with contextlib.suppress(NotFoundError, ValueError, KeyError):
                referenced |= {e.object for e in self.manifest(name).values() if e.object}
        self.objects.remove(self.objects.all() - referenced)
        index = self._index()
        self._write_index({p: v for p, v in index.items() if v[1] in referenced})

    def size(self) -> int:
        """Bytes the store takes on its disk now."""
        if not self.root.is_dir():
            return 0
        total = self.objects.bytes_used() if self.objects.root.is_dir() else 0
        for path in [self.root / "index.json", *(self.root / "manifests").glob("*.json")]:
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_blocks * 512
        return total

    # -- files ------------------------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        for path in (self.root, self.root / "manifests", self.objects.root):
            path.mkdir(mode=0o700, exist_ok=True)

    def _manifest_path(self, checkpoint_id: str) -> Path:
        if not _CHECKPOINT_ID.fullmatch(checkpoint_id):
            raise ValueError(f"not a checkpoint id: {checkpoint_id!r}")
        return self.root / "manifests" / f"{checkpoint_id}.json"

    def _manifest_names(self) -> list[str]:
        try:
            return [p.stem for p in (self.root / "manifests").glob("ckpt-*.json")]
        except FileNotFoundError:
            return []

    def _write_manifest(self, checkpoint_id: str, entries: list[Entry]) -> int:
        data = json.dumps({"version": 1, "entries": [e.to_json() for e in entries]}, separators=(",", ":"))
        encoded = data.encode()
        write_atomic(self._manifest_path(checkpoint_id), encoded, durable=False)
        return len(encoded)

    def _index(self) -> Index:
        try:
            data: dict[str, Any] = json.loads((self.root / "index.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return {}
        return {path: (tuple(v[0]), str(v[1])) for path, v in data.items()}

    def _write_index(self, index: Index) -> None:
        self.root.mkdir(mode=0o700, exist_ok=True)
        encoded = json.dumps({p: [list(v[0]), v[1]] for p, v in index.items()}, separators=(",", ":")).encode()
        write_atomic(self.root / "index.json", encoded, durable=False)


def _link_names(entries: list[Entry], index: Index, first_name: dict[int, str]) -> list[Entry]:
    """A hard-linked file's other names point at its first (smallest) path, which alone holds the object."""
    if not first_name:
        return entries
    out: list[Entry] = []
    for entry in entries:
        ident = index.get(entry.path)
        first = first_name.get(ident[0][0]) if ident is not None else None
        out.append(entry.with_object(entry.object, first) if first is not None and first != entry.path else entry)
    return out


