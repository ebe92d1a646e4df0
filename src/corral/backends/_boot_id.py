"""A boot id of its own for each boot of a sandbox: `/proc/sys/kernel/random/boot_id`, as a virtual machine has.

Sandboxes under runc and Docker share the host's kernel, whose boot id never changes; programs (and E2B's tests)
read a new boot id as "this machine started again". So every start of a sandbox (create, a boot after a pause to
disk, a restore from a snapshot) gets a fresh uuid4 there, the same for the whole of that boot; a freeze
(`pause` with memory kept) is not a boot and keeps it.

How, since runc (1.1) refuses any mount under `/proc` in `config.json` but a few LXCFS files (`cpuinfo`,
`meminfo`, `uptime`, ...): once the runtime has started the sandbox, and before anything but the agent runs in
it, this host process bind-mounts a read-only file over the path in the sandbox's own mount namespace. The file
sits alone on a tiny tmpfs made with `fsopen`/`fsmount` that is never attached anywhere on the host: nothing to
unmount or leak there, it goes with the sandbox's mount namespace, and the sandbox's mountinfo names no host path
(`/boot_id` on `tmpfs`). The sandbox cannot undo it (no CAP_SYS_ADMIN, and the seccomp profile refuses umount).

`setns` into a mount namespace is refused to a process whose threads share their filesystem context, so the
mount is made by a thread of its own that first unshares it (`CLONE_FS`) and then ends: no other thread's view
of the host changes.

gVisor (runsc, as packaged here: 20221219) has no `/proc/sys/kernel/random` at all, and runsc, unlike runc,
takes a bind mount there from the bundle: under runsc each boot writes a fresh id to a file of the sandbox's
directory (`write_boot_id`) that its `config.json` mounts read-only (gVisor's mountinfo shows no host path).

A leaf of `corral.backends`: the standard library and the error tree only.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from pathlib import Path

from .._exceptions import AgentError, RuntimeUnavailableError, ServerError
from ._mounts import in_thread

__all__ = ["BOOT_ID_PATH", "give_boot_id", "write_boot_id"]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Syscall numbers of the new mount API (Linux 5.2), the same on x86_64 and aarch64 (numbered alike from 424 on).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 429, 430, 431, 432
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 1
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
_MS_READONLY_BIND = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
_CLONE_FS, _CLONE_NEWNS = 0x200, 0x20000
_TMPFS_OPTIONS = (("source", "tmpfs"), ("size", "4k"), ("nr_inodes", "2"), ("mode", "0555"))

_libc = ctypes.CDLL(None, use_errno=True)


def write_boot_id(path: Path) -> Path:
    """A fresh boot id in the file `path` (0444, replaced if there), for a runtime that takes a bind mount over
    `BOOT_ID_PATH` in its bundle (runsc). Inline: one small file."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, f"{uuid.uuid4()}\n".encode())
    finally:
        os.close(fd)
    os.replace(partial, path)
    return path


async def give_boot_id(pid: int, sandbox_id: str) -> str:
    """Mount a fresh boot id over `BOOT_ID_PATH` in the mount namespace of process `pid` (sandbox `sandbox_id`'s
    first process, just started) and return it. A cancelled caller still waits for the few syscalls to finish."""
    boot_id = str(uuid.uuid4())
    await in_thread(_in_own_thread, pid, sandbox_id, boot_id)
    return boot_id


def _in_own_thread(pid: int, sandbox_id: str, boot_id: str) -> None:
    """Run `_mount` on a thread made for it alone (it leaves that thread in the sandbox's mount namespace)."""
    failure: list[BaseException] = []

    def work() -> None:
        try:
            _mount(pid, sandbox_id, boot_id)
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    thread = threading.Thread(target=work, name=f"corral-boot-id-{pid}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _mount(pid: int, sandbox_id: str, boot_id: str) -> None:
    tree = _boot_id_file(boot_id)  # before the setns: an fd is what carries it into the sandbox's namespace
    try:
        try:
            ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise AgentError(f"sandbox {sandbox_id} started but its agent (pid {pid}) ended at once: {exc}",
                             details={"sandbox_id": sandbox_id}) from exc
        try:
            _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")
            _check(_libc.setns(ns, _CLONE_NEWNS), "setns(mount namespace)")
        finally:
            os.close(ns)
        _syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, BOOT_ID_PATH.encode(), _MOVE_MOUNT_F_EMPTY_PATH,
                 what=f"move_mount({BOOT_ID_PATH})")
        # Read-only where it landed, by the classic remount (mount_setattr on the detached tree needs 5.12; this
        # needs only the 5.2 the calls above do). The file is 0444 and host root's meanwhile: nobody else's.
        _check(_libc.mount(None, BOOT_ID_PATH.encode(), None, _MS_READONLY_BIND, None), "remount read-only")
    finally:
        os.close(tree)


def _boot_id_file(boot_id: str) -> int:
    """A detached bind mount of a file holding `boot_id`, alone on a detached tmpfs (an fd)."""
    fs = _syscall(_SYS_FSOPEN, b"tmpfs", _FSOPEN_CLOEXEC, what="fsopen(tmpfs)")
    try:
        for key, value in _TMPFS_OPTIONS:
            _syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0,
                     what=f"fsconfig({key})")
        _syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0, what="fsconfig(create)")
        root = _syscall(_SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC, 0, what="fsmount(tmpfs)")
    finally:
        os.close(fs)
    try:
        fd = os.open("boot_id", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444, dir_fd=root)
        try:
            os.write(fd, f"{boot_id}\n".encode())
        finally:
            os.close(fd)
        return _syscall(_SYS_OPEN_TREE, root, b"boot_id", _OPEN_TREE_CLONE | os.O_CLOEXEC, what="open_tree(boot_id)")
    finally:
        os.close(root)  # the tmpfs lives on in the bind mount of its file, and then in the sandbox's


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise ServerError(f"giving the sandbox its boot id failed: {what}: {os.strerror(err)}")


def _syscall(number: int, *args: object, what: str) -> int:
    result: int = _libc.syscall(number, *args)
    if result < 0:
        err = ctypes.get_errno()
        if err == 38:  # ENOSYS
            raise RuntimeUnavailableError(f"giving sandboxes a boot id of their own needs Linux 5.2+ (the new "
                                          f"mount API): {what} is missing here")
        raise ServerError(f"giving the sandbox its boot id failed: {what}: {os.strerror(err)}")
    return result
