"""What every route needs: the app's `Service`, and the request's paths and query parameters checked."""

from __future__ import annotations

import urllib.parse
from typing import Literal

from fastapi import Request

from .._exceptions import InvalidRequestError
from ..service import Service

__all__ = ["SandboxUser", "query_param", "query_prefixed", "request_path", "sandbox_path", "service"]

WORKSPACE = "/workspace"
# Who a command or file operation acts as (docs/security.md): the sandbox user when absent; "root" only in a
# sandbox created with root (the service answers `permission_denied` elsewhere).
SandboxUser = Literal["user", "root"]

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
