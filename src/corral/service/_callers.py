"""`Callers`: who is calling, and the records of callers refused before any operation ran.

Every front end authenticates its caller here (`authenticate`), and records here what it refused itself: a
credential it could not even parse (`record_denial`), a request that failed validation (`record_invalid`). It
needs the store (keys, the audit trail, the aggregated denials) and the telemetry that counts refusals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._exceptions import AuthenticationError
from ..control import AuditEvent, ControlStore, Denial, Principal, parse_key
from ._requests import current_request

if TYPE_CHECKING:
    from ._telemetry import Telemetry

__all__ = ["REQUEST_INVALID", "Callers", "ClientInfo"]

REQUEST_INVALID = "request.invalid"  # the audit action of a request refused by validation
_MAX_PROBLEMS = 20  # problems kept in the audit record (the caller's response lists them all)
_MAX_TEXT = 512  # the client's own text (paths, field names) is capped in the record


@dataclass(frozen=True)
class ClientInfo:
    """Where a request came from, for the records of refused ones."""

    client: str | None
    method: str
    path: str


class Callers:
    def __init__(self, store: ControlStore, telemetry: Telemetry | None = None) -> None:
        self._store = store
        self._telemetry = telemetry

    async def authenticate(self, key: str | None, client: ClientInfo) -> Principal:
        """The caller of `key`; a missing or refused key is `AuthenticationError`, recorded as `auth.denied`
        (aggregated per client address by the store, so a flood cannot grow the log without bound)."""
        try:
            if key is None:
                raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
            principal = await self._store.authenticate(key)
        except AuthenticationError as exc:
            await self.record_denial(client, exc, key)
            raise
        request = current_request()
        if request is not None:
            request.authenticated(principal)
        return principal

    async def record_denial(self, client: ClientInfo, exc: AuthenticationError, key: str | None) -> None:
        """A refused caller (also one whose credentials a front end could not even parse)."""
        request = current_request()
        if request is not None:
            request.refused(exc)
        if self._telemetry is not None:
            self._telemetry.refusal("auth.denied", exc.code)
        await self._store.auth_denials.record(Denial(client=client.client, method=client.method, path=client.path,
                                                     key_prefix=_key_prefix(key), reason=exc.message))

    async def record_invalid(self, principal: Principal, client: ClientInfo, *, route: str | None,
                             target: str | None, problems: list[dict[str, str]]) -> None:
        """Audit a request refused by validation before any operation ran."""
        params = {"client": client.client, "method": client.method, "path": client.path[:_MAX_TEXT],
                  "route": route, "problem_count": len(problems),
                  "problems": [{k: v[:_MAX_TEXT] for k, v in p.items()} for p in problems[:_MAX_PROBLEMS]]}
        request = current_request()
        if request is not None:
            request.operation(REQUEST_INVALID, target, "invalid_request", principal)
        if self._telemetry is not None:
            self._telemetry.refusal(REQUEST_INVALID, "invalid_request")
        await self._store.audit.append(AuditEvent.by(principal, REQUEST_INVALID, target[:256] if target else None,
                                                     params=params,
                                                     outcome={"status": 400, "error": "invalid_request"},
                                                     request_id=request.request_id if request else None))


def _key_prefix(key: str | None) -> str | None:
    """The presented key's prefix if it is a well-formed Corral key; nothing of anything else."""
    if key is None:
        return None
    try:
        return parse_key(key).prefix
    except AuthenticationError:
        return None
