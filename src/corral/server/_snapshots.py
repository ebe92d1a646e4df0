"""Snapshot routes: list, get, delete (taken with POST /v1/sandboxes/{id}/snapshots); thin, one service call each."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from ..control import SnapshotRecord
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/snapshots", route_class=AuditedRoute)


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None


def snapshot_json(record: SnapshotRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "sandbox_id": record.sandbox_id, "template": record.template,
            "size": record.size_bytes, "created_at": record.created_at.astimezone(UTC).isoformat()}


@router.get("")
async def list_snapshots(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return {"snapshots": [snapshot_json(r) for r in await service(request).snapshots.list(principal)]}


@router.get("/{name_or_id}")
async def get_snapshot(name_or_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return snapshot_json(await service(request).snapshots.get(principal, name_or_id))


@router.delete("/{name_or_id}", status_code=204)
async def delete_snapshot(name_or_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).snapshots.delete(principal, name_or_id)
    return Response(status_code=204)
