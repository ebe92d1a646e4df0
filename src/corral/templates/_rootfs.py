"""Writing into a root filesystem under construction, and the finishing touches every template gets.

Paths inside the rootfs are resolved with `resolve_in_root`, as a chrooted process would: a symlink in an
image (`/etc -> /host/etc`, `/home -> ../../..`) can never make the host write outside the rootfs.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from .._exceptions import TemplateBuildError
from ._fs import resolve_in_root

__all__ = [
    "MOUNT_POINTS",
    "USER_GID",
    "USER_HOME",
    "USER_NAME",
    "USER_UID",
    "ensure_dir",
    "ensure_user",
    "finish_rootfs",
    "write_file",
    "write_spec_files",
]

USER_UID = 1000
USER_GID = 1000
USER_NAME = "user"
USER_HOME = "/home/user"
WORKDIR = "/workspace"

# runc needs a directory for every mount; with a user namespace the container cannot create them itself.
# /.corral is where the in-sandbox agent is bind-mounted.
MOUNT_POINTS = ("/dev", "/proc", "/sys", "/tmp", WORKDIR, USER_HOME, "/.corral")

# Files the spec places here belong to the sandbox user, so it can edit its own dotfiles and workspace.
_USER_OWNED = (USER_HOME, WORKDIR)


def _is_root() -> bool:
    return os.geteuid() == 0


def _chown(path: Path, uid: int, gid: int) -> None:
    if _is_root():  # an unprivileged build (tests, tools) keeps its own ownership
        os.lchown(path, uid, gid)


def ensure_dir(root: Path, path: str, *, owner: tuple[int, int] | None = None, mode: int = 0o755) -> Path:
    """Make directory `path` (and its parents) exist inside `root`; return its host path.

    A non-directory in the way is replaced. Directories created here get `owner` and `mode`.
    """
    parts = [p for p in path.split("/") if p not in ("", ".")]
    host = root
    for i in range(1, len(parts) + 1):
        host = resolve_in_root(root, "/".join(parts[:i]))
        if os.path.lexists(host) and not host.is_dir():
            host.unlink()
        if not os.path.lexists(host):
            host.mkdir(mode, parents=True)
            os.chmod(host, mode)  # mkdir applies the umask
            if owner is not None:
                _chown(host, *owner)
    return host


def write_file(root: Path, path: str, content: bytes, *, owner: tuple[int, int] = (0, 0), mode: int = 0o644) -> None:
    """Create or replace regular file `path` inside `root` (a symlink there is replaced, not followed)."""
    parent = ensure_dir(root, posixpath.dirname(path), owner=owner)
    dest = parent / posixpath.basename(path)
    if dest.is_dir() and not dest.is_symlink():
        raise TemplateBuildError(f"cannot write file {path}: the template has a directory there")
    if os.path.lexists(dest):
        dest.unlink()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        if _is_root():
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def write_spec_files(root: Path, files: dict[str, str]) -> None:
    """Write a spec's `files`; those under /home/user and /workspace belong to the sandbox user."""
    for path, content in sorted(files.items()):
        user_owned = any(path.startswith(prefix + "/") for prefix in _USER_OWNED)
        owner = (USER_UID, USER_GID) if user_owned else (0, 0)
        write_file(root, path, content.encode(), owner=owner)


def _has_id(lines: list[str], name: str, numeric_id: int) -> bool:
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 3 and (fields[0] == name or fields[2] == str(numeric_id)):
            return True
    return False


def _append_line(root: Path, path: str, default: str, name: str, numeric_id: int, line: str) -> None:
    host = resolve_in_root(root, path)
    try:
        text = host.read_text(errors="replace")
    except FileNotFoundError:
        write_file(root, path, default.encode())
        text = default
    if _has_id(text.splitlines(), name, numeric_id):
        return
    separator = "" if not text or text.endswith("\n") else "\n"
    with open(host, "a", encoding="utf-8") as f:
        f.write(separator + line + "\n")


def ensure_user(root: Path) -> None:
    """Give the rootfs a `user` (1000:1000) account unless uid/gid 1000 or the name already exist."""
    shell = "/bin/bash" if os.path.lexists(resolve_in_root(root, "/bin/bash")) else "/bin/sh"
    _append_line(root, "/etc/group", "root:x:0:\n", USER_NAME, USER_GID, f"{USER_NAME}:x:{USER_GID}:")
    passwd_line = f"{USER_NAME}:x:{USER_UID}:{USER_GID}:Corral sandbox user:{USER_HOME}:{shell}"
    _append_line(root, "/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", USER_NAME, USER_UID, passwd_line)


def _remove_device_nodes(root: Path) -> None:
    # Every sandbox gets a fresh /dev from the runtime; device nodes left in a lower layer would only be a
    # way around the runtime's device policy if /dev were ever not mounted over.
    dev = resolve_in_root(root, "/dev")
    for dirpath, _dirnames, filenames in os.walk(dev):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if stat.S_ISCHR(os.lstat(path).st_mode) or stat.S_ISBLK(os.lstat(path).st_mode):
                os.unlink(path)


def finish_rootfs(root: Path) -> None:
    """What every template needs, however it was made: mount points, /tmp, the user's directories."""
    try:
        for mount_point in MOUNT_POINTS:
            ensure_dir(root, mount_point)
        os.chmod(resolve_in_root(root, "/tmp"), 0o1777)  # noqa: S103 - /tmp is shared, sticky
        for path in (USER_HOME, WORKDIR):
            _chown(resolve_in_root(root, path), USER_UID, USER_GID)
        _remove_device_nodes(root)
    except OSError as exc:
        raise TemplateBuildError(f"cannot prepare the template's root filesystem: {exc}") from exc
