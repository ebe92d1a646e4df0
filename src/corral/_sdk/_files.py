"""`sb.files`: a sandbox's files as exact bytes, streamed both ways. Relative paths resolve against `/workspace`.

Every method takes `user`: who opens the files inside the sandbox (the kernel checks each path as that user's,
and what it makes is that user's). None is the sandbox user; `"root"` needs a sandbox created with `root=True`
(else `PermissionDeniedError`)."""

from __future__ import annotations

import builtins
import inspect
import io
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import IO, Any

from .._exceptions import InvalidRequestError
from ._models import Entry
from ._transport import UPLOAD_CHUNK, AsyncBufferBody, AsyncClient, BufferBody, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncFiles", "AsyncWriteData", "Files", "PathLike", "WriteData"]

PathLike = str | os.PathLike[str]
# What an upload takes. A bytes-like object is sent in place (not copied): leave it as it is until the write
# returns. A file object or an iterable is streamed in chunks, as it yields them.
WriteData = bytes | bytearray | memoryview | str | IO[bytes] | Iterable[bytes]
AsyncWriteData = WriteData | AsyncIterable[bytes]


_OCTET_HEADERS = {"Content-Type": "application/octet-stream"}


def _fspath(path: PathLike) -> str:
    """The path as the API takes it; a lone surrogate (undecodable bytes from `os.fsdecode`) is refused here,
    clearly, since no UTF-8 request can carry it (found by the eval corpus: it used to escape as a
    UnicodeEncodeError)."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"path {text!r} is not valid Unicode: position {exc.start} holds a lone surrogate (undecodable bytes); "
            "sandbox paths travel as UTF-8") from exc
    return text


def _at(path: PathLike, user: str | None = None) -> dict[str, str]:
    return {"path": _fspath(path), **_as(user)}


def _as(user: str | None) -> dict[str, str]:
    """The `user` field, only when one is asked for: requests of the sandbox user stay what they were."""
    return {} if user is None else {"user": user}


def _rename_body(src: PathLike, dst: PathLike, overwrite: bool, user: str | None) -> dict[str, Any]:
    return {"src": _fspath(src), "dst": _fspath(dst), "overwrite": overwrite, **_as(user)}


def _buffer(data: object) -> BufferBody | None:
    """The body for bytes-like data or a str (as UTF-8), sent in place; None for a stream of chunks."""
    if isinstance(data, str):
        return BufferBody(data.encode("utf-8"))
    if isinstance(data, bytes | bytearray | memoryview):
        return BufferBody(data)
    return None


def _headers(body: BufferBody | None) -> dict[str, str]:
    return _OCTET_HEADERS if body is None else {**_OCTET_HEADERS, "Content-Length": str(len(body))}


def _pieces(chunk: object) -> Iterator[bytes | memoryview]:
    """One chunk of a file object or an iterator, checked, in pieces of at most `UPLOAD_CHUNK` (see `BufferBody`).
    A bytearray or memoryview is copied: its owner may reuse or resize it once the next chunk is asked for."""
    if not isinstance(chunk, bytes | bytearray | memoryview):
        raise TypeError(f"files.write: a chunk of the data is {type(chunk).__name__}, not bytes "
                        "(open a file in binary mode)")
    data = chunk if isinstance(chunk, bytes) else bytes(chunk)
    if len(data) <= UPLOAD_CHUNK:
        if data:
            yield data
        return
    view = memoryview(data)  # of bytes: immutable, so its slices need no copy
    for start in range(0, len(data), UPLOAD_CHUNK):
        yield view[start:start + UPLOAD_CHUNK]


def _refuse(data: object) -> None:
    if isinstance(data, io.TextIOBase):
        raise TypeError("files.write needs a binary file object (open it with 'rb'), not a text file")


def _chunks(data: Any) -> Iterator[bytes | memoryview]:
    """The chunks of a binary file object or an iterable of bytes (sync; `_check_source` passed it)."""
    read = getattr(data, "read", None)
    if callable(read):
        while True:
            chunk = read(UPLOAD_CHUNK)
            if isinstance(chunk, bytes | bytearray | memoryview) and not chunk:
                return
            yield from _pieces(chunk)
    else:
        for chunk in data:
            yield from _pieces(chunk)


async def _achunks(data: Any) -> AsyncIterator[bytes | memoryview]:
    """The chunks of a file object (its `read` may be a coroutine: aiofiles, anyio) or of an iterable of bytes,
    sync or async (`_check_source` passed it)."""
    read = getattr(data, "read", None)
    if callable(read):
        while True:
            chunk = read(UPLOAD_CHUNK)
            if inspect.isawaitable(chunk):
                chunk = await chunk
            if isinstance(chunk, bytes | bytearray | memoryview) and not chunk:
                return
            for piece in _pieces(chunk):
                yield piece
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            for piece in _pieces(chunk):
                yield piece
    else:
        for piece in _chunks(data):
            yield piece


def _check_source(data: object, *, async_ok: bool) -> None:
    """Refuse what cannot be uploaded before a request starts (a generator's bad chunk shows only as it comes)."""
    _refuse(data)
    if callable(getattr(data, "read", None)) or (isinstance(data, Iterable) and not isinstance(data, dict)):
        return
    if async_ok and isinstance(data, AsyncIterable):
        return
    kinds = "an iterable of bytes, sync or async" if async_ok else "an iterable of bytes"
    raise TypeError(f"files.write takes bytes, str, a binary file object or {kinds}, not {type(data).__name__}")


def _upload(data: WriteData) -> tuple[Any, dict[str, str]]:
    """The request body and headers of a sync upload: a buffer in slices (with its length) or a chunk stream."""
    body = _buffer(data)
    if body is not None:
        return body, _headers(body)
    _check_source(data, async_ok=False)
    return _chunks(data), _OCTET_HEADERS


def _aupload(data: AsyncWriteData) -> tuple[Any, dict[str, str]]:
    body = _buffer(data)
    if body is not None:
        return AsyncBufferBody(body), _headers(body)
    _check_source(data, async_ok=True)
    return _achunks(data), _OCTET_HEADERS


class Files:
    """`sb.files`: the sandbox's files, as exact bytes. Relative paths resolve against `/workspace`."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def _path(self, suffix: str = "") -> str:
        return sandbox_path(self._sandbox_id, "/files" + suffix)

    def write(self, path: PathLike, data: WriteData, *, mode: int | None = None,
              user: str | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, a binary file object or an iterable of bytes, streamed) to `path`."""
        content, headers = _upload(data)
        params = _at(path, user) | ({} if mode is None else {"mode": str(mode)})
        reply = json_dict(
            self._client.request("PUT", self._path(), params=params, content=content, headers=headers), "a write"
        )
        return Entry.from_wire({"type": "file", **reply})

    def read(self, path: PathLike, *, user: str | None = None) -> bytes:
        """The file's exact bytes."""
        # BytesIO, not a bytearray: getvalue() hands its buffer over, where bytes(bytearray) copies (and
        # page-faults) the whole file a second time, ~60 ms per 100 MiB.
        out = io.BytesIO()
        self._download(self._path(), path, out, user)
        return out.getvalue()

    def read_text(self, path: PathLike, *, encoding: str = "utf-8", errors: str = "replace",
                  user: str | None = None) -> str:
        """The file as text; undecodable bytes are replaced unless `errors` says otherwise."""
        return self.read(path, user=user).decode(encoding, errors=errors)

    def list(self, path: PathLike, *, user: str | None = None) -> builtins.list[Entry]:
        data = json_dict(self._client.request("GET", self._path("/list"), params=_at(path, user)), "a list")
        return [Entry.from_wire(e) for e in data.get("entries", [])]

    def exists(self, path: PathLike, *, user: str | None = None) -> bool:
        data = self._client.request("GET", self._path("/exists"), params=_at(path, user))
        return bool(json_dict(data, "exists").get("exists"))

    def make_dir(self, path: PathLike, *, user: str | None = None) -> bool:
        """Create the directory (and its parents); `False` if it already existed."""
        data = self._client.request("POST", self._path("/mkdir"), json=_at(path, user))
        return bool(json_dict(data, "mkdir").get("created"))

    def remove(self, path: PathLike, *, recursive: bool = False, user: str | None = None) -> None:
        params = _at(path, user) | ({"recursive": "true"} if recursive else {})
        self._client.request("DELETE", self._path(), params=params)

    def stat(self, path: PathLike, *, user: str | None = None) -> Entry:
        """The entry for `path` (`NotFoundError` if there is none)."""
        reply = self._client.request("GET", self._path("/stat"), params=_at(path, user))
        return Entry.from_wire(json_dict(reply, "stat"))

    def rename(self, src: PathLike, dst: PathLike, *, overwrite: bool = False, user: str | None = None) -> None:
        """Move `src` to `dst`; an existing `dst` is a `ConflictError` unless `overwrite`."""
        self._client.request("POST", self._path("/rename"), json=_rename_body(src, dst, overwrite, user))

    def read_into(self, path: PathLike, dest: IO[bytes], *, user: str | None = None) -> int:
        """Stream the file into the binary file object `dest` (nothing is held in memory); the bytes written."""
        return self._download(self._path(), path, dest, user)

    def read_archive(self, path: PathLike, dest: IO[bytes], *, user: str | None = None) -> int:
        """Stream the directory `path` as a tar archive into `dest`; the bytes written. Entries are named under
        the directory's own name (`/workspace/src/a` is `src/a`), as `tar -C /workspace -c src` would."""
        return self._download(sandbox_path(self._sandbox_id, "/archive"), path, dest, user)

    def write_archive(self, path: PathLike, data: WriteData, *, user: str | None = None) -> int:
        """Extract a tar archive (bytes, a binary file object or an iterable of bytes, streamed) into `path`.

        The archive is checked whole first: entries escaping `path` (`..`, absolute names, links out) refuse the
        lot and nothing is extracted. Returns the number of entries extracted."""
        content, headers = _upload(data)
        url = sandbox_path(self._sandbox_id, "/archive")
        reply = self._client.request("PUT", url, params=_at(path, user), content=content, headers=headers)
        return int(json_dict(reply, "an archive upload").get("entries") or 0)

    def _download(self, url: str, path: PathLike, dest: IO[bytes], user: str | None = None) -> int:
        written = 0
        with self._client.stream("GET", url, params=_at(path, user)) as response:
            for chunk in response.iter_bytes():
                dest.write(chunk)
                written += len(chunk)
        return written


class AsyncFiles:
    """`sb.files` of an `AsyncSandbox`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def _path(self, suffix: str = "") -> str:
        return sandbox_path(self._sandbox_id, "/files" + suffix)

    async def write(self, path: PathLike, data: AsyncWriteData, *, mode: int | None = None,
                    user: str | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, a binary file object or an iterable of bytes, sync or async,
        streamed) to `path`."""
        content, headers = _aupload(data)
        params = _at(path, user) | ({} if mode is None else {"mode": str(mode)})
        reply = await self._client.request("PUT", self._path(), params=params, content=content, headers=headers)
        return Entry.from_wire({"type": "file", **json_dict(reply, "a write")})

    async def read(self, path: PathLike, *, user: str | None = None) -> bytes:
        out = io.BytesIO()  # see Files.read
        await self._download(self._path(), path, out, user)
        return out.getvalue()

    async def read_text(self, path: PathLike, *, encoding: str = "utf-8", errors: str = "replace",
                  user: str | None = None) -> str:
        return (await self.read(path, user=user)).decode(encoding, errors=errors)

    async def list(self, path: PathLike, *, user: str | None = None) -> builtins.list[Entry]:
        data = await self._client.request("GET", self._path("/list"), params=_at(path, user))
        return [Entry.from_wire(e) for e in json_dict(data, "a list").get("entries", [])]

    async def exists(self, path: PathLike, *, user: str | None = None) -> bool:
        data = await self._client.request("GET", self._path("/exists"), params=_at(path, user))
        return bool(json_dict(data, "exists").get("exists"))

    async def make_dir(self, path: PathLike, *, user: str | None = None) -> bool:
        data = await self._client.request("POST", self._path("/mkdir"), json=_at(path, user))
        return bool(json_dict(data, "mkdir").get("created"))

    async def remove(self, path: PathLike, *, recursive: bool = False, user: str | None = None) -> None:
        params = _at(path, user) | ({"recursive": "true"} if recursive else {})
        await self._client.request("DELETE", self._path(), params=params)

    async def stat(self, path: PathLike, *, user: str | None = None) -> Entry:
        return Entry.from_wire(json_dict(await self._client.request("GET", self._path("/stat"), params=_at(path, user)),
                                         "stat"))

    async def rename(self, src: PathLike, dst: PathLike, *, overwrite: bool = False, user: str | None = None) -> None:
        await self._client.request("POST", self._path("/rename"), json=_rename_body(src, dst, overwrite, user))

    async def read_into(self, path: PathLike, dest: Any, *, user: str | None = None) -> int:
        """Stream the file into `dest` (a binary file object; its `write` may be a coroutine)."""
        return await self._download(self._path(), path, dest, user)

    async def read_archive(self, path: PathLike, dest: Any, *, user: str | None = None) -> int:
        return await self._download(sandbox_path(self._sandbox_id, "/archive"), path, dest, user)

    async def write_archive(self, path: PathLike, data: AsyncWriteData, *, user: str | None = None) -> int:
        content, headers = _aupload(data)
        url = sandbox_path(self._sandbox_id, "/archive")
        reply = await self._client.request("PUT", url, params=_at(path, user), content=content, headers=headers)
        return int(json_dict(reply, "an archive upload").get("entries") or 0)

    async def _download(self, url: str, path: PathLike, dest: Any, user: str | None = None) -> int:
        written = 0
        async with self._client.stream("GET", url, params=_at(path, user)) as response:
            async for chunk in response.aiter_bytes():
                result = dest.write(chunk)
                if inspect.isawaitable(result):
                    await result
                written += len(chunk)
        return written
