"""What every route needs: the app's `Service`, and the request's paths and query parameters checked."""

from __future__ import annotations

import urllib.parse

from fastapi import Request

from .._exceptions import InvalidRequestError
from .._paths import SandboxPath, sandbox_path
from .._users import SandboxUser
from ..service import Service

# `SandboxUser` (a body's or query's `user`, checked by its model: the sandbox user when absent; "root" only in a
# sandbox created with root, the service answers `permission_denied` elsewhere) and `sandbox_path`: the checks
# of the REST edge, `corral._users` and `corral._paths` (docs/architecture.md, "Checked inputs").
__all__ = ["SandboxUser", "query_param", "query_prefixed", "request_path", "sandbox_path", "service"]


def service(request: Request) -> Service:
    found: Service = request.app.state.corral
    return found


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


def query_prefixed(request: Request, prefix: str) -> dict[str, str]:
    """Every query parameter named `<prefix><name>`, as `{name: value}`, decoded strictly."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidRequestError("query string is not valid UTF-8") from None
    return {k.removeprefix(prefix): v for k, v in pairs if k.startswith(prefix)}


def request_path(request: Request, name: str = "path") -> SandboxPath:
    """The query parameter `name`, decoded strictly and checked as a sandbox path."""
    return sandbox_path(query_param(request, name), name)
