"""Files: read, write, list, stat, exists, make_dir, remove and rename in a sandbox, and directories as tar.

Bytes stream both ways, never buffered whole. Every operation goes through the engine's `Files` with the roots of
the sandbox's store record, so the agent refuses `..`, absolute paths outside them and symlinks leading out of
them inside the sandbox's own mount namespace. Paths arrive checked and absolute (front ends shape them).
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING

from ..control import Action, Principal
from ..engine import Entry
from ..engine import Files as SandboxFiles
from ._audited import Audited
from ._sandboxes import file_roots

if TYPE_CHECKING:
    from ._service import Service

__all__ = ["Files"]


class Files:
    def __init__(self, service: Service) -> None:
        self._svc = service

    # -- downloads: started before they return, recorded when they end ------------------------------------

    async def read(self, principal: Principal, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes. A refusal (not found, outside the roots) raises here, before any byte; the record
        is written when the stream ends, with its size (and the error, if it fails mid-way)."""
        return await self._download(principal, sandbox_id, "files.read", path, tar=False)

    async def read_archive(self, principal: Principal, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """A tar of the directory at `path`, streamed like `read`."""
        return await self._download(principal, sandbox_id, "archive.read", path, tar=True)

    async def _download(self, principal: Principal, sandbox_id: str, action: str, path: str, *,
                        tar: bool) -> AsyncIterator[bytes]:
        audit = self._svc.audited(principal, action, sandbox_id, params={"path": path})
        try:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            chunks = files.download_tar(path) if tar else files.iter_read(path)
            first = await anext(chunks, None)
        except BaseException as exc:
            await audit.record(exc)
            raise
        return _recorded(first, chunks, audit)

    # -- uploads: size and sha256 of what the caller sent, as it streams through --------------------------

    async def write(self, principal: Principal, sandbox_id: str, path: str, data: AsyncIterable[bytes], *,
                    mode: int = 0o644) -> int:
        """Write `data` to `path` (replacing it); returns the bytes written."""
        digest = _Digest()
        async with self._svc.audited(principal, "files.write", sandbox_id,
                                     params={"mode": mode, "path": path}) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
            try:
                return await files.write(path, digest.wrap(data), mode=mode)
            finally:
                audit.params.update(size=digest.size, sha256=digest.sha256)

    async def write_archive(self, principal: Principal, sandbox_id: str, path: str,
                            data: AsyncIterable[bytes]) -> int:
        """Unpack the tar `data` into the directory at `path`; returns the number of entries."""
        digest = _Digest()
        async with self._svc.audited(principal, "archive.write", sandbox_id, params={"path": path}) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
            try:
                entries = await files.upload_tar(path, digest.wrap(data))
            finally:
                audit.params.update(size=digest.size, sha256=digest.sha256)
            audit.outcome["entries"] = entries
        return entries

    # -- the rest: one request, one answer -----------------------------------------------------------------

    async def list(self, principal: Principal, sandbox_id: str, path: str) -> builtins.list[Entry]:
        async with self._svc.audited(principal, "files.list", sandbox_id, params={"path": path}):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            return await files.list(path)

    async def stat(self, principal: Principal, sandbox_id: str, path: str) -> Entry:
        async with self._svc.audited(principal, "files.stat", sandbox_id, params={"path": path}):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            return await files.stat(path)

    async def exists(self, principal: Principal, sandbox_id: str, path: str) -> bool:
        async with self._svc.audited(principal, "files.exists", sandbox_id, params={"path": path}):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            return await files.exists(path)

    async def make_dir(self, principal: Principal, sandbox_id: str, path: str, *, parents: bool = True) -> bool:
        """Create the directory; False if it was there already."""
        async with self._svc.audited(principal, "files.mkdir", sandbox_id, params={"path": path}):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
            return await files.make_dir(path, parents=parents)

    async def remove(self, principal: Principal, sandbox_id: str, path: str, *, recursive: bool = True) -> None:
        async with self._svc.audited(principal, "files.remove", sandbox_id,
                                     params={"recursive": recursive, "path": path}, status=204):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
            await files.remove(path, recursive=recursive)

    async def rename(self, principal: Principal, sandbox_id: str, src: str, dst: str, *,
                     overwrite: bool = False) -> None:
        params = {"src": src, "dst": dst, "overwrite": overwrite}
        async with self._svc.audited(principal, "files.rename", sandbox_id, params=params, status=204):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
            await files.rename(src, dst, overwrite=overwrite)

    async def _files(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxFiles:
        """The engine's file API of the sandbox, with the roots its record allows (if `principal` may)."""
        record = await self._svc.sandboxes.authorized(principal, sandbox_id, action)
        return SandboxFiles(self._svc.engine, record.id, roots=file_roots(record))


async def _recorded(first: bytes | None, chunks: AsyncIterator[bytes], audit: Audited) -> AsyncIterator[bytes]:
    """The download's chunks (`first` already taken: None if there were none), recorded when they end."""
    size = 0
    try:
        if first is not None:
            size += len(first)
            yield first
            async for chunk in chunks:
                size += len(chunk)
                yield chunk
    except BaseException as exc:
        audit.outcome["size"] = size
        await audit.record(exc)
        raise
    audit.outcome["size"] = size
    await audit.record()


class _Digest:
    """Size and sha256 of a body, computed while it streams through."""

    def __init__(self) -> None:
        self.size = 0
        self._sha = hashlib.sha256()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    async def wrap(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk:
                self.size += len(chunk)
                self._sha.update(chunk)
                yield chunk
