"""A sandbox's disk on the Docker backend: a sparse ext4 image of `limits.disk` bytes, loop-mounted on the host,
holding every directory the sandbox may write to (`_container.WRITABLE`), each bind-mounted into the container.

A full disk gives ENOSPC inside and never touches the host's free space beyond its size. Images and mounts are
the local backend's (`corral.backends.local._disk`): a golden image per size, copied sparsely.

The template's own content of those directories (a home directory's dotfiles) is copied onto the disk when the
sandbox is made, as the overlay of the local backend shows it: the container's root is read-only, so the bind
mount would otherwise hide it. The copy never follows a symlink.

A stopped sandbox's disk is *released* (`release_disk`), not only unmounted: the dead container's mount namespace
may still hold the filesystem for a while after its processes are gone (its teardown is the kernel's, deferred),
and only the last reference writes the filesystem's final blocks into the image. Mounting or copying the image
before that would read a stale filesystem (seen here: a boot whose disk lacked its `workspace/`), and the late
writes would then land under the new mount. Released means no loop device serves the image any more.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from pathlib import Path

from ..._exceptions import ServerError
from ..local import _disk
from ..local._backend import DiskImagesHolder
from ..local._upper import RESOLV_CONF
from ._container import WRITABLE

__all__ = ["disk_in_use", "mount_disk", "prepare_disk", "release_disk", "unmount_disk", "write_resolv_conf"]

RELEASE_WAIT = 10.0  # seconds for a dead container's hold on its disk to go (seen up to ~1.5 s under load)


async def mount_disk(cache: Path, size: int, image: Path, target: Path) -> None:
    await DiskImagesHolder.get(cache).create(size, image)
    await _disk.mount_image(image, target)


async def unmount_disk(target: Path) -> None:
    await _disk.unmount(target)


async def release_disk(image: Path, target: Path, timeout: float = RELEASE_WAIT) -> None:
    """Unmount the disk and wait until nothing holds its filesystem any more (see the module's docstring);
    `ServerError` if something still does after `timeout` seconds."""
    await _disk.unmount(target)
    deadline = time.monotonic() + timeout
    while devices := disk_in_use(image):
        if time.monotonic() > deadline:
            raise ServerError(f"the disk {image} is still held ({', '.join(devices)}) {timeout:g}s after its "
                              "sandbox stopped; try again")
        await asyncio.sleep(0.01)


def disk_in_use(image: Path) -> list[str]:
    """The loop devices that serve `image` now (a mounted, or not yet released, filesystem)."""
    wanted = {os.fspath(image), f"{os.fspath(image)} (deleted)"}
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().rstrip("\n") in wanted:
                found.append(f"/dev/{backing.parent.parent.name}")
        except OSError:
            continue  # detached meanwhile
    return sorted(found)


def prepare_disk(disk: Path, template_root: Path) -> None:
    """Make the writable directories on the mounted disk, seeded from the template. Blocking: run in a thread."""
    os.chmod(disk, 0o755)  # noqa: S103 - the disk's root: traverse only for the container's bind mounts
    for d in WRITABLE:
        dest = disk / d.name
        dest.mkdir(exist_ok=True)
        source = template_root / d.path.lstrip("/")
        if source.is_dir() and not source.is_symlink():
            _copy_tree(source, dest)
        os.chown(dest, d.uid, d.uid)
        os.chmod(dest, d.mode)
    shutil.rmtree(disk / "lost+found", ignore_errors=True)


def _copy_tree(source: Path, dest: Path) -> None:
    with os.scandir(source) as entries:
        for entry in entries:
            target = dest / entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(entry.path), target)
            elif stat.S_ISDIR(st.st_mode):
                target.mkdir()
                _copy_tree(Path(entry.path), target)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(entry.path, target, follow_symlinks=False)
            else:
                continue  # devices, fifos, sockets: nothing a home directory needs
            os.lchown(target, st.st_uid, st.st_gid)
            if not stat.S_ISLNK(st.st_mode):
                os.chmod(target, stat.S_IMODE(st.st_mode))


def write_resolv_conf(path: Path) -> None:
    """The sandbox's /etc/resolv.conf (shared by every sandbox of a home): no resolver is reachable; the agent
    answers on 127.0.0.1:53 and refuses at once (docs/egress.md)."""
    if path.exists() and path.read_text() == RESOLV_CONF:
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(RESOLV_CONF)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
