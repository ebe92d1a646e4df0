"""The package mirror's cache on disk: index pages (one JSON header line, then the body as received) and files,
each written to a temporary file beside its entry and moved into place only complete, so that a crash or a full disk
never leaves a torn entry (a full disk costs the cache, never the request)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("corral.egress._mirror")  # the mirror's logger, as before its cache had a module


@dataclass(frozen=True)
class CachedPage:
    body: bytes
    content_type: str
    fetched_at: float


def ensure_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o755, parents=True)
    except FileExistsError:
        return
    path.chmod(0o755)  # the mode given to mkdir is cut by the umask


def create(path: Path) -> BinaryIO:
    """A new file at `path` (never an existing file or a planted symlink), 0644 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class CacheWriter:
    """Writes one download to a temporary file beside its cache entry. A full or failing disk ends caching, never
    the download: the client still gets its file, the next request tries again."""

    def __init__(self, where: Path) -> None:
        self._where = where
        self._tmp = where.with_name(f".{where.name}.{secrets.token_hex(8)}.tmp")
        self._file: BinaryIO | None = None
        try:
            ensure_dir(where.parent)
            self._file = create(self._tmp)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", where.name, exc)

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(chunk)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", self._where.name, exc)
            self.abandon()

    async def commit(self) -> None:
        """Moves the complete file into place; it is flushed to disk first, so a crash leaves no torn entry."""
        if self._file is None:
            return
        try:
            self._file.flush()
            await asyncio.to_thread(os.fsync, self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._where)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", self._where.name, exc)
        self.abandon()

    def abandon(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


def read_page(where: Path) -> CachedPage | None:
    try:
        with where.open("rb") as file:
            header = json.loads(file.readline())
            return CachedPage(file.read(), str(header["content_type"]), float(header["fetched_at"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("package mirror: ignoring unreadable cached page %s: %s", where.name, exc)
        return None  # fetch it again; the write that follows replaces it


def write_page(where: Path, page: CachedPage, url: str) -> None:
    header = {"url": url, "content_type": page.content_type, "fetched_at": page.fetched_at}
    tmp = where.with_name(f".{where.name}.{secrets.token_hex(8)}.tmp")
    try:
        with create(tmp) as file:
            file.write(json.dumps(header).encode() + b"\n" + page.body)
        os.replace(tmp, where)
    except OSError as exc:  # a full disk costs the cache, not the request
        log.warning("package mirror: not caching %s: %s", url, exc)
    finally:
        tmp.unlink(missing_ok=True)
