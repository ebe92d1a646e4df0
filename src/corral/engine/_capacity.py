"""How much of the machine sandboxes may take, and the check `Engine.create` makes before starting one.

Tenant quotas (the control plane's) protect tenants from each other; this protects the machine: past it a new
sandbox would start swapping or fill the host disk and hurt every sandbox already running. A refusal is a
`CapacityError` (HTTP 503 with `Retry-After`) that says which resource is short and by how much, and nothing is
created. The figures come from the backend (`Backend.capacity`, which the engine reads just before the check);
a figure the backend does not give (None) is not checked. Five signals:

* the number of sandboxes (an optional cap of ours, and any hard count the backend imposes);
* memory promised: the sum of memory limits may exceed the backend's total memory by `memory_overcommit`
  (sandboxes rarely use their whole limit; the kernel's cgroup limit still holds each one);
* memory available now (on a host, `MemAvailable`): what could be given without swapping;
* free disk where sandbox disks grow: they are sparse and grow as they are written.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._exceptions import CapacityError
from ..backends import BackendCapacity

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
    * **memory_overcommit** - memory limits may add up to this many times the backend's total memory.
    * **min_free_memory** - refuse while the backend reports less available memory than this (bytes).
    * **min_free_disk** - refuse while the backend reports less free disk than this (bytes).
    """

    max_sandboxes: int | None = None
    memory_overcommit: float = 4.0
    min_free_memory: int = 256 * _MiB
    min_free_disk: int = 1 * _GiB

    def check(self, usage: MachineUsage, memory: int, figures: BackendCapacity, *, retry_after: int) -> None:
        """Raise `CapacityError` if one more sandbox with `memory` bytes of limit does not fit. No I/O: the
        engine checks and counts a create with no await in between."""
        if self.max_sandboxes is not None and usage.sandboxes + 1 > self.max_sandboxes:
            _refuse(f"this machine runs at most {self.max_sandboxes} sandboxes and all are in use",
                    "max_sandboxes", retry_after, limit=self.max_sandboxes, current=usage.sandboxes)
        if figures.sandboxes_max is not None and usage.sandboxes + 1 > figures.sandboxes_max:
            _refuse(f"the backend runs at most {figures.sandboxes_max} sandboxes and all are in use",
                    "sandboxes_max", retry_after, limit=figures.sandboxes_max, current=usage.sandboxes)
        if figures.memory_total is not None:
            total = figures.memory_total
            allowed = int(total * self.memory_overcommit)
            if usage.memory + memory > allowed:
                _refuse(f"memory promised to sandboxes would reach {_fmt(usage.memory + memory)}, over this "
                        f"machine's {_fmt(allowed)} ({self.memory_overcommit:g} x {_fmt(total)} physical); ask for "
                        "a smaller memory limit or wait for sandboxes to end", "memory_overcommit", retry_after,
                        limit=allowed, current=usage.memory, requested=memory)
        available = figures.memory_available
        if available is not None and available < self.min_free_memory:
            _refuse(f"the machine is short of memory ({_fmt(available)} available, {_fmt(self.min_free_memory)} "
                    "kept free)", "min_free_memory", _PRESSURE_RETRY, limit=self.min_free_memory, current=available)
        free = figures.disk_free
        if free is not None and free < self.min_free_disk:
            _refuse(f"the disk sandboxes grow on is nearly full ({_fmt(free)} free, {_fmt(self.min_free_disk)} "
                    "kept free)", "min_free_disk", _PRESSURE_RETRY, limit=self.min_free_disk, current=free)

    def room(self, usage: MachineUsage, memory: int, figures: BackendCapacity) -> int | None:
        """How many more sandboxes with `memory` bytes of limit `check` would let in now, one after another (None:
        no count or memory-promise bound). What bounds a self-sizing warm pool, which must not fill up to a
        refusal."""
        available, free = figures.memory_available, figures.disk_free
        if (available is not None and available < self.min_free_memory) or \
                (free is not None and free < self.min_free_disk):
            return 0
        bounds = [limit - usage.sandboxes for limit in (self.max_sandboxes, figures.sandboxes_max) if limit is not None]
        if figures.memory_total is not None and memory > 0:
            bounds.append((int(figures.memory_total * self.memory_overcommit) - usage.memory) // memory)
        return max(0, min(bounds)) if bounds else None


def _refuse(message: str, resource: str, retry_after: int, **figures: int) -> None:
    raise CapacityError(message, details={"resource": resource, "retry_after": retry_after, **figures})


def _fmt(n: int) -> str:
    return f"{n / _GiB:.1f} GiB" if n >= _GiB else f"{n / _MiB:.0f} MiB"
