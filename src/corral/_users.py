"""Who a command or file operation acts as inside a sandbox: the one user check (docs/architecture.md,
"Checked inputs").

A sandbox has two users, as every template's /etc/passwd has them (the agent's `users` module holds the same
table inside the sandbox): `user` (uid 1000), and `root`, which acts only in a sandbox created with root (its agent
refuses root elsewhere, with the reason: `PermissionDeniedError`; docs/security.md). None means the sandbox
user, and records of it stay as they always were.
"""

from __future__ import annotations

from typing import Literal

from ._exceptions import InvalidRequestError

__all__ = ["DEFAULT_USER", "ROOT", "USERS", "SandboxUser", "check_user", "user_home"]

SandboxUser = Literal["user", "root"]
DEFAULT_USER: SandboxUser = "user"
ROOT: SandboxUser = "root"
USERS: dict[str, str] = {DEFAULT_USER: "/home/user", ROOT: "/root"}  # each user's home


def check_user(user: object) -> SandboxUser | None:
    """`user` if a sandbox has such a user (None: the sandbox user); `InvalidRequestError` otherwise. Whether the
    sandbox has root is the sandbox's to say."""
    if user is None:
        return None
    if user == DEFAULT_USER:
        return DEFAULT_USER
    if user == ROOT:
        return ROOT
    shown = str(user)[:64]
    raise InvalidRequestError(f"unknown user {shown!r}: a sandbox has the users 'user' and 'root'",
                              details={"user": shown})


def user_home(user: object) -> str:
    """Where `user`'s relative paths and `~` start (None: the sandbox user's home)."""
    return USERS[check_user(user) or DEFAULT_USER]
