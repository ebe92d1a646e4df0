"""What the host makes in a local sandbox's upper directory before each start: its own directories and
/etc/resolv.conf, owned by its uid range, never following what the sandbox may have left there."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from ._bundle import SANDBOX_UID

__all__ = ["RESOLV_CONF", "prepare_upper"]


RESOLV_CONF = """\
# Corral: names resolve through the egress proxy only (HTTP_PROXY=http://127.0.0.1:3128); direct DNS is refused.
nameserver 127.0.0.1
options timeout:1 attempts:1
"""


def prepare_upper(upper: Path, work: Path, uid_base: int) -> None:
    """Create, from the host, what the container's root cannot: its writable dirs and mount points.

    Template files belong to host root, which the sandbox's user namespace does not map (they show up as
    `nobody`); so the sandbox's own directories are made here, owned by the right ids of its range.

    At a boot after a pause to disk, `upper` holds whatever the sandbox left there, and a sandbox with root may
    have put a symlink (to a host path, say) where one of these directories was: nothing below `upper` is ever
    followed. Each directory is opened from its parent's descriptor with O_NOFOLLOW, and an entry in its place
    that is not a directory (a symlink, a file, a whiteout) is removed and the directory made again.
    """
    root_id, user_id = uid_base, uid_base + SANDBOX_UID
    for path, uid, mode in ((upper, root_id, 0o755), (work, 0, 0o700)):  # the disk's own: the sandbox never names them
        path.mkdir(exist_ok=True)
        os.chown(path, uid, uid)
        os.chmod(path, mode)
    top = os.open(upper, _DIR_NOFOLLOW)
    try:
        for rel, uid, mode in (
            ("home", root_id, 0o755),
            ("home/user", user_id, 0o750),
            ("workspace", user_id, 0o755),
            ("tmp", root_id, 0o1777),
            (".corral", root_id, 0o755),
            (".corral/agent", root_id, 0o755),
            (".corral/egress", root_id, 0o755),
            ("etc", root_id, 0o755),
        ):
            os.close(_own_dir(top, rel, uid, mode))
        etc = _own_dir(top, "etc", root_id, 0o755)
        try:
            _write_resolv_conf(etc, root_id)
        finally:
            os.close(etc)
    finally:
        os.close(top)


_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _own_dir(top: int, rel: str, uid: int, mode: int) -> int:
    """The directory `rel` below `top` as a descriptor (the caller closes it), made where missing and owned by
    `uid`, `mode`; its parents must exist already. Nothing is followed: see `_prepare_upper`."""
    parent = os.dup(top)
    try:
        *parents, name = rel.split("/")
        for part in parents:
            child = os.open(part, _DIR_NOFOLLOW, dir_fd=parent)
            os.close(parent)
            parent = child
        fd = _open_or_replace_dir(parent, name)
    finally:
        os.close(parent)
    os.fchown(fd, uid, uid)
    os.fchmod(fd, mode)
    return fd


def _open_or_replace_dir(parent: int, name: str) -> int:
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass
    try:
        return os.open(name, _DIR_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    os.unlink(name, dir_fd=parent)  # a symlink, file or whiteout where the directory must be: never followed
    os.mkdir(name, 0o700, dir_fd=parent)
    return os.open(name, _DIR_NOFOLLOW, dir_fd=parent)


def _write_resolv_conf(etc: int, root_id: int) -> None:
    """No resolver is reachable: the agent answers on 127.0.0.1:53 and refuses at once (docs/egress.md).

    One that is exactly ours already stays as it is (a boot after a restore would otherwise show it as changed
    in every `changes`)."""
    if _resolv_conf_is_ours(etc, root_id):
        return
    try:
        os.unlink("resolv.conf", dir_fd=etc)  # a symlink is removed, not followed
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree("resolv.conf", dir_fd=etc)
    fd = os.open("resolv.conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                 dir_fd=etc)
    try:
        os.write(fd, RESOLV_CONF.encode())
        os.fchown(fd, root_id, root_id)
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)


def _resolv_conf_is_ours(etc: int, root_id: int) -> bool:
    """A regular file of one name, root's, 0644, holding `RESOLV_CONF` and nothing else (never followed)."""
    try:
        fd = os.open("resolv.conf", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=etc)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (st.st_uid, st.st_gid) != (root_id, root_id) \
                or stat.S_IMODE(st.st_mode) != 0o644 or st.st_size != len(RESOLV_CONF.encode()):
            return False
        return os.read(fd, st.st_size + 1) == RESOLV_CONF.encode()
    finally:
        os.close(fd)
