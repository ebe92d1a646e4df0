"""`corral cp SRC DST`: copy files and directories into and out of a sandbox; one side is `ID:PATH`.

Like `docker cp`: a directory lands *inside* a destination directory that exists, and *becomes* a destination
that does not. Files travel through `/files`, directories as tar through `/archive`, both streamed chunk by
chunk (never whole in memory), with a progress bar on a terminal for large transfers. `-` is stdin (uploaded as
one file) or stdout (a file's bytes, or a directory's tar stream).

The tar for an upload is generated here block by block (header, content, padding) rather than by `tarfile`
writing into a buffer, so a large file is read in chunks while it is sent. A downloaded tar is extracted with
`tarfile`'s `data` filter: nothing lands outside the destination, and links that would lead out are skipped
with a notice.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .._exceptions import InvalidRequestError, NotFoundError
from .._sdk._transport import SyncClient, json_dict, sandbox_path
from ._common import ApiKeyOption, UrlOption, client, note

CHUNK = 1024 * 1024
PROGRESS_MIN_BYTES = 8 * 1024 * 1024  # smaller transfers finish before a bar is worth drawing
_BLOCK = tarfile.BLOCKSIZE
_OCTETS = {"Content-Type": "application/octet-stream"}
_TAR = {"Content-Type": "application/x-tar"}

console = Console(stderr=True)


class _Bar:
    """A byte-counting progress bar on stderr, only on a terminal and only for a transfer worth showing."""

    def __init__(self, what: str, total: int | None) -> None:
        self._progress: Progress | None = None
        if console.is_terminal and (total is None or total >= PROGRESS_MIN_BYTES):
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                                      transient=True)
            self._task = self._progress.add_task(what, total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def __enter__(self) -> _Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()


def parse_remote(arg: str) -> tuple[str, str] | None:
    """`ID:PATH` -> (id, path); a local path (with no `:` before its first `/`, or `-`) -> None."""
    head, sep, tail = arg.partition(":")
    if not sep or not head or "/" in head:
        return None
    return head, tail or "/workspace"


def cp(
    src: str = typer.Argument(..., help="LOCAL, ID:PATH, or - (stdin)."),
    dst: str = typer.Argument(..., help="LOCAL, ID:PATH, or - (stdout)."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Copy a file or directory into a sandbox (LOCAL ID:PATH) or out of one (ID:PATH LOCAL).

    A relative sandbox PATH is inside /workspace. A directory goes inside DST if DST is an existing directory,
    and becomes DST otherwise. Write a local path that has a colon as ./a:b.
    """
    remote_src, remote_dst = parse_remote(src), parse_remote(dst)
    if (remote_src is None) == (remote_dst is None):
        raise typer.BadParameter("exactly one of SRC and DST must be a sandbox path, ID:PATH")
    http = client(url, api_key)
    try:
        if remote_dst is not None:
            upload(http, src, *remote_dst)
        else:
            assert remote_src is not None
            download(http, *remote_src, dst)
    finally:
        http.close()


# -- sandbox side --------------------------------------------------------------------------------------------


def _stat(http: SyncClient, sandbox_id: str, path: str) -> dict[str, Any] | None:
    """The sandbox entry at `path`, or None if there is none (a missing sandbox fails on the next call)."""
    try:
        data = http.request("GET", sandbox_path(sandbox_id, "/files/stat"), params={"path": path})
    except NotFoundError:
        return None
    return json_dict(data, "a file entry")


def _is_dir(entry: dict[str, Any] | None) -> bool:
    return entry is not None and entry.get("type") in ("dir", "directory")


# -- upload ---------------------------------------------------------------------------------------------------


def upload(http: SyncClient, src: str, sandbox_id: str, path: str) -> None:
    if src == "-":
        if path.endswith("/"):
            raise InvalidRequestError(f"{path!r} is a directory: name the file to write stdin to")
        with _Bar("stdin", None) as bar:
            _put_file(http, sandbox_id, path, _read_chunks(sys.stdin.buffer, bar.advance), None)
        return
    local = Path(src)
    info = os.stat(local)  # a missing local file fails here, before anything is sent
    target = _stat(http, sandbox_id, path)
    if stat.S_ISDIR(info.st_mode):
        _upload_dir(http, local, sandbox_id, path, target)
        return
    if path.endswith("/") or _is_dir(target):
        path = posixpath.join(path, local.name)
    with open(local, "rb") as f, _Bar(local.name, info.st_size) as bar:
        _put_file(http, sandbox_id, path, _read_chunks(f, bar.advance), stat.S_IMODE(info.st_mode))


def _put_file(http: SyncClient, sandbox_id: str, path: str, chunks: Iterator[bytes], mode: int | None) -> None:
    params = {"path": path} | ({} if mode is None else {"mode": str(mode)})
    http.request("PUT", sandbox_path(sandbox_id, "/files"), params=params, content=chunks, headers=_OCTETS)


def _upload_dir(http: SyncClient, local: Path, sandbox_id: str, path: str, target: dict[str, Any] | None) -> None:
    if target is not None and not _is_dir(target):
        raise InvalidRequestError(f"cannot copy directory {str(local)!r} onto file {path!r} in {sandbox_id}")
    # Into an existing directory: as <dir>/<name>; to a new path: the directory's contents become that path.
    arcname = local.resolve().name if target is not None else "."
    total = _tree_size(local) if console.is_terminal else None
    with _Bar(f"{local.name}/", total) as bar:
        http.request("PUT", sandbox_path(sandbox_id, "/archive"), params={"path": path},
                     content=tar_stream(local, arcname, bar.advance), headers=_TAR)


def _read_chunks(f: BinaryIO, advance: Callable[[int], None]) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        advance(len(chunk))
        yield chunk


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def tar_stream(root: Path, arcname: str, advance: Callable[[int], None] = lambda n: None) -> Iterator[bytes]:
    """A POSIX (pax) tar of `root` named `arcname`, generated lazily: each file is read in chunks as it is sent."""
    for path, name in _walk(root, arcname):
        info = _tarinfo(path, name)
        if info is None:
            note(f"corral cp: skipped {path}: not a file, directory or symlink")
            continue
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if info.isreg():
            yield from _file_blocks(path, info.size, advance)
    yield tarfile.NUL * (2 * _BLOCK)  # end of archive


def _walk(path: Path, name: str) -> Iterator[tuple[Path, str]]:
    yield path, name
    if stat.S_ISDIR(os.lstat(path).st_mode):  # a symlink to a directory is sent as a link, never followed
        for child in sorted(os.scandir(path), key=lambda e: e.name):
            yield from _walk(Path(child.path), f"{name}/{child.name}")


def _tarinfo(path: Path, name: str) -> tarfile.TarInfo | None:
    st = os.lstat(path)
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISREG(st.st_mode):
        info.size = st.st_size
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(path)
    else:
        return None
    return info


def _file_blocks(path: Path, size: int, advance: Callable[[int], None]) -> Iterator[bytes]:
    """Exactly `size` bytes of the file (as its header promised), then zeros up to the next 512-byte block."""
    left = size
    with open(path, "rb") as f:
        while left:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                raise InvalidRequestError(f"{path} shrank while it was being copied; copy it again")
            left -= len(chunk)
            advance(len(chunk))
            yield chunk
    if size % _BLOCK:
        yield tarfile.NUL * (_BLOCK - size % _BLOCK)


# -- download -------------------------------------------------------------------------------------------------


def download(http: SyncClient, sandbox_id: str, path: str, dst: str) -> None:
    entry = _stat(http, sandbox_id, path)
    if entry is None:
        # Let the server say which is missing, the sandbox or the path.
        http.request("GET", sandbox_path(sandbox_id))
        raise NotFoundError(f"{path}: no such file or directory in {sandbox_id}", details={"path": path})
    name = posixpath.basename(str(entry.get("path") or path).rstrip("/")) or "root"
    if _is_dir(entry):
        _download_dir(http, sandbox_id, path, dst, name)
    else:
        _download_file(http, sandbox_id, path, dst, name, entry)


def _download_file(http: SyncClient, sandbox_id: str, path: str, dst: str, name: str,
                   entry: dict[str, Any]) -> None:
    size = int(entry.get("size") or 0)
    with http.stream("GET", sandbox_path(sandbox_id, "/files"), params={"path": path}) as response, \
            _Bar(name, size) as bar:
        chunks = _counted(response.iter_bytes(CHUNK), bar.advance)
        if dst == "-":
            _copy_out(chunks, sys.stdout.buffer)
            return
        target = Path(dst) / name if Path(dst).is_dir() else Path(dst)
        _write_atomically(target, chunks, int(entry.get("mode") or 0o644) & 0o777)


def _download_dir(http: SyncClient, sandbox_id: str, path: str, dst: str, name: str) -> None:
    with http.stream("GET", sandbox_path(sandbox_id, "/archive"), params={"path": path}) as response, \
            _Bar(f"{name}/", None) as bar:
        chunks = _counted(response.iter_bytes(CHUNK), bar.advance)
        if dst == "-":
            _copy_out(chunks, sys.stdout.buffer)  # the tar stream itself, like `docker cp ID:PATH -`
            return
        local = Path(dst)
        if local.is_dir():
            extract(chunks, local, top=name)
        else:
            local.parent.mkdir(parents=True, exist_ok=True)
            extract(chunks, local.parent, top=local.name)


def _counted(chunks: Iterator[bytes], advance: Callable[[int], None]) -> Iterator[bytes]:
    for chunk in chunks:
        advance(len(chunk))
        yield chunk


def _copy_out(chunks: Iterator[bytes], out: BinaryIO) -> None:
    for chunk in chunks:
        out.write(chunk)
    out.flush()


def _write_atomically(target: Path, chunks: Iterator[bytes], mode: int) -> None:
    """Write next to `target` and rename: a failed download never leaves a truncated file under its name."""
    tmp = target.with_name(f".{target.name}.corral-cp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def extract(chunks: Iterator[bytes], dest: Path, *, top: str) -> None:
    """Extract a tar stream into `dest`, its first path component renamed to `top`, nothing outside `dest`."""
    reader = io.BufferedReader(_ChunkReader(chunks), CHUNK)
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        # Safe: every member goes through tarfile's `data` filter (no escape from `dest`, no special files).
        tar.extractall(dest, filter=_renaming_filter(top))  # noqa: S202


def _renaming_filter(top: str) -> Callable[[tarfile.TarInfo, str], tarfile.TarInfo | None]:
    def rename(name: str) -> str:
        rest = name.strip("/").split("/", 1)
        return top if len(rest) == 1 else f"{top}/{rest[1]}"

    def member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        changes: dict[str, Any] = {"name": rename(member.name)}
        if member.islnk():  # hard links name another member of the archive
            changes["linkname"] = rename(member.linkname)
        try:
            return tarfile.data_filter(member.replace(**changes, deep=False), dest)
        except tarfile.FilterError as exc:
            note(f"corral cp: skipped {member.name}: {exc}")
            return None

    return member_filter


class _ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks, so `tarfile` can read a response as it arrives."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buffer))
        b[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

