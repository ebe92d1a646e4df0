"""File routes: raw bytes streamed both ways (never buffered whole), listings as JSON, directories as tar.

Every path goes to the in-sandbox agent with the roots the file API may touch, so `..`, absolute paths
outside them and symlinks leading out of them are refused inside the sandbox's own mount namespace.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..control import Action, Principal
from ..engine import AgentClient, Entry
from ._auth import CurrentPrincipal
from ._context import Audited, Services, request_path, sandbox_path, services
from ._sandboxes import file_roots

router = APIRouter(prefix="/v1/sandboxes")

_OCTETS = "application/octet-stream"


class MkdirRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    parents: bool = True


class RenameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    src: str
    dst: str
    overwrite: bool = False


def entry_json(entry: Entry) -> dict[str, Any]:
    return {"name": entry.name, "path": entry.path, "type": entry.type, "size": entry.size, "mode": entry.mode,
            "mtime": entry.mtime}


@dataclass(frozen=True)
class _Target:
    """The sandbox's agent and the directories its file API may touch."""

    agent: AgentClient
    roots: list[str]


async def _target(svc: Services, principal: Principal, sandbox_id: str, action: Action) -> _Target:
    record = await svc.store.sandbox_for(principal, sandbox_id, action)
    return _Target(svc.engine.agent(sandbox_id), file_roots(record))


class _Digest:
    """Size and sha256 of a body, computed while it streams through."""

    def __init__(self) -> None:
        self.size = 0
        self._sha = hashlib.sha256()

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._sha.update(chunk)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    async def wrap(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk:
                self.update(chunk)
                yield chunk


async def _streamed(chunks: AsyncIterator[bytes], audit: Audited, media_type: str) -> StreamingResponse:
    """Start the download before answering, so a refusal (not found, outside the roots) is a proper status."""
    try:
        first: bytes | None = await anext(chunks)
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[bytes]:
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

    return StreamingResponse(body(), media_type=media_type)


async def _download(request: Request, principal: Principal, sandbox_id: str, action: str,
                    tar: bool) -> StreamingResponse:
    svc = services(request)
    audit = Audited(svc.store, principal, action, sandbox_id)
    try:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_READ)
        agent, roots = target.agent, target.roots
        chunks = agent.download_tar(path, roots=roots) if tar else agent.iter_file(path, roots=roots)
        return await _streamed(chunks, audit, "application/x-tar" if tar else _OCTETS)
    except BaseException as exc:
        await audit.record(exc)
        raise


@router.get("/{sandbox_id}/files", response_model=None)
async def read_file(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> StreamingResponse:
    return await _download(request, principal, sandbox_id, "files.read", tar=False)


@router.get("/{sandbox_id}/archive", response_model=None)
async def download_archive(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> StreamingResponse:
    return await _download(request, principal, sandbox_id, "archive.read", tar=True)


@router.put("/{sandbox_id}/files")
async def write_file(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                     mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644) -> dict[str, Any]:
    svc = services(request)
    digest = _Digest()
    async with Audited(svc.store, principal, "files.write", sandbox_id, params={"mode": mode}) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
        try:
            size = await target.agent.write_file(path, digest.wrap(request.stream()), mode=mode, roots=target.roots)
        finally:
            audit.params.update(size=digest.size, sha256=digest.sha256)
    return {"path": path, "size": size}


@router.put("/{sandbox_id}/archive")
async def upload_archive(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    digest = _Digest()
    async with Audited(svc.store, principal, "archive.write", sandbox_id) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
        try:
            entries = await target.agent.upload_tar(path, digest.wrap(request.stream()), roots=target.roots)
        finally:
            audit.params.update(size=digest.size, sha256=digest.sha256)
        audit.outcome["entries"] = entries
    return {"entries": entries}


@router.delete("/{sandbox_id}/files", status_code=204)
async def remove(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                 recursive: bool = True) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "files.remove", sandbox_id, params={"recursive": recursive},
                       status=204) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
        await target.agent.remove(path, recursive=recursive, roots=target.roots)
    return Response(status_code=204)


@router.get("/{sandbox_id}/files/list")
async def list_dir(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "files.list", sandbox_id) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_READ)
        entries = await target.agent.list(path, roots=target.roots)
    return {"entries": [entry_json(e) for e in entries]}


@router.get("/{sandbox_id}/files/stat")
async def stat(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "files.stat", sandbox_id) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_READ)
        entry = await target.agent.stat(path, roots=target.roots)
    return entry_json(entry)


@router.get("/{sandbox_id}/files/exists")
async def exists(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "files.exists", sandbox_id) as audit:
        path = request_path(request)
        audit.params["path"] = path
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_READ)
        found = await target.agent.exists(path, roots=target.roots)
    return {"exists": found}


@router.post("/{sandbox_id}/files/mkdir")
async def make_dir(sandbox_id: str, body: MkdirRequest, request: Request,
                   principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "files.mkdir", sandbox_id, params={"path": body.path}):
        path = sandbox_path(body.path)
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
        created = await target.agent.make_dir(path, parents=body.parents, roots=target.roots)
    return {"created": created}


@router.post("/{sandbox_id}/files/rename", status_code=204)
async def rename(sandbox_id: str, body: RenameRequest, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    params = {"src": body.src, "dst": body.dst, "overwrite": body.overwrite}
    async with Audited(svc.store, principal, "files.rename", sandbox_id, params=params, status=204):
        src, dst = sandbox_path(body.src, "src"), sandbox_path(body.dst, "dst")
        target = await _target(svc, principal, sandbox_id, Action.SANDBOX_FILES_WRITE)
        await target.agent.rename(src, dst, overwrite=body.overwrite, roots=target.roots)
    return Response(status_code=204)
