"""What a sandbox uses now (`Backend.usage`): its cgroup's counters and its own disk's filesystem.

Shared by the local and Docker backends, whose sandboxes both have a cgroup on this host and a loop-mounted ext4
disk image (`limits.disk`) that holds everything they write. Nine small reads (six cgroup files, five on v2; two
stats and a statvfs), inline: the service samples every sandbox every few seconds (docs/backends.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .._contract import SandboxUsage
from . import _cgroups, _disk
from ._system import meminfo

__all__ = ["sandbox_usage"]


def sandbox_usage(cgroups_path: str, disk: Path) -> SandboxUsage | None:
    """The usage of the sandbox whose cgroup is `cgroups_path` and whose disk is mounted at `disk`; None when
    either is gone (stopped, destroyed, or not made yet)."""
    at = time.time()
    cgroup = _cgroups.usage(cgroups_path)
    space = _disk.filesystem_usage(disk) if cgroup is not None else None
    if cgroup is None or space is None:
        return None
    # Sandboxes always have limits; a cgroup without one (made by hand) reports the host's figure instead.
    memory_limit = cgroup.memory_limit if cgroup.memory_limit is not None else meminfo()[0]
    cpus = cgroup.cpus if cgroup.cpus is not None else float(os.cpu_count() or 1)
    return SandboxUsage(cpu_seconds=cgroup.cpu_seconds, memory_bytes=cgroup.memory_bytes,
                        memory_cache_bytes=cgroup.memory_cache_bytes, memory_limit=memory_limit,
                        disk_used=space[0], disk_total=space[1], cpus=cpus, at=at)
