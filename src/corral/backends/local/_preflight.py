"""Fail closed: before any sandbox starts, check that everything isolation needs is really there.

Each missing piece is named with how to get it; nothing ever runs unsandboxed for want of one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..._exceptions import RuntimeUnavailableError
from . import _cgroups, _disk
from ._runtime import INSTALL_HINT


def problems(runtime: str) -> list[str]:
    found: list[str] = []
    if os.geteuid() != 0:
        found.append("Corral's local backend must run as root (it mounts filesystems and creates cgroups)")
    if shutil.which(runtime) is None:
        found.append(f"the OCI runtime {runtime!r} is missing: {INSTALL_HINT.get(runtime, runtime)}")
    found += _namespace_problems()
    if not _has_filesystem("overlay"):
        found.append("overlayfs is not available: modprobe overlay")
    missing = _cgroups.missing_controllers()
    if missing:
        found.append(f"cgroup controllers missing: {', '.join(missing)} (mount them, or boot with cgroup v2)")
    found += [f"missing: {m}" for m in _disk.require_tools()]
    return found


def path_problems(path: Path) -> list[str]:
    """Sandbox roots live under `path`; a sandbox's root (an unprivileged host uid) must be able to reach them."""
    found = []
    for parent in [path, *path.parents]:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue
        if not mode & 0o001:
            found.append(f"{parent} is not traversable by other users (mode {mode & 0o777:o}), so sandboxes "
                         f"cannot reach their root filesystems under it: `chmod o+x {parent}` or choose another "
                         "CORRAL_HOME")
    return found


def check(runtime: str, home: Path | None = None) -> None:
    found = problems(runtime) + (path_problems(home) if home is not None else [])
    if found:
        raise RuntimeUnavailableError(
            "cannot create sandboxes safely, so none will be created: " + "; ".join(found),
            details={"problems": found},
        )


def _namespace_problems() -> list[str]:
    found = []
    max_userns = Path("/proc/sys/user/max_user_namespaces")
    try:
        if int(max_userns.read_text()) == 0:
            found.append("user namespaces are disabled: sysctl -w user.max_user_namespaces=15000")
    except (OSError, ValueError):
        found.append("user namespaces are not supported by this kernel (no /proc/sys/user/max_user_namespaces)")
    for ns in ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup"):
        if not Path(f"/proc/self/ns/{ns}").exists():
            found.append(f"the kernel lacks {ns} namespaces")
    return found


def _has_filesystem(name: str) -> bool:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return False
    return any(line.split()[-1] == name for line in text.splitlines() if line.strip())
