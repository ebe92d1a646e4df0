"""What a Docker host, its daemon and a spec must offer before the Docker backend creates a sandbox there.

`DockerBackend`'s preflight (`_backend`) fails closed on any problem these name: the host (root, the disk tools),
the daemon (Linux containers, seccomp, no userns-remap nor rootless, the cgroup limits, `runc`), and a spec's
volume paths against Corral's own mounts and the template. Checks over what they are given, apart from the backend's
lifecycle so that each reads alone.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..._exceptions import InvalidRequestError
from .._spec import SandboxSpec
from ..local import _disk
from ._api import START_HINT
from ._container import volume_path_problem

__all__ = ["check_volume_paths", "daemon_problems", "host_problems"]


def check_volume_paths(spec: SandboxSpec, rootfs: Path | None) -> None:
    """`InvalidRequestError` for a volume path the container cannot take: above Corral's own mounts, or (with the
    template's root) through something of the template that is not a directory."""
    for path in spec.volumes:
        problem = volume_path_problem(path) or (_template_problem(rootfs, path) if rootfs is not None else None)
        if problem is not None:
            raise InvalidRequestError(f"volume mount path {path!r}: {problem}", details={"path": path})


def _template_problem(rootfs: Path, path: str) -> str | None:
    """A symlink on the way (Debian's `/lib`: the mount would land where it points) or a file, in the template."""
    here = rootfs
    for name in path.split("/")[1:]:
        here = here / name
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return None  # the runtime makes the rest, in the container's own layer
        if not stat.S_ISDIR(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "a file"
            return f"/{here.relative_to(rootfs)} is {kind} in the template, not a directory; mount it elsewhere"
    return None


def host_problems() -> list[str]:
    found: list[str] = []
    if os.geteuid() != 0:
        found.append("Corral's Docker backend must run as root (it loop-mounts each sandbox's disk)")
    found += [f"missing: {m}" for m in _disk.require_tools()]
    return found


def daemon_problems(info: Mapping[str, Any]) -> list[str]:
    """What the daemon lacks for the isolation `_container` asks for (Docker would otherwise start the container
    with less, and only warn)."""
    found: list[str] = []
    options = " ".join(info.get("SecurityOptions") or [])
    if info.get("OSType") != "linux":
        found.append(f"the Docker daemon runs {info.get('OSType')!r} containers, not Linux ones")
    if "name=seccomp" not in options:
        found.append("the Docker daemon has no seccomp support (build it with seccomp, or use the local backend)")
    if "name=userns" in options or "name=rootless" in options:
        found.append("the Docker daemon remaps users daemon-wide (userns-remap) or runs rootless: the Docker "
                     "backend needs the sandbox user to be uid 1000 of the host (turn userns-remap off, or use "
                     "the local backend, which gives each sandbox its own user namespace)")
    for key, what in (("MemoryLimit", "memory"), ("PidsLimit", "pids"), ("CpuCfsQuota", "CPU quota")):
        if not info.get(key):
            found.append(f"the Docker daemon cannot apply {what} limits (enable that cgroup controller)")
    if "runc" not in (info.get("Runtimes") or {}):
        found.append("the Docker daemon has no `runc` runtime")
    if not found and not info:
        found.append(f"the Docker daemon is not reachable; {START_HINT}")
    return found
