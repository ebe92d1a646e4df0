"""Small host-side helpers of the local backend: the agent's socket (probed, moved out of the sandbox's reach)
and the tail of its log."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from ..._exceptions import ServerError

__all__ = ["listening", "tail", "take_socket"]


def listening(path: Path) -> bool:
    """Whether a socket at `path` accepts connections (a non-blocking connect, closed at once: the agent takes a
    connection that sends nothing as a client that left)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(str(path))
    except BlockingIOError:
        return True  # listening, its backlog full for the moment
    except OSError:
        return False  # not there yet (ENOENT), or bound but not listening (ECONNREFUSED)
    finally:
        probe.close()
    return True


def take_socket(bound: Path, dest: Path) -> None:
    """Move the socket the agent bound in `run/` (writable by the sandbox, which sees it at /.corral/run) to
    `dest` in the sandbox's root-only directory, root's and 0600. It stays bound and listening: a Unix socket is
    reached through its inode, whatever its name. Then `run/` becomes root's, empty and 0555, so the sandbox can
    write nothing there (it stays mounted: it is on the host's disk, outside the sandbox's quota) and cannot plant
    a socket of its own where the engine would connect. The same as the Docker backend does with its `run/`."""
    os.rename(bound, dest)
    if not stat.S_ISSOCK(os.lstat(dest).st_mode):  # the agent alone ran so far; anything else is not ours
        dest.unlink()
        raise ServerError(f"{bound} is not the agent's socket")
    os.chown(dest, 0, 0, follow_symlinks=False)
    os.chmod(dest, 0o600)
    run_dir = bound.parent
    os.chown(run_dir, 0, 0)
    os.chmod(run_dir, 0o555)  # noqa: S103 - read-only to the sandbox: it stays mounted there


def tail(path: Path, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return "(no agent log)"
    return text or "(agent log empty)"
