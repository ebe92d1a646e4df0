"""The request an operation serves: its id, and what the service learns about it for the request's log line.

A front end opens a `request_scope` per HTTP request (the REST server's `RequestLogMiddleware` does, for every
front end it serves); the service, which knows who called and what was done, fills in the `RequestInfo`: the
caller when it authenticates, the action, target and outcome when an operation is audited. The audit record
carries the id, so a log line, a response's `X-Request-Id` and the record of the same request share it.

A context variable carries it, not a parameter of every method: the operations stay the same for every front
end, and tasks started inside a request (streams, a relay) copy the context and so see the same object.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from .._exceptions import CorralError
from ..control import Principal

__all__ = ["REQUEST_ID", "RequestInfo", "current_request", "new_request_id", "request_scope"]

# What an incoming `X-Request-Id` may be to be kept (a proxy's or the client's own): short, and characters that
# need no escaping in a header, a log line or a query. Anything else is replaced by one of ours.
REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")

_current: ContextVar[RequestInfo | None] = ContextVar("corral_request", default=None)


def new_request_id() -> str:
    return secrets.token_hex(16)


@dataclass
class RequestInfo:
    """What is known of one request so far; the first audited operation names its action and target (a request
    of E2B's API may run several), and the first failure its error code."""

    request_id: str
    tenant_id: str | None = None
    key_id: str | None = None
    action: str | None = None
    target: str | None = None
    error: str | None = None
    # The automatic checkpoint taken before the operation (`Checkpoints.before_change`): what the result names.
    checkpoint: str | None = None

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox the operation was about, if its target is one (others name a tenant, a key, a volume)."""
        return self.target if self.target is not None and self.target.startswith("sb-") else None

    def authenticated(self, principal: Principal) -> None:
        self.tenant_id, self.key_id = principal.tenant_id, principal.key_id

    def operation(self, action: str, target: str | None, error: str | None,
                  principal: Principal | None = None) -> None:
        """An operation was recorded (by `principal`: the caller, also one a sandbox's access token stands for)."""
        if principal is not None and self.key_id is None:
            self.authenticated(principal)
        if self.action is None:
            self.action, self.target = action, target
        if self.error is None:
            self.error = error

    def refused(self, exc: CorralError) -> None:
        """A caller refused before any operation (`auth.denied`)."""
        self.operation("auth.denied", None, exc.code)


def current_request() -> RequestInfo | None:
    """The request being served in this context; None outside one (the reconciler, a test calling the service)."""
    return _current.get()


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[RequestInfo]:
    """Serve one request as `request_id` for the duration of the block."""
    info = RequestInfo(request_id)
    token = _current.set(info)
    try:
        yield info
    finally:
        _current.reset(token)
