"""A process request's fields, checked before anything runs: the command line (`build_argv`), its environment
(`build_env`), the user it acts as (`resolve_user`), its tag, timeout and terminal size; and `ProcessError`, the error
of every process operation (its `code` is the wire's error code)."""

from __future__ import annotations

from .users import AGENT_IS_ROOT, ROOT, USER, User, named

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

MAX_TAG = 256
BASE_ENV = USER.base_env()
ROOT_NOT_ENABLED = ("this sandbox was created without root: its commands and files act as the user 'user' "
                    "(uid 1000); create the sandbox with root=True to run as root")


class ProcessError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def resolve_user(name: Any) -> User:
    """The user a request names (none: the sandbox user); root only in a sandbox created with it."""
    user = named(name)
    if user is None:
        shown = name[:64] if isinstance(name, str) else name
        raise ProcessError("invalid_request", f"unknown user {shown!r}: a sandbox has the users 'user' and 'root'")
    if user is ROOT and not AGENT_IS_ROOT:
        raise ProcessError("permission_denied", ROOT_NOT_ENABLED)
    return user


def positive_or_none(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ProcessError("invalid_request", f"{name} must be a positive number of seconds")
    return float(value)


def pty_size(size: Any) -> tuple[int, int]:
    try:
        rows, cols = int(size["rows"]), int(size["cols"])
    except (TypeError, KeyError, ValueError) as exc:
        raise ProcessError("invalid_request", "pty needs {'rows': int, 'cols': int}") from exc
    if not (0 < rows < 10000 and 0 < cols < 10000):
        raise ProcessError("invalid_request", "pty rows and cols must be between 1 and 9999")
    return rows, cols


def build_argv(cmd: Any) -> list[str]:
    if isinstance(cmd, str):
        check_text(cmd, "command")
        return ["/bin/bash", "-lc", cmd]
    if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
        for arg in cmd:
            check_text(arg, "argument")
        return list(cmd)
    raise ProcessError("invalid_request", "cmd must be a shell string or a non-empty list of strings")


def check_tag(tag: Any) -> str | None:
    if tag is None:
        return None
    if not isinstance(tag, str) or not 0 < len(tag) <= MAX_TAG:
        raise ProcessError("invalid_request", f"tag must be a string of 1 to {MAX_TAG} characters")
    check_text(tag, "tag")
    return tag


def build_env(extra: Any, *, base: dict[str, str] = BASE_ENV) -> dict[str, str]:
    env = dict(base)
    if extra is None:
        return env
    if not isinstance(extra, dict):
        raise ProcessError("invalid_request", "env must be an object of strings")
    for key, value in extra.items():
        if not isinstance(value, str) or not key or "=" in key:
            raise ProcessError("invalid_request", f"bad environment variable {key!r}")
        check_text(key, "environment variable name")
        check_text(value, f"environment variable {key}")
        env[key] = value
    return env


def check_text(value: str, what: str) -> None:
    if "\x00" in value:
        raise ProcessError("invalid_request", f"{what} contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProcessError("invalid_request", f"{what} is not valid UTF-8") from exc
