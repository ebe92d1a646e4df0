"""Files: read, write, list, stat, exists, make_dir, remove and rename in a sandbox, directories as tar, and
directory watches (a stream, or watchers polled by id).

Bytes stream both ways, never buffered whole. Every operation goes through the engine's `Files` with the roots of
the sandbox's store record, so the agent refuses `..`, absolute paths outside them and symlinks leading out of
them inside the sandbox's own mount namespace. Paths arrive checked and absolute (front ends shape them, relative
ones against `user_home(user)`). A polled watcher belongs to the key that made it: other keys' polls do not find it.

Every operation takes `user`: who opens the files (the kernel checks each path as that user's; what it makes is
that user's). None is the sandbox user (uid 1000); "root" only in a sandbox created with root, else
`PermissionDeniedError` (docs/security.md). The audit record names the user when one was given.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

from ..backends import check_user
from ..control import Action, Principal
from ..engine import Entry, WatchEvent, WatchStream
from ..engine import Files as SandboxFiles
from ._audited import Audited
from ._sandboxes import file_roots

if TYPE_CHECKING:
    from ._on_sandbox import OnSandbox

__all__ = ["Files"]


class Files:
    def __init__(self, on: OnSandbox) -> None:
        self._on = on

    # -- downloads: started before they return, recorded when they end ------------------------------------

    async def read(self, principal: Principal, sandbox_id: str, path: str, *,
                   user: str | None = None) -> AsyncIterator[bytes]:
        """The file's bytes. A refusal (not found, outside the roots) raises here, before any byte; the record
        is written when the stream ends, with its size (and the error, if it fails mid-way)."""
        return await self._download(principal, sandbox_id, "files.read", path, tar=False, user=user)

    async def read_archive(self, principal: Principal, sandbox_id: str, path: str, *,
                           user: str | None = None) -> AsyncIterator[bytes]:
        """A tar of the directory at `path`, streamed like `read`."""
        return await self._download(principal, sandbox_id, "archive.read", path, tar=True, user=user)

    async def _download(self, principal: Principal, sandbox_id: str, action: str, path: str, *,
                        tar: bool, user: str | None) -> AsyncIterator[bytes]:
        audit = self._on.audited(principal, action, sandbox_id, params=_with_user({"path": path}, user))
        try:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            chunks = files.download_tar(path) if tar else files.iter_read(path)
            first = await anext(chunks, None)
        except BaseException as exc:
            await audit.record(exc)
            raise
        return _recorded(first, chunks, audit)

    # -- uploads: size and sha256 of what the caller sent, as it streams through --------------------------

    async def write(self, principal: Principal, sandbox_id: str, path: str, data: AsyncIterable[bytes], *,
                    mode: int = 0o644, in_place: bool = False, metadata: dict[str, str] | None = None,
                    user: str | None = None) -> int:
        """Write `data` to `path` (replacing it); returns the bytes written. `in_place`: into the file itself, as
        E2B's envd writes (else whole or not at all); `metadata`: the file's user.e2b.* attributes, replacing
        any it had (the record keeps their keys, not their values)."""
        digest = _Digest()
        params: dict[str, Any] = {"mode": mode, "path": path}
        if in_place:
            params["in_place"] = True
        if metadata:
            params["metadata_keys"] = sorted(metadata)
        async with self._on.audited(principal, "files.write", sandbox_id, params=_with_user(params, user)) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE, user,
                                      change=(audit, f"write {path}"))
            try:
                return await files.write(path, digest.wrap(data), mode=mode, in_place=in_place, metadata=metadata)
            finally:
                audit.params.update(size=digest.size, sha256=digest.sha256)

    async def write_archive(self, principal: Principal, sandbox_id: str, path: str,
                            data: AsyncIterable[bytes], *, user: str | None = None) -> int:
        """Unpack the tar `data` into the directory at `path`; returns the number of entries."""
        digest = _Digest()
        async with self._on.audited(principal, "archive.write", sandbox_id,
                                    params=_with_user({"path": path}, user)) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE, user,
                                      change=(audit, f"upload archive into {path}"))
            try:
                entries = await files.upload_tar(path, digest.wrap(data))
            finally:
                audit.params.update(size=digest.size, sha256=digest.sha256)
            audit.outcome["entries"] = entries
        return entries

    # -- the rest: one request, one answer -----------------------------------------------------------------

    async def list(self, principal: Principal, sandbox_id: str, path: str, *,
                   depth: int = 1, user: str | None = None) -> builtins.list[Entry]:
        """The entries `depth` levels below `path` (1: its own), depth first in name order, symlinks not followed."""
        params: dict[str, Any] = {"path": path} if depth == 1 else {"path": path, "depth": depth}
        async with self._on.audited(principal, "files.list", sandbox_id, params=_with_user(params, user)) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            entries = await files.list(path, depth=depth)
            if depth != 1:
                audit.outcome["entries"] = len(entries)
            return entries

    async def stat(self, principal: Principal, sandbox_id: str, path: str, *, user: str | None = None) -> Entry:
        async with self._on.audited(principal, "files.stat", sandbox_id, params=_with_user({"path": path}, user)):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            return await files.stat(path)

    async def exists(self, principal: Principal, sandbox_id: str, path: str, *, user: str | None = None) -> bool:
        async with self._on.audited(principal, "files.exists", sandbox_id, params=_with_user({"path": path}, user)):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            return await files.exists(path)

    async def make_dir(self, principal: Principal, sandbox_id: str, path: str, *, parents: bool = True,
                       user: str | None = None) -> bool:
        """Create the directory; False if it was there already."""
        async with self._on.audited(principal, "files.mkdir", sandbox_id,
                                    params=_with_user({"path": path}, user)) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE, user,
                                      change=(audit, f"make_dir {path}"))
            return await files.make_dir(path, parents=parents)

    async def remove(self, principal: Principal, sandbox_id: str, path: str, *, recursive: bool = True,
                     user: str | None = None) -> None:
        async with self._on.audited(principal, "files.remove", sandbox_id,
                                    params=_with_user({"recursive": recursive, "path": path}, user),
                                    status=204) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE, user,
                                      change=(audit, f"remove {path}"))
            await files.remove(path, recursive=recursive)

    async def rename(self, principal: Principal, sandbox_id: str, src: str, dst: str, *,
                     overwrite: bool = False, parents: bool = False, user: str | None = None) -> Entry:
        """Move `src` to `dst`; `parents`: make dst's missing parent directories first (E2B's Move). The entry
        now at `dst`."""
        params: dict[str, Any] = {"src": src, "dst": dst, "overwrite": overwrite}
        if parents:
            params["parents"] = True
        async with self._on.audited(principal, "files.rename", sandbox_id, params=_with_user(params, user),
                                    status=204) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_WRITE, user,
                                      change=(audit, f"rename {src} {dst}"))
            return await files.rename(src, dst, overwrite=overwrite, parents=parents)

    # -- watching directories ----------------------------------------------------------------------------------

    async def watch(self, principal: Principal, sandbox_id: str, path: str, *, recursive: bool = False,
                    include_entry: bool = False, user: str | None = None) -> AsyncGenerator[WatchEvent, None]:
        """Events in the directory `path` as they happen, until the caller closes the generator (`aclose()`).

        A refusal (not found; a file, not a directory; outside the roots; too many watches) raises here, before
        any event. One record, `files.watch`, when the watch ends: with the number of events it carried, and
        the error if the sandbox ended it."""
        params = {"path": path, "recursive": recursive, "include_entry": include_entry}
        audit = self._on.audited(principal, "files.watch", sandbox_id, params=_with_user(params, user))
        try:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            stream = await files.watch(path, recursive=recursive, include_entry=include_entry)
        except BaseException as exc:
            await audit.record(exc)
            raise
        return _watched(stream, audit)

    async def create_watcher(self, principal: Principal, sandbox_id: str, path: str, *, recursive: bool = False,
                             include_entry: bool = False, user: str | None = None) -> str:
        """A watcher the sandbox keeps for `principal`'s key, to poll with `watcher_events`; its id. Refusals as
        `watch`. Gone with `remove_watcher`, with the sandbox, or after 10 minutes without a poll."""
        params = {"path": path, "recursive": recursive, "include_entry": include_entry}
        async with self._on.audited(principal, "files.watcher_create", sandbox_id,
                                    params=_with_user(params, user)) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ, user)
            watcher_id = await files.create_watcher(path, recursive=recursive, include_entry=include_entry,
                                                    owner=principal.key_id)
            audit.outcome["watcher_id"] = watcher_id
            return watcher_id

    async def watcher_events(self, principal: Principal, sandbox_id: str,
                             watcher_id: str) -> builtins.list[WatchEvent]:
        """The watcher's events since the last poll; every change that finished before this call is in them."""
        async with self._on.audited(principal, "files.watcher_events", sandbox_id,
                                    params={"watcher_id": watcher_id}) as audit:
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            events = await files.watcher_events(watcher_id, owner=principal.key_id)
            audit.outcome["events"] = len(events)
            return events

    async def remove_watcher(self, principal: Principal, sandbox_id: str, watcher_id: str) -> None:
        async with self._on.audited(principal, "files.watcher_remove", sandbox_id,
                                    params={"watcher_id": watcher_id}, status=204):
            files = await self._files(principal, sandbox_id, Action.SANDBOX_FILES_READ)
            await files.remove_watcher(watcher_id, owner=principal.key_id)

    async def _files(self, principal: Principal, sandbox_id: str, action: Action, user: str | None = None, *,
                     change: tuple[Audited, str] | None = None) -> SandboxFiles:
        """The engine's file API of the sandbox, with the roots its record allows (if `principal` may), acting as
        `user` (checked before anything is asked of the sandbox). `change`: the operation about to change files
        and what it is (an automatic checkpoint precedes it)."""
        check_user(user)
        record = await self._on.authorize(principal, sandbox_id, action)
        if change is not None:
            await self._on.changing(principal, record, change[1], change[0])
        return self._on.sessions.get(record.id).files_for(roots=file_roots(record), user=user)


def _with_user(params: dict[str, Any], user: str | None) -> dict[str, Any]:
    """Audit params, naming the user where one was asked for (records of the default stay as they were)."""
    return params if user is None else {**params, "user": user}


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


async def _watched(stream: WatchStream, audit: Audited) -> AsyncGenerator[WatchEvent, None]:
    """The watch's events, and its one record when it ends: closed by the caller (the usual end), or failed."""
    events = 0
    error: BaseException | None = None
    try:
        async for event in stream:
            events += 1
            yield event
    except Exception as exc:  # the sandbox went away, say: recorded with its error
        error = exc
        raise
    finally:
        audit.outcome["events"] = events
        # Shielded: a cancelled consumer (its client left) must still close the agent's watch and keep the record.
        await asyncio.shield(_end_watch(stream, audit, error))


async def _end_watch(stream: WatchStream, audit: Audited, error: BaseException | None) -> None:
    try:
        await stream.aclose()
    finally:
        await audit.record(error)


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
