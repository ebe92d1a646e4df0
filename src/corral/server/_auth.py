"""Who is calling: the Bearer key of every request (except `/v1/health`) becomes a `Principal`.

A refused key (missing, malformed, unknown, revoked, tenant disabled) is a 401 and an `auth.denied` audit record,
aggregated per client address by the store (`corral.control.AuthDenials`) so a flood cannot grow the log without
bound. The record names the key's prefix only when the key is well-formed, never its secret.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .._exceptions import AuthenticationError
from ..control import Denial, Principal, parse_key
from ._context import services

_SCHEME = "bearer"
_PRINCIPAL_STATE = "corral_principal"  # request.state attribute: the principal, once authenticated


async def principal(request: Request) -> Principal:
    """The caller; `AuthenticationError` (401, recorded as `auth.denied`) for a missing or refused key."""
    found = request_principal(request)
    if found is not None:
        return found
    try:
        found = await _authenticate(request)
    except AuthenticationError as exc:
        await services(request).store.auth_denials.record(_denial(request, exc))
        raise
    setattr(request.state, _PRINCIPAL_STATE, found)
    return found


def request_principal(request: Request) -> Principal | None:
    """The principal this request already authenticated as, if it got that far."""
    found = getattr(request.state, _PRINCIPAL_STATE, None)
    return found if isinstance(found, Principal) else None


async def _authenticate(request: Request) -> Principal:
    key = _bearer_key(request)
    return await services(request).store.authenticate(key)


def _bearer_key(request: Request) -> str:
    header = request.headers.get("authorization")
    if header is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != _SCHEME or not key.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <key>'")
    return key.strip()


def _denial(request: Request, exc: AuthenticationError) -> Denial:
    return Denial(client=request.client.host if request.client is not None else None, method=request.method,
                  path=request.url.path, key_prefix=_key_prefix(request), reason=exc.message)


def _key_prefix(request: Request) -> str | None:
    """The presented key's prefix if it is a well-formed Corral key; nothing of anything else."""
    try:
        return parse_key(_bearer_key(request)).prefix
    except AuthenticationError:
        return None


CurrentPrincipal = Annotated[Principal, Depends(principal)]
