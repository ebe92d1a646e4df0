"""Who is calling: the Bearer key of every request (except `/v1/health`) becomes a `Principal`.

This front end only reads the header; the service authenticates and records refusals (`auth.denied`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .._exceptions import AuthenticationError
from ..control import Principal
from ..service import ClientInfo
from ._context import service

_SCHEME = "bearer"
_PRINCIPAL_STATE = "corral_principal"  # request.state attribute: the principal, once authenticated


async def principal(request: Request) -> Principal:
    """The caller; `AuthenticationError` (401, recorded as `auth.denied`) for a missing or refused key."""
    found = request_principal(request)
    if found is not None:
        return found
    svc = service(request)
    try:
        key = bearer_key(request.headers.get("authorization"))
    except AuthenticationError as exc:
        await svc.record_denial(client_info(request), exc, None)
        raise
    found = await svc.authenticate(key, client_info(request))
    setattr(request.state, _PRINCIPAL_STATE, found)
    return found


def request_principal(request: Request) -> Principal | None:
    """The principal this request already authenticated as, if it got that far."""
    found = getattr(request.state, _PRINCIPAL_STATE, None)
    return found if isinstance(found, Principal) else None


def bearer_key(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None when there is no header."""
    if header is None:
        return None
    scheme, _, key = header.partition(" ")
    if scheme.lower() != _SCHEME or not key.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <key>'")
    return key.strip()


def client_info(request: Request) -> ClientInfo:
    return ClientInfo(client=request.client.host if request.client is not None else None,
                      method=request.method, path=request.url.path)


CurrentPrincipal = Annotated[Principal, Depends(principal)]
