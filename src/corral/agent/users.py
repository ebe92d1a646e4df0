"""Who an operation acts as inside the sandbox: the sandbox user (uid 1000), or root where the sandbox has it.

A sandbox created with `root=True` starts the agent as uid 0 of its user namespace (the host's `uid_base`, never
host root) with a small capability set (docs/security.md); any other sandbox starts it as the user itself, and
then nothing here changes anything. A root agent acts as the user by default:

* commands: the spawn helper drops to uid/gid 1000, no supplementary groups, an empty bounding set, before exec;
* file operations: this thread's effective ids become the user's (raw `setresgid`/`setresuid` on one thread, which
  the kernel keeps per thread: glibc's wrappers would change every thread of the agent), which also clears the
  thread's effective capabilities, so the kernel checks every path as it would for the user's own process and
  what the thread makes is the user's. (`setfsuid` would do for runc, but gVisor does not implement it.) The real
  and saved ids stay 0, so that `privileged` can take the agent's own authority back for what only it does
  (starting and signalling processes, whoever they belong to); the thread ends with its request.

Standard library only, and cheap to import: the agent is PID 1 of every sandbox.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_DUMPABLE = 4
# The raw system calls (never glibc's wrappers, which change every thread): x86_64 and aarch64 numbers.
_SETRESUID, _SETRESGID = (147, 149) if os.uname().machine in ("aarch64", "arm64") else (117, 119)
_KEEP = -1  # an id setresuid/setresgid leaves as it is


class User:
    """A user of the sandbox: its name, ids and home, as the template's /etc/passwd has them."""

    __slots__ = ("gid", "home", "name", "uid")

    def __init__(self, name: str, uid: int, gid: int, home: str) -> None:
        self.name, self.uid, self.gid, self.home = name, uid, gid, home

    def base_env(self) -> dict[str, str]:
        """What a command of this user starts from, before the sandbox's and its own environment."""
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": self.home,
                "USER": self.name, "LOGNAME": self.name, "SHELL": "/bin/bash", "LANG": "C.UTF-8"}


USER = User("user", 1000, 1000, "/home/user")
ROOT = User("root", 0, 0, "/root")
BY_NAME = {USER.name: USER, ROOT.name: ROOT}
# The one truth of whether this sandbox has root: the identity the runtime started the agent with.
AGENT_IS_ROOT = os.geteuid() == 0


def named(name: object) -> User | None:
    """The user `name` means (None or "": the sandbox user); None for a name the sandbox does not have."""
    if name is None or name == "":
        return USER
    return BY_NAME.get(name) if isinstance(name, str) else None


def act_as(user: User) -> bool:
    """Make this thread act as `user` (its effective ids, see the module's docstring); False if the kernel did
    not, and the caller must refuse the request rather than act as root.

    Only a root agent switches. Any change of effective ids makes the kernel reset the process's dumpable flag to
    `fs.suid_dumpable`, which a host may have set to 1: the agent makes itself non-dumpable again, so its /proc
    entries (its environment held its token) stay out of reach of the sandbox's root.
    """
    if not AGENT_IS_ROOT or user.uid == 0:
        return True
    changed = (_libc.syscall(_SETRESGID, _KEEP, user.gid, _KEEP) == 0
               and _libc.syscall(_SETRESUID, _KEEP, user.uid, _KEEP) == 0)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    return changed and os.geteuid() == user.uid and os.getegid() == user.gid


class privileged:
    """`with privileged():` the calling thread acts as root (the agent's own authority) inside the block, and as
    before after it: to start a process (the spawn helper then drops to its user) or to signal any process of
    the sandbox, whoever the request acts as. Nothing to do in an agent that is not root."""

    __slots__ = ("_was",)

    def __enter__(self) -> privileged:
        self._was: tuple[int, int] | None = None
        if AGENT_IS_ROOT and os.geteuid() != 0:
            self._was = (os.geteuid(), os.getegid())
            _libc.syscall(_SETRESUID, _KEEP, 0, _KEEP)  # allowed: the real and saved uids are 0
            _libc.syscall(_SETRESGID, _KEEP, 0, _KEEP)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._was is not None:
            uid, gid = self._was
            _libc.syscall(_SETRESGID, _KEEP, gid, _KEEP)
            _libc.syscall(_SETRESUID, _KEEP, uid, _KEEP)
            _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
