"""What makes a string a sandbox path at all: the one rule, shared by the agent and the host.

The agent applies it to every path of a request (`file_access.check_path`, before roots, `..` and symlinks); the host
applies the same rule at each edge that receives a path from a user (`corral._paths.sandbox_path`), so that a
bad path is refused with the field's name before anything reaches a sandbox. Standard library only: this file
runs inside every sandbox.
"""

from __future__ import annotations

__all__ = ["path_problem"]


def path_problem(value: object) -> str | None:
    """Why `value` is no path (to follow the field's name: "path contains a NUL byte"), or None if it is one:
    a non-empty string without NUL bytes that encodes as UTF-8 (a lone surrogate, from undecodable bytes, does
    not)."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if "\x00" in value:
        return "contains a NUL byte"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None
