"""What a code request carries, checked: its language, a context's or session's name, a new context's working
directory and the kernel's options, a cell's own environment; and whether the template has the tools a language
needs (`check_available`: the polyglot template's languages say so)."""

from __future__ import annotations

import os
import re

from . import languages
from .process_requests import ProcessError
from .spawn import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Session languages -> what the template must have for them (the kernel itself needs python3 besides).
KERNEL_TOOLS = {"python": ("python3",), "bash": ("bash",), "javascript": ("node",), "typescript": ("node", "tsc"),
                "r": ("Rscript",), "java": ("java", "jshell")}
POLYGLOT = ("java", "go", "rust", "typescript", "r")  # what only the polyglot template has the tools of
POLYGLOT_HINT = ("Java, Go, Rust, TypeScript and R need the `polyglot` template: build it with `corral templates "
                 "build polyglot` and create the sandbox with template 'polyglot'")
DEFAULT_CWD = "/workspace"
NAME = re.compile(r"^[^\x00/]{1,128}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def language_of(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ProcessError("invalid_request", "language must be a string")
    return languages.normalize(value)


def checked_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise ProcessError("invalid_request", f"{what} must be a name of 1 to 128 characters, without '/'")
    return value


def checked_cwd(value: Any) -> str:
    """A new context's working directory: absolute, and a directory now (whether it may be entered shows when a
    cell runs there)."""
    if value is None:
        return DEFAULT_CWD
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise ProcessError("invalid_request", "cwd must be an absolute path")
    if not os.path.isdir(value):
        raise ProcessError("invalid_request", f"working directory {value!r} does not exist in the sandbox")
    return os.path.normpath(value)


def kernel_options(req: dict[str, Any]) -> dict[str, Any]:
    return {"show_saved_images": bool(req.get("show_saved_images"))}


def checked_cell_env(value: Any) -> dict[str, str]:
    """Environment variables for one cell: names are identifiers (every language sets them, bash included)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProcessError("invalid_request", "a cell's env must be an object of names to strings")
    for name, item in value.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ProcessError("invalid_request", f"environment variable name {name!r} is not valid: letters, "
                                                  "digits and '_', not starting with a digit")
        if not isinstance(item, str) or "\x00" in item:
            raise ProcessError("invalid_request", f"environment variable {name} must be a string without NUL")
    return dict(value)


def tool_path(env: Any) -> str:
    return str((env or {}).get("PATH") or "") or "/usr/local/bin:/usr/bin:/bin"


def missing_tool(language: str, env: Any) -> str | None:
    tools = ("python3", *KERNEL_TOOLS[language])
    return next((tool for tool in tools if which(tool, tool_path(env)) is None), None)


def check_available(language: str, env: Any) -> None:
    missing = missing_tool(language, env)
    if missing is not None:
        hint = f"; {POLYGLOT_HINT}" if language in POLYGLOT else ""
        raise ProcessError("invalid_request", f"{language} is not available in this sandbox: its template has "
                                              f"no {missing}{hint}")
