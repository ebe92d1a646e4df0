"""Which user an envd call acts as, and where its relative paths start.

E2B's SDKs name the user with `Authorization: Basic base64("<user>:")` on RPCs and `username=` on `/files`; no name
(or an empty one: protobuf's unset) means the sandbox's default user. The check is Corral's one user check
(`corral._users`); a name it refuses is answered as envd answers a user unknown to the sandbox (401). Paths are
Corral's one path check (`corral._paths`), relative to the user's home with `~` expanded, as envd resolves them.
"""

from __future__ import annotations

import base64
import binascii

from starlette.requests import Request

from .._exceptions import AuthenticationError, InvalidRequestError
from .._paths import SandboxPath, sandbox_path
from .._users import DEFAULT_USER, ROOT, USERS, SandboxUser, check_user

__all__ = ["DEFAULT_USER", "HOME", "absolute_path", "envd_user", "home_of", "request_user", "service_user"]

HOME = USERS[DEFAULT_USER]


def envd_user(name: str | None) -> SandboxUser:
    """The user a call names: `user` for none, or `root`; another name is unknown (`AuthenticationError`)."""
    try:
        return check_user(name or None) or DEFAULT_USER
    except InvalidRequestError:
        assert name is not None
        raise AuthenticationError(f"invalid username {name[:64]!r}: a sandbox's users are {DEFAULT_USER!r} and "
                                  f"{ROOT!r}") from None


def service_user(user: SandboxUser) -> SandboxUser | None:
    """The user as the service takes it: None for the sandbox's user (whose records stay as they always were)."""
    return None if user == DEFAULT_USER else user


def home_of(user: SandboxUser) -> str:
    return USERS[user]


def request_user(request: Request) -> SandboxUser:
    """The user of an RPC, from its `Authorization: Basic` header (checked)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return envd_user(None)
    try:
        name = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise AuthenticationError("the Authorization header is not 'Basic base64(<user>:)'") from None
    return envd_user(name)


def absolute_path(path: str | None, *, what: str = "path", default: str | None = None,
                  home: str = HOME) -> SandboxPath:
    """`path` checked and as the sandbox resolves it: relative to the user's `home`, `~` expanded; none (or
    empty, protobuf's unset) is `default`, else required."""
    if path is None or path == "":
        path = default
    return sandbox_path(path, what, cwd=home, home=home)
