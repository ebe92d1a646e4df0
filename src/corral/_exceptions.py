"""Corral's one exception tree.

Every error Corral raises on purpose is a `CorralError`; nothing else escapes the public API except
programming errors (`TypeError`, `ValueError` for misuse of Python types).

```
CorralError                      code             meaning
 ├── InvalidRequestError         invalid_request  bad input: paths, limits, specs. Nothing was changed.
 ├── NotFoundError               not_found        no such sandbox, template, process or file
 ├── ConflictError               conflict         the target is in the wrong state (paused, exists, not empty)
 ├── AuthenticationError         unauthenticated  missing or wrong credentials (API key, agent token)
 ├── PermissionDeniedError       permission_denied the caller may not do this (role, file mode)
 ├── QuotaExceededError          quota_exceeded   a tenant's quota refused the request (HTTP 429)
 │    ├── CapacityError          capacity_exceeded this machine is full (memory, disk, sandbox count; 503)
 │    └── DiskFullError          disk_full        the sandbox's disk quota is full (ENOSPC inside it)
 ├── SandboxTimeoutError         sandbox_timeout  the sandbox reached its timeout (TTL) and was destroyed
 └── ServerError                 server_error     Corral itself failed; the message says what and why
      ├── ReplicaUnavailableError replica_unavailable  the replica that runs the sandbox does not answer, or
      │                                            stopped (state `lost`); nothing was done (HTTP 503)
      ├── RuntimeUnavailableError runtime_unavailable  fail closed: runtime, namespaces, cgroups or
      │                                            overlayfs missing; nothing ran unsandboxed
      ├── AgentError             agent_error      the in-sandbox agent is unreachable or broke protocol
      ├── TemplateBuildError     template_build_failed building or importing a template failed
      └── TransportError         transport_error  (client side) no complete answer came from the server
           ├── ConnectError      connect_error    could not reach Corral (refused, DNS, proxy): nothing was sent
           └── TransportTimeoutError transport_timeout  no answer in time: whether Corral acted is unknown
```

Each class has a stable `code`. Codes cross every wire (agent protocol, HTTP API) and are turned back into
classes by `error_from_code`, the one table that maps them.

`TransportError` and its subclasses are the SDK's own: they say that the answer never came, so no server sends
them and the wire table leaves them out (`wire = False`; `error_from_code("connect_error", ...)` is an unknown
code). They sit under `ServerError` so that code catching `ServerError` for "Corral did not serve this" keeps
working; catch `TransportError` (or `ConnectError`) first to tell an unreachable server from a failing one.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AgentError",
    "AuthenticationError",
    "CapacityError",
    "ConflictError",
    "ConnectError",
    "CorralError",
    "DiskFullError",
    "InvalidRequestError",
    "NotFoundError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "ReplicaUnavailableError",
    "RuntimeUnavailableError",
    "SandboxTimeoutError",
    "ServerError",
    "TemplateBuildError",
    "TransportError",
    "TransportTimeoutError",
    "error_from_code",
]


class CorralError(Exception):
    """Root of every error Corral raises on purpose."""

    code: ClassVar[str] = "error"
    wire: ClassVar[bool] = True  # False: raised by the SDK itself, never sent by a server (not in the wire table)

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details or {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"

    def to_dict(self) -> dict[str, Any]:
        """The wire form: `{"code", "message", "details"}`."""
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidRequestError(CorralError):
    code = "invalid_request"


class NotFoundError(CorralError):
    code = "not_found"


class ConflictError(CorralError):
    code = "conflict"


class AuthenticationError(CorralError):
    code = "unauthenticated"


class PermissionDeniedError(CorralError):
    code = "permission_denied"


class QuotaExceededError(CorralError):
    code = "quota_exceeded"


class CapacityError(QuotaExceededError):
    """The machine, not the tenant, is full: waiting (see `details["retry_after"]`) or another host helps."""

    code = "capacity_exceeded"


class DiskFullError(QuotaExceededError):
    code = "disk_full"


class SandboxTimeoutError(CorralError):
    code = "sandbox_timeout"


class ServerError(CorralError):
    code = "server_error"


class ReplicaUnavailableError(ServerError):
    """The replica whose backend runs the sandbox does not answer, or stopped answering (the sandbox is `lost`);
    nothing was done (docs/replicas.md)."""

    code = "replica_unavailable"


class RuntimeUnavailableError(ServerError):
    code = "runtime_unavailable"


class AgentError(ServerError):
    code = "agent_error"


class TemplateBuildError(ServerError):
    code = "template_build_failed"


class TransportError(ServerError):
    """The SDK got no complete answer from the server: the connection failed, broke or timed out.

    `details` has `url` and `transport_error` (the name of the underlying exception, which is `__cause__`).
    """

    code = "transport_error"
    wire = False


class ConnectError(TransportError):
    """The server could not be reached (refused, unknown host, proxy, unsupported URL): nothing was sent."""

    code = "connect_error"


class TransportTimeoutError(TransportError):
    """No answer in time (connecting, sending, waiting for a reply): the server may or may not have acted."""

    code = "transport_timeout"


def _all_subclasses(cls: type[CorralError]) -> list[type[CorralError]]:
    """`cls` and every subclass that crosses a wire (the SDK's own transport errors do not)."""
    found = [cls] if cls.wire else []
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


_BY_CODE: dict[str, type[CorralError]] = {c.code: c for c in _all_subclasses(CorralError)}


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> CorralError:
    """Rebuild an error that crossed a wire; an unknown code becomes a `ServerError` that keeps it."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServerError(f"{message} (unknown error code {code!r})", details=details)
    return cls(message, details=details)
