"""The host: running its tools (runc, mount, mkfs) at the subprocess boundary, where their errors become ours;
and reading its free memory and disk (what `LocalBackend.capacity` reports)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

from ..._exceptions import RuntimeUnavailableError, ServerError


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
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
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
