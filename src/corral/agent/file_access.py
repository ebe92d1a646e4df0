"""Where the file API may go, and its error: `check_path` (absolute, the shared path rule of `paths.py`, inside the
request's roots, symlinks resolved and none through /proc, never into what no request changes or reads), and
`FileError`, whose `code` is the wire's error code (`ERRNO_CODES` for the OS's errors)."""

from __future__ import annotations

import errno
import os
import posixpath

from .paths import path_problem

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EEXIST: "conflict",
    errno.ENOTEMPTY: "conflict",
    errno.EISDIR: "invalid_request",
    errno.ENOTDIR: "invalid_request",
    errno.ENAMETOOLONG: "invalid_request",
    errno.ELOOP: "invalid_request",
    errno.EXDEV: "invalid_request",
    errno.EINVAL: "invalid_request",
}


class FileError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_os(cls, exc: OSError, path: str) -> FileError:
        code = ERRNO_CODES.get(exc.errno or 0, "server_error")
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if code == "disk_full":
            reason = "no space left: the sandbox's disk limit is reached"
        return cls(code, f"{path}: {reason}")


# Never changed through the file API, whatever its roots (a sandbox given "/" may read them): the kernel's
# interfaces (the agent's own /proc/1/mem among them) and Corral's directory.
NEVER_WRITTEN = ("/proc", "/sys", "/.corral")


def check_path(value: Any, roots: Any = None, *, write: bool = False) -> str:
    """Validate a request path: absolute, valid UTF-8, no NUL; inside `roots` when given; for an operation that
    changes it (`write`), not in `NEVER_WRITTEN`."""
    problem = path_problem(value)
    if problem is not None:  # the host's front ends refused it already (the same rule); a request is an edge too
        raise FileError("invalid_request", f"path {problem}")
    given: str = value
    if not given.startswith("/"):
        raise FileError("invalid_request", f"path {given!r} is not absolute")
    path = posixpath.normpath(given)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if roots:
        _check_roots(path, roots)
    if write:
        _check_writable(path)
    return path


# Never read through the file API either, whatever the roots: /proc but its read-only /proc/sys (/proc/self
# there would be the agent itself, whose environ held its token and whose memory holds it), and Corral's directory.
NEVER_READ = ("/proc", "/.corral")
READABLE_IN_PROC = "/proc/sys/"


def _check_writable(path: str) -> None:
    real = os.path.realpath(path)
    for kept in NEVER_WRITTEN:
        if real == kept or real.startswith(kept + "/"):
            raise FileError("permission_denied", f"{path} is in {kept}, which the file API never changes")


def _check_readable(real: str, path: str) -> None:
    for kept in NEVER_READ:
        if (real == kept or real.startswith(kept + "/")) and not real.startswith(READABLE_IN_PROC):
            raise FileError("permission_denied", f"{path} is in {kept}, which the file API never touches")


def _check_links(path: str) -> None:
    """Refuse a path whose resolution goes through a symlink in /proc: `/dev/stdout` leads to `/proc/self/fd/1`,
    a magic link to what the agent's stdout is (its log on the host), which `realpath` would only show as the
    text of a host path outside /proc."""
    resolved, pending, hops = "/", [p for p in path.split("/") if p], 0
    while pending:
        name = pending.pop(0)
        if name in (".", ".."):
            resolved = resolved if name == "." else (os.path.dirname(resolved) or "/")
            continue
        candidate = os.path.join(resolved, name)
        try:
            target = os.readlink(candidate)
        except OSError:  # not a link (or not there): go on below it
            resolved = candidate
            continue
        hops += 1
        if hops > 40 or (candidate.startswith("/proc/") and not candidate.startswith(READABLE_IN_PROC)):
            raise FileError("permission_denied", f"{path} leads through {candidate}, which the file API never "
                            "touches")
        resolved = "/" if target.startswith("/") else resolved
        pending = [p for p in target.split("/") if p] + pending


def _check_roots(path: str, roots: list[str]) -> None:
    # Resolve symlinks of everything but a missing tail: a link that leads out of the roots is refused.
    _check_links(path)
    real = os.path.realpath(path)
    _check_readable(real, path)
    for root in roots:
        real_root = os.path.realpath(root)
        if real == real_root or real.startswith(real_root.rstrip("/") + "/"):
            return
    raise FileError("permission_denied",
                    f"{path} is outside the directories the file API may touch ({', '.join(roots)})")
