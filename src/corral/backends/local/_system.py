"""The host: running its tools (runc, mount, mkfs) at the subprocess boundary, where their errors become ours;
reading its free memory and disk (what `LocalBackend.capacity` reports); and this process's open-files limit,
raised at start and checked before each create (docs/performance.md, "Density")."""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Sequence
from pathlib import Path

from ..._exceptions import CapacityError, RuntimeUnavailableError, ServerError


async def run(argv: Sequence[str], *, what: str, timeout: float = 60.0, check: bool = True,
              pass_fds: Sequence[int] = (), stdin_fd: int | None = None) -> tuple[int, str]:
    """Run a host command; return (exit code, combined output). Failures name `what` was being done."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin_fd if stdin_fd is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            pass_fds=tuple(pass_fds),
        )
    except FileNotFoundError as exc:
        raise RuntimeUnavailableError(f"{what}: {argv[0]} is not installed") from exc
    except OSError as exc:
        raise ServerError(f"{what}: could not start {argv[0]}: {exc}") from exc
    try:
        async with asyncio.timeout(timeout):
            out, _ = await proc.communicate()
    except TimeoutError as exc:
        proc.kill()
        await proc.wait()
        raise ServerError(f"{what}: {argv[0]} did not finish within {timeout:.0f}s") from exc
    text = out.decode(errors="replace").strip()
    code = proc.returncode if proc.returncode is not None else -1
    if check and code != 0:
        raise ServerError(f"{what} failed: {' '.join(argv[:3])}... exited {code}: {text[-2000:]}")
    return code, text


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


def free_disk(path: Path) -> int:
    """Bytes free to unprivileged users on the filesystem that holds `path` (or, before it exists, its parent)."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except FileNotFoundError:
            continue
        return st.f_bavail * st.f_frsize
    raise FileNotFoundError(path)


# -- open files: what the engine's process holds per sandbox ------------------------------------------------------

OPEN_FILES_WANTED = 1 << 16  # enough for thousands of sandboxes (each holds an egress listener, and more in use)
OPEN_FILES_PER_CREATE = 64  # headroom a create needs at once: runc's pipes, mount descriptors, sockets


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit towards `wanted`, never past the hard limit (raising that
    needs CAP_SYS_RESOURCE) and never lowering it; return (soft, hard) as they are then.

    The usual soft limit of a login shell or a systemd service is 1024, which a server with a few hundred
    sandboxes (and their egress listeners, agent connections and runc pipes) runs out of; the hard limit is
    much higher. Children inherit the raised soft limit; the sandbox's own is set in its bundle.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, hard
        soft = target
    return soft, hard


def open_files() -> int:
    """How many descriptors this process holds now (a count of /proc/self/fd)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def check_open_files(per_create: int = OPEN_FILES_PER_CREATE) -> None:
    """Refuse a create (`CapacityError`, resource `open_files`) when this process has fewer than `per_create`
    descriptors left under its soft limit: better a clear refusal than an EMFILE halfway through a create."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    current = open_files()
    if current + per_create > soft:
        raise CapacityError(
            f"this server holds {current} open files of its limit of {soft} (RLIMIT_NOFILE) and a new sandbox "
            f"needs about {per_create} more; raise the limit (`ulimit -n`, systemd's LimitNOFILE) or wait for "
            "sandboxes to end", details={"resource": "open_files", "retry_after": 10, "limit": soft,
                                         "current": current, "requested": per_create})
