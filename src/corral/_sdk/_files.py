"""`sb.files`: a sandbox's files as exact bytes, streamed both ways. Relative paths resolve against `/workspace`.

Every method takes `user`: who opens the files inside the sandbox (the kernel checks each path as that user's,
and what it makes is that user's). None is the sandbox user; `"root"` needs a sandbox created with `root=True`
(else `PermissionDeniedError`)."""

from __future__ import annotations

import builtins
import inspect
import io
import os
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

from .._exceptions import InvalidRequestError
from ._models import Entry
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncFiles", "Files", "PathLike", "WriteData"]

_UPLOAD_CHUNK = 256 * 1024

PathLike = str | os.PathLike[str]
WriteData = bytes | bytearray | memoryview | str | IO[bytes]


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


def _upload_kind(data: WriteData) -> bytes | IO[bytes]:
    """The bytes to send, or the binary file object to stream from."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if isinstance(data, io.TextIOBase):
        raise TypeError("files.write needs a binary file object (open it with 'rb'), not a text file")
    if callable(getattr(data, "read", None)):
        return data
    raise TypeError(f"files.write takes bytes, str or a binary file object, not {type(data).__name__}")


def _check_chunk(chunk: Any) -> bytes:
    if not isinstance(chunk, bytes | bytearray | memoryview):
        raise TypeError(f"files.write: the file object returned {type(chunk).__name__}; open it in binary mode")
    return bytes(chunk)


def _iter_file(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := _check_chunk(f.read(_UPLOAD_CHUNK)):
        yield chunk


async def _aiter_file(f: Any) -> AsyncIterator[bytes]:
    while True:
        chunk = f.read(_UPLOAD_CHUNK)
        if inspect.isawaitable(chunk):  # an async file object (aiofiles, anyio)
            chunk = await chunk
        data = _check_chunk(chunk)
        if not data:
            return
        yield data


class Files:
    """`sb.files`: the sandbox's files, as exact bytes. Relative paths resolve against `/workspace`."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def _path(self, suffix: str = "") -> str:
        return sandbox_path(self._sandbox_id, "/files" + suffix)

    def write(self, path: PathLike, data: WriteData, *, mode: int | None = None,
              user: str | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, or a binary file object, streamed in chunks) to `path`."""
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _iter_file(payload)
        params = _at(path, user) | ({} if mode is None else {"mode": str(mode)})
        headers = {"Content-Type": "application/octet-stream"}
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
        """Extract a tar archive (bytes or a binary file object, streamed) into the directory `path`.

        The archive is checked whole first: entries escaping `path` (`..`, absolute names, links out) refuse the
        lot and nothing is extracted. Returns the number of entries extracted."""
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _iter_file(payload)
        url = sandbox_path(self._sandbox_id, "/archive")
        reply = self._client.request("PUT", url, params=_at(path, user), content=content, headers=_OCTET_HEADERS)
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

    async def write(self, path: PathLike, data: WriteData, *, mode: int | None = None,
                    user: str | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, or a binary file object, sync or async, streamed) to `path`."""
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _aiter_file(payload)
        params = _at(path, user) | ({} if mode is None else {"mode": str(mode)})
        headers = {"Content-Type": "application/octet-stream"}
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

    async def write_archive(self, path: PathLike, data: WriteData, *, user: str | None = None) -> int:
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _aiter_file(payload)
        url = sandbox_path(self._sandbox_id, "/archive")
        reply = await self._client.request("PUT", url, params=_at(path, user), content=content, headers=_OCTET_HEADERS)
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
