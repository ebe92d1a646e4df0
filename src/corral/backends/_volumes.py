"""Volumes on this host: a tenant's storage with a hard size limit, outliving sandboxes, shared by several at once.

Shared by the backends that run sandboxes on this machine (local: a user namespace per sandbox; Docker: none, so
`uid_base=0`). Layout, under `<home>/volumes/<volume id>/` (0700, root's):

    volume.img   a sparse ext4 image of the volume's size: a full volume is ENOSPC inside, the host's disk is
                 never touched beyond that size (holes stay holes: an empty 1 GiB volume costs a few MiB)
    mnt/         where the image is loop-mounted (nosuid, nodev) while at least one sandbox uses it

Files are stored with *canonical* owners (`CANONICAL_BASE + id`, `_idmap.py`). A sandbox sees the volume through an
idmapped bind mount of `mnt/` on a target of its own, `<its directory>/volumes/<n>`, which shows canonical ids as
its own range's (`uid_base + id`); its runtime then bind-mounts that target where the sandbox asked. The volume's
root belongs to canonical uid/gid 1000 (the sandbox user), mode 0755: the kernel refuses writes to inodes whose
owner a mount does not map, so a root owned by anyone else would be read-only to every sandbox.

Who uses a volume is read from the mount table every time (the mounts of the loop device whose backing file is the
volume's image), never kept in memory: after a server restart, the sandboxes still running keep their binds and
are counted, and a user is named by the directory its target is in (the sandbox's id for the local backend).

Blocking work (mkfs, mounts, the user namespace of an idmap) runs in threads, one volume at a time; a cancelled
caller still waits for its thread, so that cleanup never races a mount still being made.

Mount points for the sandbox side: the container's root cannot create them in template directories (owned by
host root, unmapped in the sandbox), so `prepare_mountpoints` makes them in the sandbox's upper layer before start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from .._exceptions import CapacityError, ConflictError, InvalidRequestError, NotFoundError, ServerError
from ._idmap import CANONICAL_BASE, canonical_to_sandbox, idmapped_bind, user_namespace
from ._mounts import in_thread, loop_backing, mount_table, umount

__all__ = ["IMAGE", "MIN_VOLUME_SIZE", "MOUNT", "VOLUMES_DIR", "VOLUME_OWNER", "HostVolumes", "prepare_mountpoints"]

logger = logging.getLogger("corral.backends.volumes")

VOLUMES_DIR = "volumes"  # under the home, and under each sandbox's directory (its targets)
IMAGE = "volume.img"
MOUNT = "mnt"
VOLUME_OWNER = 1000  # the sandbox user (`local/_bundle.SANDBOX_UID`), owner of every volume's root
MIN_VOLUME_SIZE = 16 * 1024 * 1024  # ext4 with a journal needs a few MiB of its own
_VOLUME_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_MKFS_TIMEOUT = 300.0  # seconds: lazy init makes even a 1 TiB image quick, but a loaded disk is slow
_MOUNT_TIMEOUT = 60.0
_LOOP_DETACH_WAIT = 5.0  # autoclear detaches a loop device at its last close, which may come a little later
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HostVolumes:
    """The volumes of one home (`<home>/volumes/`); see the module's docstring.

    Every method is safe to call concurrently: each volume's operations are serialised by a lock of its own.
    """

    def __init__(self, home: Path) -> None:
        self.root = Path(home) / VOLUMES_DIR
        self._locks: dict[str, asyncio.Lock] = {}

    async def create(self, volume_id: str, size: int) -> None:
        """An empty volume of `size` bytes (a hard limit); `ConflictError` if it exists. On failure, including
        cancellation, nothing of it is left."""
        vdir = self._dir(volume_id)
        if size < MIN_VOLUME_SIZE:
            raise InvalidRequestError(f"a volume is at least {MIN_VOLUME_SIZE // 2**20} MiB, not {size} bytes")
        async with self._lock(volume_id):
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                vdir.mkdir(mode=0o700)
            except FileExistsError:
                raise ConflictError(f"volume {volume_id} already exists on this host",
                                    details={"volume_id": volume_id}) from None
            try:
                await in_thread(_make_volume, vdir, size)
            except BaseException:
                with contextlib.suppress(Exception):  # the first failure is the one to report
                    await in_thread(_remove_volume, vdir)
                raise

    async def delete(self, volume_id: str) -> None:
        """Remove a volume no sandbox mounts (`ConflictError` naming them otherwise). Idempotent."""
        vdir = self._dir(volume_id)
        async with self._lock(volume_id):
            users = self.users(volume_id)
            if users:
                raise ConflictError(f"volume {volume_id} is mounted by {', '.join(users)}: end those sandboxes first",
                                    details={"volume_id": volume_id, "users": users})
            await in_thread(_remove_volume, vdir)

    async def used(self, volume_id: str) -> int:
        """Bytes the volume's files take now (mounted for the look if no sandbox uses it)."""
        vdir = self._dir(volume_id)
        async with self._lock(volume_id):
            return await in_thread(_used, vdir, volume_id)

    async def attach(self, volume_id: str, target: Path, uid_base: int) -> None:
        """Show the volume at `target` (made here; `<the user's directory>/volumes/<n>`) with its owners shifted
        to the sandbox whose root is host uid `uid_base`, mounting its image first if no one uses it yet."""
        vdir = self._dir(volume_id)
        _check_target(target)
        async with self._lock(volume_id):
            await in_thread(_attach, vdir, volume_id, target, uid_base)

    async def attach_all(self, volumes: Mapping[str, str], parent: Path,
                         uid_base: int) -> tuple[tuple[str, Path], ...]:
        """Attach each `{mount path: volume id}` at `parent/<n>` (in path order); return `(mount path, target)`
        pairs for the runtime's bind mounts. A failure leaves what was attached for `detach_all(parent)`."""
        mounts: list[tuple[str, Path]] = []
        for n, (path, volume_id) in enumerate(sorted(volumes.items())):
            target = parent / str(n)
            await self.attach(volume_id, target, uid_base)
            mounts.append((path, target))
        return tuple(mounts)

    async def detach(self, target: Path) -> None:
        """Undo `attach` on `target` (and remove it); the volume's image is unmounted once no one uses it.
        Idempotent: a target that is not mounted is only removed."""
        volume_id = await in_thread(self._volume_at, target)
        if volume_id is None:
            await in_thread(_drop_target, target)
            return
        async with self._lock(volume_id):
            await in_thread(_detach, self._dir(volume_id), target)

    async def detach_all(self, parent: Path) -> None:
        """Detach every target under `parent` (a sandbox's `volumes/`) and remove `parent`. Idempotent."""
        if not parent.is_dir():  # made by the first `attach`: a sandbox without volumes costs no mount-table read
            return
        targets = set(await in_thread(_mounted_children, parent))
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            targets |= {p for p in parent.iterdir() if p.is_dir() and not p.is_symlink()}
        for target in sorted(targets):
            await self.detach(target)
        with contextlib.suppress(FileNotFoundError):
            parent.rmdir()

    def users(self, volume_id: str) -> list[str]:
        """Who mounts the volume now, from the mount table: the directory each target is in (a sandbox id)."""
        return sorted({target.parent.parent.name for target in _targets(self._dir(volume_id))})

    async def unmount_idle(self) -> list[str]:
        """Unmount every volume image no sandbox uses (left mounted by a crash between two steps); their ids."""
        done: list[str] = []
        ids = [p.name for p in self.root.iterdir()] if self.root.is_dir() else []
        for volume_id in sorted(ids):
            if not _VOLUME_ID.fullmatch(volume_id):
                continue
            async with self._lock(volume_id):
                if await in_thread(_unmount_if_idle, self._dir(volume_id)):
                    done.append(volume_id)
        return done

    # -- helpers ---------------------------------------------------------------------------------------------

    def _dir(self, volume_id: str) -> Path:
        if not _VOLUME_ID.fullmatch(volume_id):
            raise InvalidRequestError(f"{volume_id!r} is not a volume id")
        return self.root / volume_id

    def _lock(self, volume_id: str) -> asyncio.Lock:
        return self._locks.setdefault(volume_id, asyncio.Lock())

    def _volume_at(self, target: Path) -> str | None:
        """The id of the volume of this home mounted at `target`, if one is."""
        source = mount_table().get(os.fspath(target))
        image = loop_backing(source[1]) if source is not None else None
        if image is None or image.name != IMAGE or image.parent.parent != self.root:
            return None
        return image.parent.name


# -- blocking work (in threads) --------------------------------------------------------------------------------


def _make_volume(vdir: Path, size: int) -> None:
    free = shutil.disk_usage(vdir).free
    if size > free:
        raise CapacityError(f"a volume of {size} bytes does not fit on this server: {free} bytes are free where "
                            "volumes are kept", details={"resource": "disk_free", "requested": size, "free": free})
    image, mnt = vdir / IMAGE, vdir / MOUNT
    with open(image, "wb") as f:
        f.truncate(size)
    # A journal, unlike a sandbox's throwaway disk: a volume's files must survive a crash of the host.
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "corral-volume",
          "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(image)],
         what="formatting a volume image", timeout=_MKFS_TIMEOUT)
    _mount_image(image, mnt)
    try:
        (mnt / "lost+found").rmdir()  # the sandbox user would see a directory of nobody's (e2fsck makes it again)
        owner = CANONICAL_BASE + VOLUME_OWNER
        os.chown(mnt, owner, owner)
        os.chmod(mnt, 0o755)  # noqa: S103 - the volume's root: every sandbox user reads it, its owner writes
    finally:
        _unmount_image(vdir)


def _remove_volume(vdir: Path) -> None:
    if vdir.exists():
        _unmount_image(vdir)
        shutil.rmtree(vdir)


def _used(vdir: Path, volume_id: str) -> int:
    if not (vdir / IMAGE).is_file():
        raise NotFoundError(f"no volume {volume_id!r} on this host", details={"volume_id": volume_id})
    mnt = vdir / MOUNT
    mounted = os.fspath(mnt) in mount_table()
    if not mounted:
        _mount_image(vdir / IMAGE, mnt)
    try:
        # statvfs leaves the filesystem's own metadata (journal, inode tables) out of f_blocks
        st = os.statvfs(mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    finally:
        if not mounted:
            _unmount_image(vdir)


def _attach(vdir: Path, volume_id: str, target: Path, uid_base: int) -> None:
    image, mnt = vdir / IMAGE, vdir / MOUNT
    if not image.is_file():
        raise NotFoundError(f"no volume {volume_id!r} on this host", details={"volume_id": volume_id})
    table = mount_table()
    if os.fspath(target) in table:
        raise ConflictError(f"{target} is a mount point already")
    if os.fspath(mnt) not in table:
        _mount_image(image, mnt)
    try:
        target.parent.mkdir(mode=0o711, exist_ok=True)
        os.chmod(target.parent, 0o711)  # noqa: S103 - traverse only: the sandbox's runtime binds the target
        target.mkdir(mode=0o700, exist_ok=True)
        with user_namespace(canonical_to_sandbox(uid_base)) as userns:
            idmapped_bind(mnt, target, userns)
    except BaseException:
        _drop_target(target)
        _unmount_if_idle(vdir)
        raise


def _detach(vdir: Path, target: Path) -> None:
    _drop_target(target)
    _unmount_if_idle(vdir)


def _drop_target(target: Path) -> None:
    """Unmount `target` if it is a mount point (lazily if busy) and remove the directory."""
    if os.fspath(target) in mount_table():
        umount(target)
    with contextlib.suppress(FileNotFoundError):
        target.rmdir()


def _unmount_if_idle(vdir: Path) -> bool:
    if _targets(vdir) or os.fspath(vdir / MOUNT) not in mount_table():
        return False
    _unmount_image(vdir)
    return True


def _mount_image(image: Path, mnt: Path) -> None:
    mnt.mkdir(mode=0o700, exist_ok=True)
    # mount(8) attaches a loop device that detaches itself when the filesystem is unmounted (autoclear)
    _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", str(image), str(mnt)], what="mounting a volume image",
         timeout=_MOUNT_TIMEOUT)


def _unmount_image(vdir: Path) -> None:
    """Unmount `mnt/` if mounted, and wait for its loop device to let go of the image."""
    mnt, image = vdir / MOUNT, vdir / IMAGE
    source = mount_table().get(os.fspath(mnt))
    if source is None:
        return
    umount(mnt)
    device = source[1]
    deadline = time.monotonic() + _LOOP_DETACH_WAIT
    while loop_backing(device) == image:
        if time.monotonic() > deadline:
            logger.warning("volume.loop_device_kept", extra={"volume": vdir.name, "device": device})
            return
        time.sleep(0.005)


def _run(argv: list[str], *, what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except FileNotFoundError as exc:
        raise ServerError(f"{what}: {argv[0]} is not installed (apt-get install e2fsprogs mount)") from exc
    except subprocess.TimeoutExpired as exc:
        raise ServerError(f"{what}: {argv[0]} did not finish within {timeout:.0f}s") from exc
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip()
        raise ServerError(f"{what} failed: {argv[0]} exited {proc.returncode}: {out[-2000:]}")


# -- the mount table ---------------------------------------------------------------------------------------------


def _targets(vdir: Path) -> list[Path]:
    """The mount points of the volume's loop device(s) other than its own `mnt/`: the sandboxes' binds."""
    image, mnt = vdir / IMAGE, os.fspath(vdir / MOUNT)
    table = mount_table()
    backing: dict[str, Path | None] = {}
    devices: set[str] = set()
    for _point, (device, source) in table.items():
        if source not in backing:
            backing[source] = loop_backing(source)
        if backing[source] == image:
            devices.add(device)
    return [Path(point) for point, (device, _source) in table.items() if device in devices and point != mnt]


def _mounted_children(parent: Path) -> list[Path]:
    return [Path(point) for point in mount_table() if Path(point).parent == parent]


def _check_target(target: Path) -> None:
    if not target.is_absolute() or target.parent.name != VOLUMES_DIR:
        raise ValueError(f"a volume target is `<its user's directory>/{VOLUMES_DIR}/<n>`, not {target}")


# -- the sandbox side ----------------------------------------------------------------------------------------------


def prepare_mountpoints(upper: Path, paths: Iterable[str], uid_base: int, *, lower: Path | None = None) -> None:
    """Make each volume's mount point in a sandbox's upper layer `upper`, from the host, before it starts: missing
    parents owned by the sandbox's root (`uid_base`), the leaf by its user (`uid_base + 1000`), all 0755.

    With `lower` (the template's root), a path through something the template has that is not a directory (a
    file, or a symlink such as Debian's `/lib`) is refused with `InvalidRequestError`: the new directory would
    hide it. Directories are opened one by one with O_NOFOLLOW, so no symlink in `upper` can lead outside it.
    """
    for path in sorted(paths):
        parts = _parts(path)
        if lower is not None:
            _check_lower(lower, parts, path)
        fd = os.open(upper, _DIR_FLAGS)
        try:
            for depth, name in enumerate(parts, 1):
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    created = True
                except FileExistsError:
                    created = False
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise ServerError(f"volume mount point {path}: {'/'.join(parts[:depth])} in the sandbox's "
                                      f"layer is not a directory ({exc.strerror})") from exc
                os.close(fd)
                fd = child
                if created:
                    owner = uid_base + VOLUME_OWNER if depth == len(parts) else uid_base
                    os.fchown(fd, owner, owner)
                    os.fchmod(fd, 0o755)
        finally:
            os.close(fd)


def _parts(path: str) -> list[str]:
    parts = path.split("/")[1:]
    if not path.startswith("/") or not parts or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequestError(f"volume mount path {path!r} is not a normalized absolute path below '/'")
    return parts


def _check_lower(lower: Path, parts: list[str], path: str) -> None:
    here = lower
    for name in parts:
        here = here / name
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            return  # nothing of the template there: the rest is made in the upper layer
        if not stat.S_ISDIR(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "a file"
            shown = "/" + "/".join(parts[: len(here.relative_to(lower).parts)])
            raise InvalidRequestError(f"volume mount path {path!r}: {shown} is {kind} in the template, not a "
                                      "directory; mount the volume elsewhere", details={"path": path})
