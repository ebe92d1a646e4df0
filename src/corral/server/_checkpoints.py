"""Checkpoint routes (docs/api.md, "Checkpoints"): take, list, get, delete, restore in place, and what changed.

Thin: each parses the request, calls one `service.checkpoints` method and renders its answer. `checkpoint_taken`
is what the routes of operations that change files put on their results: the automatic checkpoint taken
before them (null when none).
"""

from __future__ import annotations

from datetime import UTC
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ..control import CheckpointRecord
from ..service import Changes, RestoreResult, current_request
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

CHECKPOINT_HEADER = "Corral-Checkpoint"  # on a 204 of a file change: the automatic checkpoint before it
_ID_OR_NAME = Annotated[str, Field(min_length=1, max_length=128)]


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: _ID_OR_NAME
    paths: Annotated[list[str], Field(min_length=1, max_length=64)] | None = None  # None: everything


def checkpoint_json(record: CheckpointRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "sandbox_id": record.sandbox_id,
            "created_at": record.created_at.astimezone(UTC).isoformat(), "size": record.size_bytes,
            "command": record.command, "automatic": record.automatic}


def restore_json(result: RestoreResult) -> dict[str, Any]:
    return {"checkpoint": checkpoint_json(result.checkpoint), "paths": result.paths,
            "stopped": result.stopped.to_json()}


def changes_json(changes: Changes) -> dict[str, Any]:
    return {"since": changes.since.id, "until": None if changes.until is None else changes.until.id,
            "changes": [c.to_json() for c in changes.changes], "truncated": changes.truncated}


def checkpoint_taken() -> str | None:
    """The automatic checkpoint the service took before this request's operation (None: none)."""
    info = current_request()
    return None if info is None else info.checkpoint


@router.post("/{sandbox_id}/checkpoints", status_code=201)
async def create_checkpoint(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                            body: CheckpointRequest | None = None) -> dict[str, Any]:
    name = body.name if body is not None else None
    return checkpoint_json(await service(request).checkpoints.create(principal, sandbox_id, name))


@router.get("/{sandbox_id}/checkpoints")
async def list_checkpoints(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    found = await service(request).checkpoints.list(principal, sandbox_id)
    return {"checkpoints": [checkpoint_json(c) for c in found]}


@router.get("/{sandbox_id}/checkpoints/{checkpoint}")
async def get_checkpoint(sandbox_id: str, checkpoint: str, request: Request,
                         principal: CurrentPrincipal) -> dict[str, Any]:
    return checkpoint_json(await service(request).checkpoints.get(principal, sandbox_id, checkpoint))


@router.delete("/{sandbox_id}/checkpoints/{checkpoint}", status_code=204)
async def delete_checkpoint(sandbox_id: str, checkpoint: str, request: Request,
                            principal: CurrentPrincipal) -> Response:
    await service(request).checkpoints.delete(principal, sandbox_id, checkpoint)
    return Response(status_code=204)


@router.post("/{sandbox_id}/restore")
async def restore(sandbox_id: str, body: RestoreRequest, request: Request,
                  principal: CurrentPrincipal) -> dict[str, Any]:
    result = await service(request).checkpoints.restore(principal, sandbox_id, body.checkpoint, body.paths)
    return restore_json(result)


@router.get("/{sandbox_id}/changes")
async def changes(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                  since: Annotated[str, Query(min_length=1, max_length=128)],
                  until: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
                  diff: bool = False) -> dict[str, Any]:
    found = await service(request).checkpoints.changes(principal, sandbox_id, since, until, diff=diff)
    return changes_json(found)
