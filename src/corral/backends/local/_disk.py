"""Per-sandbox disk quota: a sparse ext4 image, loop-mounted, that holds the overlay's upper layer.

A full image gives ENOSPC inside the sandbox and never touches the host's free space beyond its size.
`mkfs` per create is slow, so each size is formatted once into a cached golden image and copied sparsely
(holes stay holes: a fresh 1 GiB image costs a few MiB of real disk).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
from pathlib import Path

from ..._exceptions import RuntimeUnavailableError, ServerError
from ._system import run

FICLONE = 0x40049409


class DiskImages:
    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self._locks: dict[int, asyncio.Lock] = {}

    async def golden(self, size: int) -> Path:
        path = self.cache_dir / f"ext4-{size}.img"
        if path.exists():
            return path
        lock = self._locks.setdefault(size, asyncio.Lock())
        async with lock:
            if path.exists():
                return path
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.truncate(size)
            # No journal and lazy init: this filesystem lives and dies with one sandbox.
            await run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
                       "-E", "lazy_itable_init=1,nodiscard", "-L", "corral", str(tmp)],
                      what="formatting a sandbox disk image")
            os.replace(tmp, path)
            return path

    async def create(self, size: int, dest: Path) -> None:
        golden = await self.golden(size)
        await asyncio.to_thread(sparse_copy, golden, dest)


def sparse_copy(src: Path, dest: Path) -> None:
    """Copy keeping holes: reflink when the filesystem can, else data extents only."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return
        except OSError:
            pass
        size = os.fstat(fin.fileno()).st_size
        offset = 0
        while offset < size:
            try:
                data = os.lseek(fin.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                break
            hole = os.lseek(fin.fileno(), data, os.SEEK_HOLE)
            fin.seek(data)
            fout.seek(data)
            remaining = hole - data
            while remaining:
                chunk = fin.read(min(remaining, 4 * 1024 * 1024))
                fout.write(chunk)
                remaining -= len(chunk)
            offset = hole
        fout.truncate(size)


async def mount_image(image: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    await run(["mount", "-o", "loop,nosuid,nodev", str(image), str(target)], what="mounting the sandbox disk")


async def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    await run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)], what="mounting the overlay root")


async def unmount(target: Path) -> None:
    """Unmount `target` if it is a mount point (lazily if busy); detaches loop devices it held."""
    if not is_mounted(target):
        return
    try:
        await run(["umount", str(target)], what=f"unmounting {target}")
    except ServerError:
        await run(["umount", "-l", str(target)], what=f"lazily unmounting {target}")


def is_mounted(path: Path) -> bool:
    wanted = os.fspath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if _unescape(line.split()[4]) == wanted:
                return True
    return False


def mounts_under(prefix: Path) -> list[str]:
    wanted = os.fspath(prefix).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point.startswith(wanted):
                found.append(point)
    return found


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def require_tools() -> list[str]:
    missing = []
    for tool, pkg in (("mkfs.ext4", "e2fsprogs"), ("mount", "mount"), ("umount", "mount")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install {pkg})")
    if not Path("/dev/loop-control").exists():
        missing.append("loop devices (/dev/loop-control; modprobe loop)")
    return missing


__all__ = ["DiskImages", "RuntimeUnavailableError", "is_mounted", "mount_image", "mount_overlay",
           "mounts_under", "require_tools", "unmount"]
