"""Which user an envd call acts as, and where its relative paths start.

E2B's SDKs name the user with `Authorization: Basic base64("<user>:")` on RPCs and `username=` on `/files`; no name
means the sandbox's default user. A Corral sandbox has `user` (uid 1000, home `/home/user`) and, when it was
created with root (E2B's API does so where the backend allows it), `root` (home `/root`; docs/security.md): the
agent refuses root in a sandbox without it, with the reason. Any other name is unknown to the sandbox, as envd
answers it.
"""

from __future__ import annotations

import base64
import binascii
import posixpath

from starlette.requests import Request

from .._exceptions import AuthenticationError, InvalidRequestError

__all__ = ["DEFAULT_USER", "HOME", "absolute_path", "check_user", "home_of", "request_user", "service_user"]

DEFAULT_USER, ROOT = "user", "root"
HOME, ROOT_HOME = "/home/user", "/root"


def check_user(name: str | None) -> str:
    """The user a call acts as: `user` for none, or `root`; another name is unknown."""
    if name in (None, "", DEFAULT_USER):
        return DEFAULT_USER
    if name == ROOT:
        return ROOT
    raise AuthenticationError(f"invalid username {name[:64]!r}: a sandbox's users are {DEFAULT_USER!r} and "
                              f"{ROOT!r}")


def service_user(user: str) -> str | None:
    """The user as the service takes it: None for the sandbox's user (whose records stay as they always were)."""
    return None if user == DEFAULT_USER else user


def home_of(user: str) -> str:
    return ROOT_HOME if user == ROOT else HOME


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


def absolute_path(path: str | None, *, what: str = "path", default: str | None = None, home: str = HOME) -> str:
    """`path` as the sandbox resolves it: relative to the user's `home`, `~` expanded; NUL bytes refused."""
    if path is None or path == "":
        if default is not None:
            return default
        raise InvalidRequestError(f"{what} is required")
    if "\x00" in path:
        raise InvalidRequestError(f"{what} contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(home, path)
    return path
