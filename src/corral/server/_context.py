"""What every route needs: the engine and store of the app, the audit recorder, and sandbox path checks."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fastapi import Request

from .._exceptions import CorralError, InvalidRequestError, NotFoundError
from ..control import Action, AuditEvent, ControlStore, Principal, Role, Tenant, authorize
from ..engine import Engine
from ._errors import status_for

WORKSPACE = "/workspace"


@dataclass
class Services:
    engine: Engine
    store: ControlStore


def services(request: Request) -> Services:
    found: Services = request.app.state.corral
    return found


@dataclass
class Audited:
    """Records one request in the audit trail when the block ends, successful or not.

    Set `status` and add to `outcome` (and `params`) inside the block; an exception is recorded with its
    error code and status, and re-raised.
    """

    store: ControlStore
    principal: Principal
    action: Action | str
    target: str | None
    params: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    status: int = 200

    async def __aenter__(self) -> Audited:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.record(exc)

    async def record(self, exc: BaseException | None = None) -> None:
        if exc is None:
            outcome = {"status": self.status, **self.outcome}
        elif isinstance(exc, CorralError):
            outcome = {"status": status_for(exc.code), "error": exc.code, **self.outcome}
        else:
            outcome = {"status": 500, "error": "server_error", **self.outcome}
        await self.store.audit.append(AuditEvent.by(self.principal, str(self.action), self.target,
                                                    params=self.params, outcome=outcome))


async def visible_tenant(svc: Services, principal: Principal, name_or_id: str, action: Action) -> Tenant:
    """The tenant named (by name or id) if `principal` may do `action` on it. The role is checked first; then,
    for anyone but an admin, another tenant is as unknown as one that never existed (a 404, nothing leaks)."""
    authorize(principal, action, None if principal.role is Role.ADMIN else principal.tenant_id)
    tenant: Tenant | None
    try:
        tenant = await svc.store.tenant_by_name(name_or_id)
    except NotFoundError:
        try:
            tenant = await svc.store.get_tenant(name_or_id)
        except NotFoundError:
            tenant = None
    if tenant is None or (principal.role is not Role.ADMIN and tenant.id != principal.tenant_id):
        raise NotFoundError(f"no tenant {name_or_id!r}", details={"tenant": name_or_id})
    return tenant


def query_param(request: Request, name: str) -> str | None:
    """A query parameter decoded strictly: invalid UTF-8 is a 400, not a silent U+FFFD."""
    query: bytes = request.scope.get("query_string", b"")
    raw = query.decode("latin-1")
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidRequestError(f"query parameter {name!r} is not valid UTF-8") from None
    for key, value in pairs:
        if key == name:
            return value
    return None


def sandbox_path(path: str | None, what: str = "path") -> str:
    """Check a sandbox path (the agent checks roots, `..` and symlinks); relative ones resolve in /workspace."""
    if path is None:
        raise InvalidRequestError(f"{what} is required")
    if "\x00" in path:
        raise InvalidRequestError(f"{what} contains a NUL byte")
    if not path:
        raise InvalidRequestError(f"{what} is empty")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{what} is not valid UTF-8") from None
    return path if path.startswith("/") else f"{WORKSPACE}/{path}"


def request_path(request: Request, name: str = "path") -> str:
    return sandbox_path(query_param(request, name), name)
