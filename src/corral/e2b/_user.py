"""Which user an envd call acts as, and where its relative paths start.

E2B's SDKs name the user with `Authorization: Basic base64("<user>:")` on RPCs and `username=` on `/files`; no name
means the sandbox's default user. Corral's sandboxes have one user, `user` (uid 1000, home `/home/user`); `root` is
refused with the reason, and any other name is unknown to the sandbox, as envd answers it.
"""

from __future__ import annotations

import base64
import binascii
import posixpath

from starlette.requests import Request

from .._exceptions import AuthenticationError, InvalidRequestError, PermissionDeniedError

__all__ = ["DEFAULT_USER", "HOME", "absolute_path", "check_user", "request_user"]

DEFAULT_USER = "user"
HOME = "/home/user"
ROOT_REFUSED = ("commands and files as root are not available in Corral sandboxes: code runs as the unprivileged "
                "user 'user' (uid 1000) with no capabilities; leave `user` unset")


def check_user(name: str | None) -> str:
    """The user a call acts as: `user` for none; `root` is refused, another name is unknown."""
    if name in (None, "", DEFAULT_USER):
        return DEFAULT_USER
    if name == "root":
        raise PermissionDeniedError(ROOT_REFUSED)
    raise AuthenticationError(f"invalid username {name[:64]!r}: this sandbox's user is {DEFAULT_USER!r}")


def request_user(request: Request) -> str:
    """The user of an RPC, from its `Authorization: Basic` header (checked)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return check_user(None)
    try:
        name = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise AuthenticationError("the Authorization header is not 'Basic base64(<user>:)'") from None
    return check_user(name)


def absolute_path(path: str | None, *, what: str = "path", default: str | None = None) -> str:
    """`path` as the sandbox resolves it: relative to the user's home, `~` expanded; NUL bytes refused."""
    if path is None or path == "":
        if default is not None:
            return default
        raise InvalidRequestError(f"{what} is required")
    if "\x00" in path:
        raise InvalidRequestError(f"{what} contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = HOME + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(HOME, path)
    return path
