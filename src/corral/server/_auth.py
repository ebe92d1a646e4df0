"""Who is calling: the Bearer key of every request (except `/v1/health`) becomes a `Principal`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .._exceptions import AuthenticationError
from ..control import Principal
from ._context import services

_SCHEME = "bearer"


async def principal(request: Request) -> Principal:
    header = request.headers.get("authorization")
    if header is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != _SCHEME or not key.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <key>'")
    return await services(request).store.authenticate(key.strip())


CurrentPrincipal = Annotated[Principal, Depends(principal)]
