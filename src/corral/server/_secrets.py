"""Stored-secret routes (docs/secrets.md): put, list, delete; thin, one service call each. No route returns a value."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from fastapi import APIRouter, Request, Response

from ..control import StoredSecret
from ..service._secrets import SecretRequest
from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/secrets", route_class=AuditedRoute)


def secret_json(secret: StoredSecret) -> dict[str, Any]:
    return {"name": secret.name, "hosts": list(secret.hosts), "body": secret.body,
            "created_at": secret.created_at.astimezone(UTC).isoformat(),
            "updated_at": secret.updated_at.astimezone(UTC).isoformat()}


@router.get("")
async def list_secrets(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return {"secrets": [secret_json(s) for s in await service(request).secrets.list(principal)]}


@router.put("/{name}")
async def put_secret(name: str, body: SecretRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return secret_json(await service(request).secrets.put(principal, name, body))


@router.delete("/{name}", status_code=204)
async def delete_secret(name: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).secrets.delete(principal, name)
    return Response(status_code=204)
