"""cgroup v1 and v2: which one the host runs, and the OOM-kill counter and usage of a sandbox's cgroup.

runc creates and removes the cgroups itself (from `linux.resources`); we read them, to tell an OOM kill from any
other SIGKILL, to report what a sandbox uses (`usage`), and check for leftovers; and `resize` writes a warm pool
member's new memory, CPU and pids limits at its claim (what `runc update` does, without a process: a claim
takes a millisecond, a runc process ten).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


@functools.cache  # a host does not switch hierarchies while it runs; `usage` asks every few seconds per sandbox
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


def frozen(cgroups_path: str) -> bool | None:
    """Whether the cgroup's freezer holds it frozen (or freezing), read from its one file; None when the file
    cannot tell (no such cgroup, no freezer: ask the runtime)."""
    rel = cgroups_path.lstrip("/")
    try:
        if is_v2():
            return (CGROUP_ROOT / rel / "cgroup.freeze").read_text().strip() == "1"
        return (CGROUP_ROOT / "freezer" / rel / "freezer.state").read_text().strip() in ("FROZEN", "FREEZING")
    except OSError:
        return None


def resize(cgroups_path: str, *, memory: int, cpu_quota: int, cpu_period: int, pids: int, swap: bool) -> None:
    """Set the cgroup's memory limit (and memory+swap to the same, `swap`: no swap at all, as the bundle does),
    CPU quota and pids limit. Raises OSError if the kernel refuses (e.g. a limit under what is used already)."""
    rel = cgroups_path.lstrip("/")
    if is_v2():
        cgroup = CGROUP_ROOT / rel
        _write(cgroup / "memory.max", memory)
        if swap:
            _write(cgroup / "memory.swap.max", 0)
        (cgroup / "cpu.max").write_text(f"{cpu_quota} {cpu_period}")
        _write(cgroup / "pids.max", pids)
        return
    mem = CGROUP_ROOT / "memory" / rel
    current = int((mem / "memory.limit_in_bytes").read_text())
    # v1 refuses memory > memory+swap at every step: raise memsw first when growing, lower it last when shrinking.
    order = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"] if memory > current else \
        ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    for name in order:
        if swap or name == "memory.limit_in_bytes":
            _write(mem / name, memory)
    _write(CGROUP_ROOT / "cpu" / rel / "cpu.cfs_period_us", cpu_period)
    _write(CGROUP_ROOT / "cpu" / rel / "cpu.cfs_quota_us", cpu_quota)
    _write(CGROUP_ROOT / "pids" / rel / "pids.max", pids)


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


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


# -- usage: CPU time, memory and limits, from the few files the kernel keeps per cgroup ----------------------

_UNLIMITED = 1 << 62  # v1 writes "no limit" as PAGE_COUNTER_MAX pages in bytes (9223372036854771712)


@dataclass(frozen=True, slots=True)
class CgroupUsage:
    cpu_seconds: float
    memory_bytes: int  # charged minus inactive file cache: what reclaim cannot simply drop (tmpfs stays in)
    memory_cache_bytes: int
    memory_limit: int | None  # None: no limit
    cpus: float | None  # the CFS quota in CPUs; None: no quota


def usage(cgroups_path: str) -> CgroupUsage | None:
    """What the cgroup's processes use now; None if the cgroup is gone (or goes while it is read).

    v1: the same relative path under each controller's hierarchy (runc and Docker name one path for all)."""
    rel = cgroups_path.lstrip("/")
    try:
        if is_v2():
            return usage_v2(CGROUP_ROOT / rel)
        return usage_v1(CGROUP_ROOT / "memory" / rel, CGROUP_ROOT / "cpu" / rel, CGROUP_ROOT / "cpuacct" / rel)
    except (OSError, ValueError):
        return None


def usage_v2(cgroup: Path) -> CgroupUsage:
    """From `cpu.stat`, `memory.current`, `memory.stat`, `memory.max` and `cpu.max` (five reads)."""
    cpu = _keyed(cgroup / "cpu.stat", "usage_usec")
    stat = _keyed(cgroup / "memory.stat", "file", "inactive_file")
    charged = int(_read(cgroup / "memory.current"))
    limit = _read(cgroup / "memory.max").strip()
    quota, _, period = _read(cgroup / "cpu.max").partition(b" ")
    return CgroupUsage(cpu_seconds=cpu["usage_usec"] / 1e6,
                       memory_bytes=max(0, charged - stat["inactive_file"]),
                       memory_cache_bytes=stat["file"],
                       memory_limit=None if limit == b"max" else int(limit),
                       cpus=None if quota == b"max" else int(quota) / int(period))


def usage_v1(memory: Path, cpu: Path, cpuacct: Path) -> CgroupUsage:
    """From `cpuacct.usage`, `memory.usage_in_bytes`, `memory.stat` (its hierarchical `total_*` lines),
    `memory.limit_in_bytes`, `cpu.cfs_quota_us` and `cpu.cfs_period_us` (six reads)."""
    stat = _keyed(memory / "memory.stat", "total_cache", "total_inactive_file")
    charged = int(_read(memory / "memory.usage_in_bytes"))
    limit = int(_read(memory / "memory.limit_in_bytes"))
    quota = int(_read(cpu / "cpu.cfs_quota_us"))
    return CgroupUsage(cpu_seconds=int(_read(cpuacct / "cpuacct.usage")) / 1e9,
                       memory_bytes=max(0, charged - stat["total_inactive_file"]),
                       memory_cache_bytes=stat["total_cache"],
                       memory_limit=None if limit >= _UNLIMITED else limit,
                       cpus=None if quota < 0 else quota / int(_read(cpu / "cpu.cfs_period_us")))


def _keyed(path: Path, *keys: str) -> dict[str, int]:
    """The `key value` lines of a cgroup file that are wanted; `ValueError` if one is missing."""
    wanted = {key.encode(): key for key in keys}
    found: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(b" ")
        if key in wanted:
            found[wanted[key]] = int(value)
    if len(found) != len(keys):
        raise ValueError(f"{path} lacks {sorted(set(keys) - set(found))}")
    return found


def _read(path: Path) -> bytes:
    """One cgroup file in one read (each is at most a page or two): a third cheaper than `Path.read_text`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)
