"""File routes: raw bytes streamed both ways (never buffered whole), listings as JSON, directories as tar.

Thin: each parses the request (paths checked and made absolute here), calls one `service.files` method, and
renders its answer; downloads stream the service's chunks. The agent checks roots, `..` and symlinks.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from .._exceptions import InvalidRequestError
from .._paths import SandboxPath
from ..engine import Entry
from ._auth import CurrentPrincipal
from ._checkpoints import CHECKPOINT_HEADER, checkpoint_taken
from ._context import SandboxUser, request_path, sandbox_path, service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

_OCTETS = "application/octet-stream"
_TAR = "application/x-tar"


class MkdirRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    parents: bool = True
    user: SandboxUser | None = None


class RenameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    src: str
    dst: str
    overwrite: bool = False
    user: SandboxUser | None = None


# `?user=root`: the operation acts as root (a sandbox created with root only); absent, as the sandbox user.
User = Annotated[SandboxUser | None, Query()]


def entry_json(entry: Entry) -> dict[str, Any]:
    return {"name": entry.name, "path": entry.path, "type": entry.type, "size": entry.size, "mode": entry.mode,
            "mtime": entry.mtime, "owner": entry.owner, "group": entry.group, "permissions": entry.permissions,
            "target": entry.target, "metadata": entry.metadata}


def _query_path(request: Request) -> SandboxPath:
    try:
        return request_path(request)
    except InvalidRequestError as exc:
        raise _invalid(("query", "path"), exc) from None


def _body_path(path: str, name: str) -> SandboxPath:
    try:
        return sandbox_path(path, name)
    except InvalidRequestError as exc:
        raise _invalid(("body", name), exc) from None


def _invalid(where: tuple[str, str], exc: InvalidRequestError) -> RequestValidationError:
    """A malformed path is refused like any invalid field: a 400, audited as `request.invalid` by the route."""
    return RequestValidationError([{"loc": where, "msg": exc.message, "type": "value_error"}])


@router.get("/{sandbox_id}/files", response_model=None)
async def read_file(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                    user: User = None) -> StreamingResponse:
    chunks = await service(request).files.read(principal, sandbox_id, _query_path(request), user=user)
    return StreamingResponse(chunks, media_type=_OCTETS)


@router.get("/{sandbox_id}/archive", response_model=None)
async def download_archive(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                           user: User = None) -> StreamingResponse:
    chunks = await service(request).files.read_archive(principal, sandbox_id, _query_path(request), user=user)
    return StreamingResponse(chunks, media_type=_TAR)


@router.put("/{sandbox_id}/files")
async def write_file(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                     mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644, user: User = None) -> dict[str, Any]:
    path = _query_path(request)
    size = await service(request).files.write(principal, sandbox_id, path, request.stream(), mode=mode, user=user)
    return {"path": path, "size": size, "checkpoint": checkpoint_taken()}


@router.put("/{sandbox_id}/archive")
async def upload_archive(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                         user: User = None) -> dict[str, Any]:
    entries = await service(request).files.write_archive(principal, sandbox_id, _query_path(request),
                                                         request.stream(), user=user)
    return {"entries": entries, "checkpoint": checkpoint_taken()}


@router.delete("/{sandbox_id}/files", status_code=204)
async def remove(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                 recursive: bool = True, user: User = None) -> Response:
    await service(request).files.remove(principal, sandbox_id, _query_path(request), recursive=recursive,
                                        user=user)
    return _no_content()


@router.get("/{sandbox_id}/files/list")
async def list_dir(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                   user: User = None) -> dict[str, Any]:
    entries = await service(request).files.list(principal, sandbox_id, _query_path(request), user=user)
    return {"entries": [entry_json(e) for e in entries]}


@router.get("/{sandbox_id}/files/stat")
async def stat(sandbox_id: str, request: Request, principal: CurrentPrincipal, user: User = None) -> dict[str, Any]:
    return entry_json(await service(request).files.stat(principal, sandbox_id, _query_path(request), user=user))


@router.get("/{sandbox_id}/files/exists")
async def exists(sandbox_id: str, request: Request, principal: CurrentPrincipal, user: User = None) -> dict[str, Any]:
    return {"exists": await service(request).files.exists(principal, sandbox_id, _query_path(request), user=user)}


@router.post("/{sandbox_id}/files/mkdir")
async def make_dir(sandbox_id: str, body: MkdirRequest, request: Request,
                   principal: CurrentPrincipal) -> dict[str, Any]:
    path = _body_path(body.path, "path")
    created = await service(request).files.make_dir(principal, sandbox_id, path, parents=body.parents,
                                                    user=body.user)
    return {"created": created, "checkpoint": checkpoint_taken()}


@router.post("/{sandbox_id}/files/rename", status_code=204)
async def rename(sandbox_id: str, body: RenameRequest, request: Request, principal: CurrentPrincipal) -> Response:
    src, dst = _body_path(body.src, "src"), _body_path(body.dst, "dst")
    await service(request).files.rename(principal, sandbox_id, src, dst, overwrite=body.overwrite, user=body.user)
    return _no_content()


def _no_content() -> Response:
    """204; the automatic checkpoint taken before the change, if any, in `Corral-Checkpoint` (there is no body)."""
    taken = checkpoint_taken()
    return Response(status_code=204, headers={CHECKPOINT_HEADER: taken} if taken else None)
