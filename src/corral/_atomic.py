"""Replacing a file so that a reader, or a crash, sees the old content or the new, never a mix.

The one helper for every state file Corral writes (engine state, backend records, template metadata, key files):
write a temporary file beside the target, fsync it, rename it over the target, fsync the directory.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "kept_secret", "write_atomic", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Replace `path` with `data`. `mode` is applied whatever the umask; `durable=False` skips the fsyncs
    (for files that a crash may lose, never tear)."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, *, mode: int = 0o600, durable: bool = True) -> None:
    # json.dumps, not json.dump: dump streams through the slow pure-Python encoder.
    write_atomic(path, json.dumps(obj).encode(), mode=mode, durable=durable)


def kept_secret(path: Path, nbytes: int = 32) -> bytes:
    """The secret kept at `path` (hex, 0600), made at random if there is none yet; never replaced once there."""
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.new-{secrets.token_hex(4)}")
    write_atomic(staged, secrets.token_hex(nbytes).encode() + b"\n", mode=0o600)
    try:
        os.link(staged, path)  # never replaces: two servers starting at once end up with the same secret
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    return path.read_bytes().strip()
