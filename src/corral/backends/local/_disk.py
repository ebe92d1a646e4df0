"""Per-sandbox disk quota: a sparse ext4 image, loop-mounted, that holds the overlay's upper layer.

A full image gives ENOSPC inside the sandbox and never touches the host's free space beyond its size.
`mkfs` per create is slow, so each size is formatted once into a cached golden image and copied sparsely
(holes stay holes: a fresh 1 GiB image costs a few MiB of real disk).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import shutil
import struct
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


class _Mounts:
    """mount(2), umount2(2) and loop devices through libc: a `mount` process per call costs ~10 ms."""

    MS_NOSUID, MS_NODEV = 0x2, 0x4
    MNT_DETACH = 0x2
    LOOP_CTL_GET_FREE, LOOP_CONFIGURE = 0x4C82, 0x4C0A
    LO_FLAGS_AUTOCLEAR = 4
    # struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
    # struct loop_info64 { u64 x5; u32 lo_number, encrypt_type, key_size, lo_flags; u8 names[64+64+32]; u64[2] }
    LOOP_CONFIG = struct.Struct("=II5QIIII64s64s32s2Q8Q")

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)

    def mount(self, source: str, target: str, fstype: str, flags: int, data: str | None) -> None:
        rc = self.libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                             data.encode() if data is not None else None)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")

    def umount(self, target: str, flags: int = 0) -> None:
        if self.libc.umount2(target.encode(), flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {target}: {os.strerror(err)}")

    def attach_loop(self, image: Path) -> tuple[str, int]:
        """Attach `image` to a free loop device that detaches itself once unused; return its path and an open fd.

        Autoclear means detach at the last close: keep the fd open until the filesystem is mounted.
        """
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):  # another attach may win the device between GET_FREE and CONFIGURE
                number = fcntl.ioctl(ctl, self.LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{number}"
                loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                try:
                    config = self.LOOP_CONFIG.pack(backing, 0, 0, 0, 0, 0, 0, 0, 0, 0, self.LO_FLAGS_AUTOCLEAR,
                                                   b"", b"", b"", 0, 0, *([0] * 8))
                    fcntl.ioctl(loop, self.LOOP_CONFIGURE, config)
                    return dev, loop
                except OSError as exc:
                    os.close(loop)
                    if exc.errno != errno.EBUSY:
                        raise
            raise OSError(errno.EBUSY, "no free loop device after 64 tries")
        finally:
            os.close(backing)
            os.close(ctl)


_mounts = _Mounts()


def _mount_image_sync(image: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    dev, fd = _mounts.attach_loop(image)
    try:
        # noinit_itable: no background zeroing of inode tables (lazy_itable_init at mkfs) on a throwaway disk
        _mounts.mount(dev, str(target), "ext4", _Mounts.MS_NOSUID | _Mounts.MS_NODEV, "noinit_itable")
    finally:
        os.close(fd)  # mounted: the filesystem holds the device now; unmounted or failed: it detaches


async def mount_image(image: Path, target: Path) -> None:
    try:
        await asyncio.to_thread(_mount_image_sync, image, target)
    except OSError as exc:
        raise ServerError(f"mounting the sandbox disk failed: {exc}") from exc


async def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    try:
        await asyncio.to_thread(_mounts.mount, "overlay", str(target), "overlay", 0, opts)
    except OSError as exc:
        raise ServerError(f"mounting the overlay root failed: {exc}") from exc


async def unmount(target: Path) -> None:
    """Unmount `target` if it is a mount point (lazily if busy); loop devices detach themselves (autoclear)."""
    if not is_mounted(target):
        return
    try:
        await asyncio.to_thread(_mounts.umount, str(target))
    except OSError:
        try:
            await asyncio.to_thread(_mounts.umount, str(target), _Mounts.MNT_DETACH)
        except OSError as exc:
            raise ServerError(f"unmounting {target} failed: {exc}") from exc


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
    for tool, pkg in (("mkfs.ext4", "e2fsprogs"),):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install {pkg})")
    if not Path("/dev/loop-control").exists():
        missing.append("loop devices (/dev/loop-control; modprobe loop)")
    return missing


__all__ = ["DiskImages", "RuntimeUnavailableError", "is_mounted", "mount_image", "mount_overlay",
           "mounts_under", "require_tools", "unmount"]
