"""The host's mount table and the few mount calls both host backends make (the local one for sandbox disks and
layers, both for volumes): one place that parses /proc/self/mountinfo and unmounts, through libc.

A leaf of `corral.backends`: the standard library and the error tree only.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

from .._exceptions import ServerError

__all__ = ["MountEntry", "finish_first", "in_thread", "loop_backing", "mount_table", "umount"]

T = TypeVar("T")
MNT_DETACH = 0x2
libc = ctypes.CDLL(None, use_errno=True)


class MountEntry(NamedTuple):
    device: str  # major:minor
    source: str  # what was mounted: a device (/dev/loopN), or a name (overlay, tmpfs)


def mount_table() -> dict[str, MountEntry]:
    """Every mount point of this mount namespace (by its real path: mount points are resolved)."""
    found: dict[str, MountEntry] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-", 6)  # after the optional fields: filesystem type, source, super options
            found[_unescape(fields[4])] = MountEntry(fields[2], _unescape(fields[sep + 2]))
    return found


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def umount(target: Path) -> None:
    """Unmount `target`, lazily if it is busy; not a mount point (any more) is fine."""
    path = os.fsencode(target)
    if libc.umount2(path, 0) == 0:
        return
    if libc.umount2(path, MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise ServerError(f"unmounting {target} failed: {os.strerror(err)}")


def loop_backing(source: str) -> Path | None:
    """The file a loop device (`/dev/loopN`) serves, if it is one."""
    name = source.removeprefix("/dev/")
    if not name.startswith("loop") or "/" in name:
        return None
    try:
        text = (Path("/sys/block") / name / "loop" / "backing_file").read_text().rstrip("\n")
    except OSError:
        return None
    return Path(text.removesuffix(" (deleted)"))


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """`asyncio.to_thread`, but a cancelled caller still waits for the thread to finish (a few ms of syscalls).

    Otherwise a create cancelled during a mount runs its cleanup while the thread is still mounting, and the
    mount lands after the cleanup looked for it: a leaked mount.
    """
    return await finish_first(asyncio.to_thread(fn, *args))


async def finish_first(aw: Awaitable[T]) -> T:
    """Await `aw`; if the caller is cancelled meanwhile, let `aw` finish first, then raise the cancellation.

    For steps whose effects cleanup must see: a mount being made, a runtime creating a container.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True  # keep waiting for it, then pass the cancellation on
        except BaseException:  # its own failure: task.result() below raises it
            break
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return task.result()
