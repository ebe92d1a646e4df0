"""The fake agent's file operations (`corral/agent/files.py` and `archives.py` ops) over its `FakeFs`: read, write,
list, stat, exists, mkdir, remove, rename, and tar both ways, with the real agent's event shapes and error codes."""

from __future__ import annotations

import io
import os
import posixpath
import secrets
import shutil
import stat
import tarfile
from pathlib import Path
from typing import Any

from corral.agent import protocol

from .fake_shell import FakeFs
from .fake_wire import AgentFailure, Conn, os_failure

__all__ = ["FileOps"]


class FileOps:
    """Mixed into `FakeAgent`: every op is `op_<name>(conn, req)`."""

    fs: FakeFs


    def _path(self, value: Any, roots: Any = None) -> str:
        if not isinstance(value, str) or not value:
            raise AgentFailure("invalid_request", "path must be a non-empty string")
        if "\x00" in value:
            raise AgentFailure("invalid_request", "path contains a NUL byte")
        if not value.startswith("/"):
            raise AgentFailure("invalid_request", f"path {value!r} is not absolute")
        path = posixpath.normpath(value)
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        if roots:
            real = self.fs.sandbox_path(self.fs.host(path))
            if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
                raise AgentFailure("permission_denied",
                                   f"{path} is outside the directories the file API may touch ({', '.join(roots)})")
        return path

    def _entry(self, path: str, host: Path, name: str | None = None) -> dict[str, Any]:
        st = host.lstat()
        kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
        info: dict[str, Any] = {
            "name": name if name is not None else posixpath.basename(path) or "/", "path": path, "type": kind,
            "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime, "owner": "user",
            "group": "user", "permissions": stat.filemode(st.st_mode), "metadata": {}}
        if kind == "symlink":
            target = os.readlink(host)
            resolved = self.fs.host(path)
            info.update(target=target, resolved=self.fs.sandbox_path(resolved),
                        target_type=("dir" if resolved.is_dir() else "file") if resolved.exists() else None)
        return info

    async def op_read(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        if host.is_dir():
            raise AgentFailure("invalid_request", f"{path} is a directory; download it as an archive instead")
        try:
            data = host.read_bytes()
        except OSError as exc:
            raise os_failure(exc, path) from exc
        conn.event(event="file", size=len(data))
        for i in range(0, len(data), protocol.CHUNK):
            conn.send(protocol.DATA, data[i : i + protocol.CHUNK])
            await conn.drain()
        conn.send(protocol.DATA_END)
        conn.event(event="done", size=len(data))

    async def op_write(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        if host.is_dir():
            raise AgentFailure("invalid_request", f"{path} is a directory")
        try:
            host.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_failure(exc, path) from exc
        data = await _received(conn, path)
        if req.get("in_place"):
            host.write_bytes(bytes(data))
        else:  # as the real agent: a temporary file renamed into place once every byte arrived
            tmp = host.with_name(f".corral-upload-{secrets.token_hex(4)}")
            tmp.write_bytes(bytes(data))
            os.replace(tmp, host)
            self.fs.placed.add(host.stat().st_ino)  # a watch sees its rename: `create`, never `write`
        host.chmod(int(req.get("mode", 0o644)) & 0o7777)
        conn.event(event="done", size=len(data), path=path)

    async def op_list(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        depth = req.get("depth", 1)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise AgentFailure("invalid_request", f"depth must be a whole number of at least 1, not {depth!r}")
        top = self.fs.host(path)
        if not top.exists():
            raise AgentFailure("not_found", f"{path}: No such file or directory")
        if not top.is_dir():
            raise AgentFailure("invalid_request", f"{path}: Not a directory")
        entries: list[dict[str, Any]] = []

        def walk(sandbox_dir: str, host_dir: Path, level: int) -> None:
            for name in sorted(os.listdir(host_dir)):
                child = host_dir / name
                full = sandbox_dir.rstrip("/") + "/" + name
                entries.append(self._entry(full, child, name))
                if level < depth and child.is_dir() and not child.is_symlink():
                    walk(full, child, level + 1)

        walk(path, top, 1)
        if entries:
            conn.event(event="entries", entries=entries)
        conn.event(event="done")

    async def op_stat(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path, follow=False)
        if not host.exists() and not host.is_symlink():
            raise AgentFailure("not_found", f"{path}: No such file or directory")
        conn.event(event="done", entry=self._entry(path, host))

    async def op_exists(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path, follow=False)
        conn.event(event="done", exists=host.exists() or host.is_symlink())

    async def op_mkdir(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        created = not host.is_dir()
        try:
            host.mkdir(parents=bool(req.get("parents", True)), exist_ok=True)
        except OSError as exc:
            raise os_failure(exc, path) from exc
        conn.event(event="done", created=created)

    async def op_remove(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        if path == "/":
            raise AgentFailure("invalid_request", "refusing to remove /")
        host = self.fs.host(path, follow=False)
        try:
            if host.is_dir() and not host.is_symlink():
                if req.get("recursive", True):
                    shutil.rmtree(host)
                else:
                    host.rmdir()
            else:
                host.unlink()
        except OSError as exc:
            raise os_failure(exc, path) from exc
        conn.event(event="done")

    async def op_rename(self, conn: Conn, req: dict[str, Any]) -> None:
        roots = req.get("roots")
        src, dst = self._path(req.get("src"), roots), self._path(req.get("dst"), roots)
        hsrc, hdst = self.fs.host(src, follow=False), self.fs.host(dst, follow=False)
        if not hsrc.exists() and not hsrc.is_symlink():
            raise AgentFailure("not_found", f"{src}: No such file or directory")
        if not req.get("overwrite", False) and (hdst.exists() or hdst.is_symlink()):
            raise AgentFailure("conflict", f"{dst} already exists")
        if req.get("parents", False):
            hdst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(hsrc, hdst)
        except OSError as exc:
            raise os_failure(exc, src) from exc
        conn.event(event="done", entry=self._entry(dst, hdst))

    async def op_tar_get(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        if not host.exists():
            raise AgentFailure("not_found", f"{path}: No such file or directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if req.get("contents"):
                for name in sorted(os.listdir(host)):
                    tar.add(host / name, arcname=name)
            else:
                tar.add(host, arcname=posixpath.basename(path) or ".")
        conn.event(event="archive")
        data = buf.getvalue()
        for i in range(0, len(data), protocol.CHUNK):
            conn.send(protocol.DATA, data[i : i + protocol.CHUNK])
        conn.send(protocol.DATA_END)
        conn.event(event="done")

    async def op_tar_put(self, conn: Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        data = await _received(conn, path)
        host.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
                members = tar.getmembers()
                tar.extractall(host, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise AgentFailure("invalid_request", f"not a usable tar archive: {exc}") from exc
        conn.event(event="done", entries=len(members))


async def _received(conn: Conn, path: str) -> bytearray:
    """An upload's bytes, after telling the client to send them: DATA frames up to DATA_END, as the agent reads."""
    conn.event(event="ready")
    await conn.drain()
    data = bytearray()
    while True:
        kind, payload = await conn.recv()
        if kind == protocol.DATA_END:
            return data
        if kind != protocol.DATA:
            raise AgentFailure("invalid_request", f"unexpected frame kind {kind} during upload of {path}")
        data += payload
