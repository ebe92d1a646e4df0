"""Starting a command's root process: through the static spawn helper (`corral-spawn`, built by the host from
spawn.c next to this file) by `posix_spawn`, or without it by a fork with a `preexec_fn` (`popen_fallback`), either
way as a child subreaper in its own session, dropped to the process's user (`drop_privileges`), with the signals the
agent ignores back at their defaults. Signal numbers as plain ints live here too."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import termios

from .users import User

_libc = ctypes.CDLL(None, use_errno=True)
# Signal numbers as plain ints: the `signal` module builds enums on import, and every import here delays
# every sandbox's start. Linux numbering (the agent only runs on Linux).
SIGINT, SIGKILL, SIGSTOP, SIGPIPE, SIGXFSZ = 2, 9, 19, 13, 25
# What the agent ignores or handles for itself and every command must get back at its default (see `__main__`).
CHILD_DEFAULT_SIGNALS = (SIGINT, SIGPIPE, SIGXFSZ)
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_CAPBSET_DROP = 24
SIG_DFL = 0
CHILD_OOM_SCORE_ADJ = 500
# Built by the host from spawn.c next to this file; see there for why. Absent: fall back to preexec_fn.
SPAWN_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corral-spawn")


def set_dumpable(on: bool) -> None:
    _libc.prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)



def posix_spawn(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
                 tty: bool, drop: User | None = None) -> int:
    user = ["--user", f"{drop.uid}:{drop.gid}"] if drop is not None else []
    shim_args = [SPAWN_SHIM, *(["--tty"] if tty else []), *user, "--cwd", cwd, "--", *argv]
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)]
    # The agent ignores SIGINT, SIGPIPE and SIGXFSZ for itself; commands must get the default actions back.
    return os.posix_spawn(SPAWN_SHIM, shim_args, env, file_actions=actions, setsid=True,
                          setsigdef=CHILD_DEFAULT_SIGNALS)


def popen_fallback(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
                    tty: bool, drop: User | None = None) -> int:
    """Without the shim: subprocess with a preexec_fn (a full fork of the agent: slower, same result)."""
    import subprocess

    def setup() -> None:
        _child_setup(drop)
        if tty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    popen = subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], cwd=cwd, env=env,
                             close_fds=True, start_new_session=True, preexec_fn=setup)
    popen.returncode = 0  # the reaper owns the exit status; stop Popen from ever waiting on it
    return popen.pid



def which(name: str, path: str) -> str | None:
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _child_setup(drop: User | None) -> None:
    # Runs in the child between fork and exec: make the root a subreaper (see module docstring), the OOM
    # killer's first choice over us (if PID 1 died the whole sandbox would go), the user's (as the shim does:
    # `drop_privileges`), with the signal the agent ignores back at its default, and dumpable again.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(CHILD_OOM_SCORE_ADJ))
    except OSError:
        pass
    if drop is not None:
        drop_privileges(drop)
    _libc.signal(SIGINT, SIG_DFL)
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def drop_privileges(user: User) -> None:
    """Become `user` for good: an empty bounding set (while CAP_SETPCAP is still ours), no supplementary
    groups, its gid, then its uid, which clears the permitted and effective sets (no SECBIT_KEEP_CAPS)."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the kernel's last capability, all dropped
        raise OSError(ctypes.get_errno(), "cannot drop the capability bounding set")
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)
