"""How much of the machine sandboxes may take, and the check `Engine.create` makes before starting one.

Tenant quotas (the control plane's) protect tenants from each other; this protects the machine: past it a new
sandbox would start swapping or fill the host disk and hurt every sandbox already running. A refusal is a
`CapacityError` (HTTP 503 with `Retry-After`) that says which resource is short and by how much, and nothing is
created. Four signals, each cheap to read:

* the number of sandboxes (optional cap);
* memory promised: the sum of memory limits may exceed physical memory by `memory_overcommit` (sandboxes rarely
  use their whole limit; the kernel's cgroup limit still holds each one);
* memory available now (`MemAvailable`): what the kernel could give without swapping;
* free disk in the state directory: sandbox disks are sparse and grow as they are written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .._exceptions import CapacityError

__all__ = ["Capacity", "MachineUsage"]

_MiB = 1024**2
_GiB = 1024**3
_PRESSURE_RETRY = 10  # seconds: memory or disk pressure changes as sandboxes end, not on a schedule


@dataclass(frozen=True)
class MachineUsage:
    """What is promised to sandboxes right now (including those being created)."""

    sandboxes: int
    memory: int


@dataclass(frozen=True)
class Capacity:
    """The machine's limits for sandboxes.

    **Parameters:**
    * **max_sandboxes** - at most this many at once (None: no count limit; memory and disk still apply).
    * **memory_overcommit** - memory limits may add up to this many times physical memory.
    * **min_free_memory** - refuse while the kernel reports less available memory than this (bytes).
    * **min_free_disk** - refuse while the state directory's filesystem has less free space than this (bytes).
    """

    max_sandboxes: int | None = None
    memory_overcommit: float = 4.0
    min_free_memory: int = 256 * _MiB
    min_free_disk: int = 1 * _GiB

    def check(self, usage: MachineUsage, memory: int, home: Path, *, retry_after: int) -> None:
        """Raise `CapacityError` if one more sandbox with `memory` bytes of limit does not fit."""
        if self.max_sandboxes is not None and usage.sandboxes + 1 > self.max_sandboxes:
            _refuse(f"this machine runs at most {self.max_sandboxes} sandboxes and all are in use",
                    "max_sandboxes", retry_after, limit=self.max_sandboxes, current=usage.sandboxes)
        total, available = _meminfo()
        allowed = int(total * self.memory_overcommit)
        if usage.memory + memory > allowed:
            _refuse(f"memory promised to sandboxes would reach {_fmt(usage.memory + memory)}, over this machine's "
                    f"{_fmt(allowed)} ({self.memory_overcommit:g} x {_fmt(total)} physical); ask for a smaller "
                    "memory limit or wait for sandboxes to end", "memory_overcommit", retry_after,
                    limit=allowed, current=usage.memory, requested=memory)
        if available < self.min_free_memory:
            _refuse(f"the machine is short of memory ({_fmt(available)} available, {_fmt(self.min_free_memory)} "
                    "kept free)", "min_free_memory", _PRESSURE_RETRY, limit=self.min_free_memory, current=available)
        free = _free_disk(home)
        if free < self.min_free_disk:
            _refuse(f"the disk holding {home} is nearly full ({_fmt(free)} free, {_fmt(self.min_free_disk)} kept "
                    "free)", "min_free_disk", _PRESSURE_RETRY, limit=self.min_free_disk, current=free)


def _refuse(message: str, resource: str, retry_after: int, **figures: int) -> None:
    raise CapacityError(message, details={"resource": resource, "retry_after": retry_after, **figures})


def _meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0]) * 1024
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


def _free_disk(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fmt(n: int) -> str:
    return f"{n / _GiB:.1f} GiB" if n >= _GiB else f"{n / _MiB:.0f} MiB"
