"""Volume routes (docs/volumes.md): create, list, get, delete; thin, one service call each."""

from __future__ import annotations

from datetime import UTC
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ..control import VolumeRecord
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/volumes", route_class=AuditedRoute)


class VolumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=256)]  # the service says what a valid name is
    size: StrictInt | Annotated[str, Field(max_length=64)] = "1G"


def volume_json(record: VolumeRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "size": record.size_bytes,
            "created_at": record.created_at.astimezone(UTC).isoformat()}


@router.post("", status_code=201)
async def create_volume(body: VolumeRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return volume_json(await service(request).volumes.create(principal, body.name, body.size))


@router.get("")
async def list_volumes(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return {"volumes": [volume_json(v) for v in await service(request).volumes.list(principal)]}


@router.get("/{name}")
async def get_volume(name: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    detail = await service(request).volumes.get(principal, name)
    return {**volume_json(detail.volume), "used": detail.used_bytes}


@router.delete("/{name}", status_code=204)
async def delete_volume(name: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).volumes.delete(principal, name)
    return Response(status_code=204)
