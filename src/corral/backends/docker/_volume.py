"""A sandbox's disk on the Docker backend: a sparse ext4 image of `limits.disk` bytes, loop-mounted on the host,
holding every directory the sandbox may write to (`_container.WRITABLE`), each bind-mounted into the container.

A full disk gives ENOSPC inside and never touches the host's free space beyond its size. Images and mounts are
the local backend's (`corral.backends.local._disk`): a golden image per size, copied sparsely.

The template's own content of those directories (a home directory's dotfiles) is copied onto the disk when the
sandbox is made, as the overlay of the local backend shows it: the container's root is read-only, so the bind
mount would otherwise hide it. The copy never follows a symlink.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from ..local import _disk
from ..local._backend import RESOLV_CONF, DiskImagesHolder
from ._container import WRITABLE

__all__ = ["mount_disk", "prepare_disk", "unmount_disk", "write_resolv_conf"]


async def mount_disk(cache: Path, size: int, image: Path, target: Path) -> None:
    await DiskImagesHolder.get(cache).create(size, image)
    await _disk.mount_image(image, target)


async def unmount_disk(target: Path) -> None:
    await _disk.unmount(target)


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
