"""A directory tree written as one reproducible, compressed image layer (a tar stream, gzip'd, hashed twice).

Same tree, same bytes: entries are sorted by name within each directory, owners are numeric (no user or group
names, which depend on the host's /etc/passwd), mtimes are whole seconds, and gzip writes neither a name nor a
timestamp. What a container runtime applies is kept: numeric owners, modes (setuid bits included), symlinks,
hard links (the first name in sort order carries the content, later ones link to it), FIFOs, and extended
attributes as PAX `SCHILY.xattr.*` records (as GNU tar, Docker and containerd write and read them). Device nodes
and sockets are left out: every sandbox gets its /dev from the runtime, and a socket is not a file.

Python's `tarfile` writes the archive rather than `tar(1)`: skipping entries by type, naming owners only by
number and pinning every header field is explicit here, and the stream is hashed as it is written (the layer's
`diff_id` and the blob's digest) without a second read of gigabytes.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ._process import Progress

__all__ = ["LayerBlob", "Normalize", "write_layer"]

_CHUNK = 1 << 20
_PROGRESS_EVERY = 256 << 20  # bytes of tar between two progress lines
GZIP_LEVEL = 6  # zlib's default: within a few percent of 9 on a root filesystem, at half the time


@dataclass(frozen=True)
class Normalize:
    """Metadata forced on every entry of a layer whose on-disk owners and times mean nothing (the agent's
    files: a private copy made by whoever ran Corral first). Executable files keep 0755, the rest get 0644."""

    uid: int = 0
    gid: int = 0
    mtime: int = 0


@dataclass(frozen=True)
class LayerBlob:
    """A written layer: where its blob is, and the two digests an image needs."""

    path: Path
    digest: str  # sha256 of the compressed blob: the manifest's layer digest
    diff_id: str  # sha256 of the uncompressed tar: the config's rootfs.diff_ids entry
    size: int  # compressed bytes
    tar_size: int  # uncompressed bytes
    skipped: int  # device nodes and sockets left out


class _HashingWriter(io.RawIOBase):
    """Hashes and counts the bytes written, then passes them to `inner`."""

    def __init__(self, inner: IO[bytes] | io.RawIOBase | gzip.GzipFile) -> None:
        super().__init__()
        self._inner = inner
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += len(view)
        self._inner.write(view)
        return len(view)

    def digest(self) -> str:
        return f"sha256:{self.sha256.hexdigest()}"


def write_layer(
    source: Path,
    dest: Path,
    *,
    prefix: str = "",
    normalize: Normalize | None = None,
    emit: Progress,
) -> LayerBlob:
    """Write the tree under `source` as a gzip'd tar to file `dest`, entries named `prefix` + their path.

    `prefix` ("a/b/") also gets a directory entry per component. Raises `OSError` if the tree cannot be read.
    """
    with open(dest, "xb") as out:
        packed = _HashingWriter(out)
        with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=packed, mtime=0) as gz:
            plain = _HashingWriter(gz)
            writer = _TreeWriter(plain, normalize, emit)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
                writer.tar = tar
                writer.add_prefix(prefix)
                writer.add_tree(source, prefix)
    return LayerBlob(dest, packed.digest(), plain.digest(), packed.size, plain.size, writer.skipped)


class _TreeWriter:
    def __init__(self, counter: _HashingWriter, normalize: Normalize | None, emit: Progress) -> None:
        self.tar: tarfile.TarFile | None = None
        self.skipped = 0
        self._counter = counter
        self._normalize = normalize
        self._emit = emit
        self._links: dict[tuple[int, int], str] = {}
        self._next_report = _PROGRESS_EVERY

    def add_prefix(self, prefix: str) -> None:
        parts = [p for p in prefix.split("/") if p]
        for i in range(1, len(parts) + 1):
            info = tarfile.TarInfo("/".join(parts[:i]) + "/")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            self._pin(info, 0)
            self._add(info)

    def add_tree(self, directory: Path, prefix: str) -> None:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: os.fsencode(e.name))
        for entry in entries:
            name = prefix + entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self._add_entry(Path(entry.path), name + "/", st)
                self.add_tree(Path(entry.path), name + "/")
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                self.skipped += 1
            else:
                self._add_entry(Path(entry.path), name, st)

    def _add_entry(self, path: Path, name: str, st: os.stat_result) -> None:
        info = tarfile.TarInfo(name)
        info.mode = stat.S_IMODE(st.st_mode)
        info.uid, info.gid = st.st_uid, st.st_gid
        info.pax_headers = _xattrs(path)
        inode = (st.st_dev, st.st_ino)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
        elif st.st_nlink > 1 and inode in self._links:
            info.type, info.linkname = tarfile.LNKTYPE, self._links[inode]
        else:
            if st.st_nlink > 1:
                self._links[inode] = name
            info.size = st.st_size
            self._pin(info, int(st.st_mtime))
            with _open_regular(path) as content:
                self._add(info, content)
            return
        self._pin(info, int(st.st_mtime))
        self._add(info)

    def _pin(self, info: tarfile.TarInfo, mtime: int) -> None:
        info.uname = info.gname = ""
        info.mtime = mtime
        if self._normalize is not None:
            info.uid, info.gid, info.mtime = self._normalize.uid, self._normalize.gid, self._normalize.mtime
            if not info.isdir():
                info.mode = 0o755 if info.mode & 0o111 else 0o644

    def _add(self, info: tarfile.TarInfo, content: IO[bytes] | None = None) -> None:
        assert self.tar is not None
        self.tar.addfile(info, content)
        if self._counter.size >= self._next_report:
            self._emit(f"    {self._counter.size / 1e6:.0f} MB archived")
            self._next_report += _PROGRESS_EVERY


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[IO[bytes]]:
    # O_NOFOLLOW: the entry was a regular file when listed; a symlink swapped in since is never followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=_CHUNK) as f:
        yield f


def _xattrs(path: Path) -> dict[str, str]:
    """The entry's extended attributes as PAX records; values are bytes, carried through surrogateescape."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # a filesystem without xattrs
        return {}
    records = {}
    for name in sorted(names):
        with contextlib.suppress(OSError):
            value = os.getxattr(path, name, follow_symlinks=False)
            records[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
    return records
