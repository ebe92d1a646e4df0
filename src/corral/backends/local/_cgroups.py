"""cgroup v1 and v2: which one the host runs, and the OOM-kill counter of a sandbox's cgroup.

runc creates and removes the cgroups itself (from `linux.resources`); we only read them, to tell an OOM kill
from any other SIGKILL, and check for leftovers.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


def is_v2() -> bool:
    """A pure v2 host (a hybrid host has v2 only at /sys/fs/cgroup/unified, with no controllers)."""
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def missing_controllers() -> list[str]:
    if is_v2():
        available = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        return [c for c in ("memory", "pids", "cpu") if c not in available]
    return [c for c in V1_CONTROLLERS if not (CGROUP_ROOT / c / "cgroup.procs").exists()]


def swap_accounting() -> bool:
    if is_v2():
        return True
    return (CGROUP_ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()


def cgroup_dirs(cgroups_path: str) -> list[Path]:
    """Every directory that holds this cgroup (one per v1 controller, or the one v2 directory)."""
    rel = cgroups_path.lstrip("/")
    if is_v2():
        return [CGROUP_ROOT / rel]
    return [CGROUP_ROOT / c / rel for c in ("memory", "pids", "cpu", "cpuacct", "cpuset", "freezer",
                                              "devices", "blkio", "systemd", "unified")]


def oom_kills(cgroups_path: str) -> int:
    """How many processes the kernel's OOM killer has killed in this cgroup so far."""
    rel = cgroups_path.lstrip("/")
    path = CGROUP_ROOT / rel / "memory.events" if is_v2() else CGROUP_ROOT / "memory" / rel / "memory.oom_control"
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def memory_usage(cgroups_path: str) -> int:
    rel = cgroups_path.lstrip("/")
    path = (CGROUP_ROOT / rel / "memory.current" if is_v2()
            else CGROUP_ROOT / "memory" / rel / "memory.usage_in_bytes")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def leftover(cgroups_path: str) -> list[Path]:
    return [d for d in cgroup_dirs(cgroups_path) if d.exists()]


def remove(cgroups_path: str) -> None:
    """Remove empty leftover cgroup directories (deepest first); never touches a populated one."""
    for d in cgroup_dirs(cgroups_path):
        try:
            os.rmdir(d)
        except OSError:
            pass


def pids(cgroups_path: str) -> list[int]:
    found: set[int] = set()
    for d in cgroup_dirs(cgroups_path):
        try:
            found |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            continue
    return sorted(found)


def kill_all(cgroups_path: str) -> None:
    """SIGKILL whatever still runs in the cgroup (a runtime that gave up, an engine that crashed)."""
    for pid in pids(cgroups_path):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def remove_parent(cgroups_path: str) -> None:
    """Remove the parent that runc created for our sandboxes (`/corral`), if no sandbox is left in it."""
    parent = cgroups_path.rstrip("/").rsplit("/", 1)[0]
    if parent:
        remove(parent)
