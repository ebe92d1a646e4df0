"""A path inside a sandbox, checked once, at the edge that receives it (docs/architecture.md, "Checked inputs").

`sandbox_path` is the one check (the agent's own rule, `corral.agent.paths`: a non-empty string, no NUL byte,
valid UTF-8) and the one resolution of a relative path (against `/workspace`, or a front end's own directory,
E2B's: the user's home, with `~`). What it returns is a `SandboxPath`: the layers below (service, engine, agent
client) take it as it is and check a plain `str` only when a Python caller hands one to them directly. The agent
checks its requests again (the sandbox trusts nothing it is sent) and alone judges roots, `..` and symlinks.
"""

from __future__ import annotations

import posixpath

from ._exceptions import InvalidRequestError
from .agent.paths import path_problem

__all__ = ["WORKSPACE", "SandboxPath", "sandbox_path"]

WORKSPACE = "/workspace"


class SandboxPath(str):
    """An absolute path that passed `sandbox_path`; made only there."""

    __slots__ = ()


def sandbox_path(value: object, what: str = "path", *, cwd: str = WORKSPACE, home: str | None = None) -> SandboxPath:
    """`value` checked (`InvalidRequestError` naming `what`: required, not a non-empty string, NUL byte, not
    UTF-8) and made absolute: relative to `cwd`; `~` and `~/...` in `home` when a front end expands them."""
    if isinstance(value, SandboxPath):
        return value
    if value is None:
        raise InvalidRequestError(f"{what} is required")
    problem = path_problem(value)
    if problem is not None or not isinstance(value, str):
        raise InvalidRequestError(f"{what} {problem}")
    if home is not None and (value == "~" or value.startswith("~/")):
        value = home + value[1:]
    return SandboxPath(value if value.startswith("/") else posixpath.join(cwd, value))
