"""Per-sandbox disk quota: a sparse ext4 image, loop-mounted, that holds the overlay's upper layer.

A full image gives ENOSPC inside the sandbox and never touches the host's free space beyond its size.
`mkfs` per create is slow, so each size is formatted once into a cached golden image and copied sparsely
(holes stay holes: a fresh 1 GiB image costs a few MiB of real disk).

And the other mounts of a sandbox, all through libc: its overlay root, the read-only overlay of the agent's
files, the tiny tmpfs of its egress socket, and their unmounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from ..._exceptions import CapacityError, RuntimeUnavailableError, ServerError
from .._mounts import finish_first, in_thread, mount_table
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

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_NOATIME = 0x1, 0x2, 0x4, 0x8, 0x400
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
_PROC_FDS = os.path.isdir("/proc/self/fd")  # where overlay layers can be named by descriptor (see mount_overlay)


# What LOOP_CTL_GET_FREE and LOOP_CONFIGURE answer when the machine has no loop device left to give: no free
# minor (ENOSPC), none that stays free (EBUSY), a device the kernel will not make (ENXIO, ENODEV).
_NO_LOOP_DEVICE = (errno.ENOSPC, errno.EBUSY, errno.ENXIO, errno.ENODEV)


class NoLoopDeviceError(OSError):
    """No loop device could be had for a sandbox's disk: the machine is full, not broken."""


def _attach(image: Path) -> tuple[str, int]:
    try:
        return _mounts.attach_loop(image)
    except OSError as exc:
        if exc.errno in _NO_LOOP_DEVICE:
            raise NoLoopDeviceError(exc.errno, f"no loop device for {image.name}: {exc.strerror}") from exc
        raise


def _mount_image_sync(image: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    dev, fd = _attach(image)
    try:
        # noinit_itable: no background zeroing of inode tables (lazy_itable_init at mkfs) on a throwaway disk
        # noatime: reading never writes, so an unchanged disk stays unchanged (`written_kbytes`: forks reuse the
        # layer of an unchanged parent), and reads cost no metadata writes.
        _mounts.mount(dev, str(target), "ext4", _Mounts.MS_NOSUID | _Mounts.MS_NODEV | _Mounts.MS_NOATIME,
                      "noinit_itable")
    finally:
        os.close(fd)  # mounted: the filesystem holds the device now; unmounted or failed: it detaches


def written_kbytes(mountpoint: Path) -> int | None:
    """KiB ever written to the ext4 filesystem mounted at `mountpoint`, after flushing what is dirty (None: not
    an ext4 mount). Equal figures mean nothing was written in between (the disk is mounted noatime)."""
    device = _mount_sources(under=mountpoint).get(os.fspath(mountpoint))
    if device is None or not device.startswith("/dev/"):
        return None
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _mounts.libc.syncfs(fd) != 0:
            return None
    finally:
        os.close(fd)
    try:
        return int(Path(f"/sys/fs/ext4/{os.path.basename(device)}/lifetime_write_kbytes").read_text())
    except (OSError, ValueError):
        return None


async def mount_image(image: Path, target: Path) -> None:
    try:
        await in_thread(_mount_image_sync, image, target)
    except NoLoopDeviceError as exc:
        used = loop_devices_in_use()
        raise CapacityError(f"no loop device is left for a sandbox disk ({used} in use: {exc.strerror}); wait for "
                            "sandboxes to end, or allow more (the loop module's max_loop, /dev/loop* nodes)",
                            details={"resource": "loop_devices", "retry_after": 10, "current": used}) from exc
    except OSError as exc:
        raise ServerError(f"mounting the sandbox disk failed: {exc}") from exc


async def mount_overlay(lower: Path | list[Path], upper: Path, work: Path, target: Path) -> None:
    """The sandbox's root: `upper` over `lower` (one directory, or several, top first)."""
    lowers = lower if isinstance(lower, list) else [lower]
    try:
        await in_thread(_mount_overlay_sync, lowers, upper, work, target)
    except OSError as exc:
        raise ServerError(f"mounting the overlay root failed: {exc}") from exc


def mount_readonly_layers(layers: list[Path], target: Path) -> None:
    """A read-only overlay of `layers` (top first, at least two) on `target`: the same files as a bind mount of
    the top one, but the root of a filesystem of its own. Blocking: call it in a thread.

    A bind mount shows its source's path inside its filesystem as the "root" field of /proc/self/mountinfo, in
    the sandbox too, and no mount option hides it; a mount of its own shows `/`. The layers are named by
    descriptor, as in `mount_overlay`, so that the options name no host path either. (overlayfs wants two
    layers when it has no upper one.)
    """
    target.mkdir(exist_ok=True)
    flags = _Mounts.MS_RDONLY | _Mounts.MS_NOSUID | _Mounts.MS_NODEV
    if not _PROC_FDS:
        _mounts.mount("overlay", str(target), "overlay", flags, "lowerdir=" + ":".join(map(str, layers)))
        return
    fds: list[int] = []
    try:
        for layer in layers:
            fds.append(os.open(layer, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        _mounts.mount("overlay", str(target), "overlay", flags,
                      "lowerdir=" + ":".join(f"/proc/self/fd/{fd}" for fd in fds))
    finally:
        for fd in fds:
            os.close(fd)


def mount_tmpfs(target: Path, *, size: int, inodes: int, mode: int, owner: int) -> None:
    """A small tmpfs on `target` (made if missing), its root `mode` and owned by `owner` (uid and gid): a directory
    that is the root of its own filesystem, capped, never on the host's disk. Blocking: call it in a thread.

    Owned by a chown after the mount, not by `uid=`/`gid=` options, which mountinfo would show (host uids of the
    sandbox's range) to the sandbox.
    """
    target.mkdir(mode=0o700, exist_ok=True)
    _mounts.mount("tmpfs", str(target), "tmpfs", _Mounts.MS_NOSUID | _Mounts.MS_NODEV | _Mounts.MS_NOEXEC,
                  f"size={size},nr_inodes={inodes},mode={mode:o}")
    try:
        os.chown(target, owner, owner)
    except OSError:
        with contextlib.suppress(OSError):
            _mounts.umount(str(target), _Mounts.MNT_DETACH)
        raise


def _mount_overlay_sync(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount the overlay with its layers named by descriptor, so that its options name no host path.

    overlayfs shows its options as given, in /proc/mounts and /proc/self/mountinfo of the host and of the
    sandbox alike: `lowerdir=/var/lib/corral/templates/...` would tell sandbox code where Corral keeps its state.
    `/proc/self/fd/N` of an O_PATH descriptor resolves to the same directory and is shown as just that, on every
    kernel (before 6.5 overlayfs kept the whole option string, since then each layer as given). The new mount
    API is no help here: layers passed to fsconfig(2) as descriptors are shown resolved to their host paths
    (checked on 6.18). The descriptors matter only while mount(2) resolves them. Without /proc: plain paths.
    """
    target.mkdir(parents=True, exist_ok=True)
    if not _PROC_FDS:
        _mounts.mount("overlay", str(target), "overlay", 0,
                      _overlay_options(":".join(map(str, lowers)), str(upper), str(work)))
        return
    fds: list[int] = []
    try:
        for layer in (*lowers, upper, work):
            fds.append(os.open(layer, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        names = [f"/proc/self/fd/{fd}" for fd in fds]
        _mounts.mount("overlay", str(target), "overlay", 0,
                      _overlay_options(":".join(names[:-2]), names[-2], names[-1]))
    finally:
        for fd in fds:
            os.close(fd)


def _overlay_options(lower: str, upper: str, work: str) -> str:
    return f"lowerdir={lower},upperdir={upper},workdir={work}"


async def unmount(target: Path) -> None:
    """Unmount `target` if it is a mount point (lazily if busy); loop devices detach themselves (autoclear)."""
    await unmount_all([target])


async def unmount_all(targets: Iterable[Path]) -> dict[Path, str]:
    """Unmount those of `targets` that are mount points, in the order given (lazily if busy), in one thread
    and reading the mount table once. Returns the source (a device, say) of each one unmounted."""
    try:
        return await in_thread(_unmount_all_sync, list(targets))
    except OSError as exc:
        raise ServerError(f"unmounting {exc.filename or 'a sandbox mount'} failed: {exc}") from exc


def _unmount_all_sync(targets: list[Path]) -> dict[Path, str]:
    if not targets:
        return {}
    sources = _mount_sources(under=Path(os.path.commonpath([os.fspath(t) for t in targets])))
    done: dict[Path, str] = {}
    for target in targets:
        if os.fspath(target) not in sources:
            continue
        if sources[os.fspath(target)].startswith("/dev/"):
            _flush(target)
        try:
            _mounts.umount(str(target))
        except OSError:
            try:
                _mounts.umount(str(target), _Mounts.MNT_DETACH)
            except OSError as exc:
                exc.filename = str(target)
                raise
        done[target] = sources[os.fspath(target)]
    return done


def _flush(mountpoint: Path) -> None:
    """syncfs(2) a disk before its unmount. An unmount writes a filesystem back only when it drops the last
    reference to it, and a mount namespace made meanwhile (a template build's `unshare --mount`, another
    container's set-up) holds a copy of every host mount: the filesystem, dirty pages and all, would outlive our
    unmount there, and a sandbox booted again from the same image would read it without what was last written."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _mounts.libc.syncfs(fd)  # best effort: a failure here shows as the unmount's own error, if any
    finally:
        os.close(fd)


async def wait_loop_detached(device: str, image: Path, timeout: float = 5.0) -> bool:
    """Wait until the loop device `device` (`/dev/loopN`) no longer serves `image`; False if it still does after
    `timeout` seconds.

    Autoclear detaches a loop device at its last close, which may come a while after the unmount (under load,
    seen up to ~1.5 s here): whoever else had the device open (a `losetup -a`, a probe) closes it later. Until
    then the device is a trace of the sandbox. Reads one sysfs file per poll, inline.
    """
    name = device.removeprefix("/dev/")
    if not name.startswith("loop"):
        return True
    backing = Path("/sys/block") / name / "loop" / "backing_file"
    wanted = {os.fspath(image), f"{os.fspath(image)} (deleted)"}
    deadline = time.monotonic() + timeout
    while True:
        try:
            if backing.read_text().rstrip("\n") not in wanted:
                return True  # detached, and already serving another image
        except OSError:
            return True  # detached
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)


def loop_devices_in_use() -> int:
    """Loop devices serving a file now (any user's), from sysfs."""
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return 0
    return sum(1 for name in names
               if name.startswith("loop") and os.path.exists(f"/sys/block/{name}/loop/backing_file"))


def is_mounted(path: Path) -> bool:
    return os.fspath(path) in _mount_sources(under=path)


def filesystem_usage(mountpoint: Path) -> tuple[int, int] | None:
    """(used, total) bytes of the filesystem mounted at `mountpoint`; None when none is (statvfs would answer for
    its parent's). Two stats and a statvfs, no mount table: this is read every few seconds per sandbox."""
    try:
        if os.stat(mountpoint).st_dev == os.stat(mountpoint.parent).st_dev:
            return None
        st = os.statvfs(mountpoint)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize


def _mount_sources(under: Path | None = None) -> dict[str, str]:
    """Every mount point of this mount namespace and its source; with `under`, only `under` and those below it.

    A machine with a thousand sandboxes has a mount table of 4,000 lines (four mounts each), which every destroy
    reads: with `under`, a line that does not name it is skipped before it is parsed (~10x cheaper than parsing
    them all, which took ~90 ms at that size under load)."""
    if under is None:
        return {point: entry.source for point, entry in mount_table().items()}
    base = os.fspath(under).rstrip("/") or "/"
    needle = _escape_mountinfo(base).encode()
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            if needle not in line:
                continue
            fields = line.split(b" ")
            point = _unescape_mountinfo(fields[4])
            if point == base or point.startswith(base.rstrip("/") + "/"):
                sep = fields.index(b"-", 6)
                found[point] = _unescape_mountinfo(fields[sep + 2])
    return found


def _escape_mountinfo(path: str) -> str:
    """A path as /proc/self/mountinfo writes it: space, tab, newline and backslash as octal escapes."""
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def _unescape_mountinfo(field: bytes) -> str:
    return os.fsdecode(field.replace(b"\\040", b" ").replace(b"\\011", b"\t").replace(b"\\012", b"\n")
                       .replace(b"\\134", b"\\"))


def mounts_under(prefix: Path) -> list[str]:
    wanted = os.fspath(prefix).rstrip("/") + "/"
    return [point for point in _mount_sources(under=prefix) if point.startswith(wanted)]


def require_tools() -> list[str]:
    missing = []
    for tool, pkg in (("mkfs.ext4", "e2fsprogs"),):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install {pkg})")
    if not Path("/dev/loop-control").exists():
        missing.append("loop devices (/dev/loop-control; modprobe loop)")
    return missing


__all__ = ["DiskImages", "RuntimeUnavailableError", "filesystem_usage", "finish_first", "in_thread", "is_mounted",
           "mount_image", "mount_overlay", "mount_readonly_layers", "mount_tmpfs", "mounts_under", "require_tools",
           "unmount", "unmount_all", "wait_loop_detached"]
