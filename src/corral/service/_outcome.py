"""The one error code -> HTTP status table. Front ends answer with it; the audit trail records it.

It lives with the service, not with a front end, because the service's audit records carry the status every
front end will answer with (REST, E2B, MCP and the dashboard all speak HTTP). The SDK reverses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .._exceptions import CorralError

__all__ = ["RETRY_AFTER_DETAIL", "STATUS_BY_CODE", "outcome_of", "status_for"]

STATUS_BY_CODE: Mapping[str, int] = MappingProxyType({
    "invalid_request": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "conflict": 409,
    "sandbox_timeout": 410,
    "quota_exceeded": 429,
    "capacity_exceeded": 503,  # the machine is full, not the tenant's quota: another server could take it
    "disk_full": 507,
    "server_error": 500,
    "template_build_failed": 500,
    "agent_error": 502,
    "runtime_unavailable": 503,
    "replica_unavailable": 503,  # the sandbox's replica does not answer (docs/replicas.md): nothing was done
})

RETRY_AFTER_DETAIL = "retry_after"  # an error whose details carry this many seconds gets a Retry-After header


def status_for(code: str) -> int:
    return STATUS_BY_CODE.get(code, 500)


def outcome_of(exc: BaseException | None, status: int, extra: dict[str, Any]) -> dict[str, Any]:
    """An audit record's outcome: the status a front end answers with, and the error's code if any."""
    if exc is None:
        return {"status": status, **extra}
    if isinstance(exc, CorralError):
        return {"status": status_for(exc.code), "error": exc.code, **extra}
    return {"status": 500, "error": "server_error", **extra}
