"""A fake in-sandbox agent that speaks `corral/agent/protocol.py`, for tests of the layers above the engine.

It answers what the engine's agent client sends, with the real agent's event shapes and error codes
(`tests/test_fake_agent_honesty.py` runs the same scenarios against both): ping, exec (foreground with stdin,
streamed stdout/stderr, exit codes, timeouts, max_output; background with ps, stdin, kill, wait, attach,
follow), files (read, write, list, stat, exists, mkdir, remove, rename), tar both ways, and heartbeats.
Commands run in `tests/fake_shell.py`'s toy shell over a temp directory: no host process, no host path outside it.
Not implemented (refused with `invalid_request`, as an unknown op): code cells, PTY terminals, watches, port
tunnels; tests of those stay on real sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
import posixpath
import shutil
import stat
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.agent import protocol
from corral.agent.processes import OutputBuffer, build_argv

from .fake_shell import FakeFs, Io, Shell

__all__ = ["AgentFailure", "FakeAgent"]

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
ERRNO_CODES = {2: "not_found", 13: "permission_denied", 1: "permission_denied", 17: "conflict", 39: "conflict",
               21: "invalid_request", 20: "invalid_request", 40: "invalid_request", 22: "invalid_request"}


_REAL_ONLY = frozenset({"connect"})  # ops of the real agent this fake does not have (nor code_*, watch*)


class AgentFailure(Exception):
    """An error answer: the real agent's `code` and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _os_failure(exc: OSError, path: str) -> AgentFailure:
    code = ERRNO_CODES.get(exc.errno or 0, "server_error")
    return AgentFailure(code, f"{path}: {os.strerror(exc.errno) if exc.errno else exc}")


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_sent = time.monotonic()
        self.closed = False

    async def recv(self) -> tuple[int, bytes]:
        kind, length = protocol.parse_header(await self.reader.readexactly(protocol.HEADER.size))
        return kind, await self.reader.readexactly(length) if length else b""

    def send(self, kind: int, payload: bytes = b"") -> None:
        if self.closed:
            return
        for i in range(0, max(len(payload), 1), protocol.CHUNK):
            self.writer.write(protocol.encode(kind, payload[i : i + protocol.CHUNK]))
        self.last_sent = time.monotonic()

    def event(self, **fields: Any) -> None:
        self.send(protocol.EVENT, protocol.encode_json(protocol.EVENT, fields)[protocol.HEADER.size:])

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()


@dataclass
class _Process:
    id: str
    pid: int
    argv: list[str]
    cwd: str
    env: dict[str, str]
    tag: str | None
    background: bool
    max_output: int
    want_stdin: bool
    timeout: float | None
    stdout: OutputBuffer = field(init=False)
    stderr: OutputBuffer = field(init=False)
    stdin: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    stdin_open: bool = True
    done: asyncio.Event = field(default_factory=asyncio.Event)
    followers: list[Callable[[str, bytes], None]] = field(default_factory=list)
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    killed: bool = False
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    ended: float | None = None
    task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.stdout = OutputBuffer(self.max_output)
        self.stderr = OutputBuffer(self.max_output)
        if not self.want_stdin:
            self.stdin_open = False

    def result(self) -> dict[str, Any]:
        return {"event": "exit", "id": self.id, "pid": self.pid, "exit_code": self.exit_code, "signal": self.signal,
                "timed_out": self.timed_out, "killed": self.killed,
                "duration": round((self.ended or time.monotonic()) - self.started, 6),
                "stdout_size": self.stdout.total, "stderr_size": self.stderr.total,
                "truncated": bool(self.stdout.omitted or self.stderr.omitted)}

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "pid": self.pid, "tag": self.tag, "argv": self.argv, "cwd": self.cwd, "env": self.env,
                "background": self.background, "pty": False, "running": not self.done.is_set(),
                "started_at": self.started_wall, "exit": self.result() if self.done.is_set() else None}

    def emit(self, stream: str, data: bytes) -> bytes:
        live = (self.stdout if stream == "stdout" else self.stderr).feed(data)
        for follower in list(self.followers):
            follower(stream, data)
        return live

    async def read_stdin(self) -> bytes:
        if not self.want_stdin:
            return b""
        return await self.stdin.get()

    def kill(self, *, timed_out: bool = False) -> None:
        if self.done.is_set() or self.task is None:
            return
        self.timed_out = self.timed_out or timed_out
        self.killed = self.killed or not timed_out
        self.task.cancel()


class FakeAgent:
    """One sandbox's agent: `handle` serves one connection (one request), as the real agent does."""

    def __init__(self, root: Path, token: str) -> None:
        self.fs = FakeFs(root)
        self.token = token
        self.processes: dict[str, _Process] = {}
        self._ids = itertools.count(1)
        self._pids = itertools.count(100)
        self.started = time.time()
        self.base_env = {"HOME": "/home/user", "USER": "user", "PATH": "/usr/local/bin:/usr/bin:/bin",
                         "LANG": "C.UTF-8"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer)
        beat: asyncio.Task[None] | None = None
        try:
            kind, payload = await conn.recv()
            req = protocol.decode_json(payload) if kind == protocol.REQUEST else {}
            if req.pop("token", None) != self.token:
                raise AgentFailure("unauthenticated", "the agent token is missing or wrong")
            interval = req.pop("heartbeat", None)
            if isinstance(interval, int | float) and interval > 0 and req.get("op") != "connect":
                beat = asyncio.create_task(_heartbeats(conn, float(interval)))
            await self.dispatch(conn, req)
        except AgentFailure as exc:
            conn.send(protocol.ERROR, protocol.encode_json(protocol.ERROR, {
                "code": exc.code, "message": exc.message, "details": {}})[protocol.HEADER.size:])
        except OSError as exc:
            failure = _os_failure(exc, str(exc.filename or ""))
            conn.send(protocol.ERROR, protocol.encode_json(protocol.ERROR, {
                "code": failure.code, "message": failure.message, "details": {}})[protocol.HEADER.size:])
        except (asyncio.IncompleteReadError, protocol.ProtocolError):
            pass
        finally:
            if beat is not None:
                beat.cancel()
            await conn.drain()
            conn.closed = True
            writer.close()

    async def close(self) -> None:
        for proc in self.processes.values():
            proc.kill()
        tasks = [p.task for p in self.processes.values() if p.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def dispatch(self, conn: _Conn, req: dict[str, Any]) -> None:
        op = req.get("op")
        handler: Callable[[_Conn, dict[str, Any]], Awaitable[None]] | None = getattr(self, f"op_{op}", None)
        if isinstance(op, str) and handler is None and (op in _REAL_ONLY or op.startswith(("code_", "watch"))):
            raise AgentFailure("invalid_request", f"the fake agent has no {op} (its tests run on real sandboxes)")
        if not isinstance(op, str) or handler is None:
            raise AgentFailure("invalid_request", f"unknown operation {op!r}")
        await handler(conn, req)

    async def op_ping(self, conn: _Conn, req: dict[str, Any]) -> None:
        conn.event(event="pong", version=protocol.VERSION, uptime=time.time() - self.started, python="fake")

    # -- processes ----------------------------------------------------------------------------------------

    def _spawn(self, req: dict[str, Any]) -> _Process:
        try:
            argv = build_argv(req.get("cmd"))
        except Exception as exc:  # the real agent's ProcessError: its code and message
            raise AgentFailure(getattr(exc, "code", "invalid_request"), getattr(exc, "message", str(exc))) from exc
        if req.get("pty") is not None:
            raise AgentFailure("invalid_request", "the fake agent has no terminals (tests of PTYs run on runc)")
        cwd = req.get("cwd") or "/workspace"
        if not isinstance(cwd, str) or not self.fs.host(cwd).is_dir():
            raise AgentFailure("invalid_request", f"working directory {cwd!r} does not exist in the sandbox")
        timeout = req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                                    or timeout <= 0):
            raise AgentFailure("invalid_request", "timeout must be a positive number of seconds")
        max_output = int(req.get("max_output") or DEFAULT_MAX_OUTPUT)
        if max_output < 4:
            raise AgentFailure("invalid_request", "max_output must be at least 4 bytes")
        tag = req.get("tag")
        if tag is not None and any(p.tag == tag and not p.done.is_set() for p in self.processes.values()):
            raise AgentFailure("conflict", f"a running process is already tagged {tag!r}")
        cmd_env = dict(req.get("cmd_env") or {})
        env = {**self.base_env, **dict(req.get("env") or {}), **cmd_env}
        if req.get("user") == "root":
            env.update(HOME="/root", USER="root")
        proc = _Process(str(next(self._ids)), next(self._pids), argv, cwd, cmd_env, tag,
                        bool(req.get("background")), max_output, bool(req.get("stdin")), timeout)
        shell = Shell(self.fs, env, cwd, user="root" if req.get("user") == "root" else "user")
        proc.task = asyncio.create_task(self._run(proc, shell))
        self.processes[proc.id] = proc
        return proc

    async def _run(self, proc: _Process, shell: Shell) -> None:
        async def out(b: bytes) -> None:
            proc.emit("stdout", b)

        async def err(b: bytes) -> None:
            proc.emit("stderr", b)

        stdio = Io(proc.read_stdin, out, err)
        try:
            async with asyncio.timeout(proc.timeout):
                proc.exit_code = await shell.run_argv(proc.argv, stdio)
        except (TimeoutError, asyncio.CancelledError):
            proc.timed_out = proc.timed_out or not proc.killed
            proc.exit_code, proc.signal = 128 + 9, 9
        finally:
            proc.ended = time.monotonic()
            proc.done.set()

    async def op_exec(self, conn: _Conn, req: dict[str, Any]) -> None:
        background = bool(req.get("background"))
        if req.get("stream") and not background:
            raise AgentFailure("invalid_request", "stream applies to background processes (a foreground "
                               "command streams anyway)")
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        proc = self._spawn(req)
        started = {"event": "started", "id": proc.id, "pid": proc.pid, "max_output": proc.max_output}
        if background and req.get("stream"):
            await self._follow(conn, proc, started, replay=True)
            return
        if background:
            conn.event(**started)
            return
        head = {"stdout": 0, "stderr": 0}
        buffers = {"stdout": proc.stdout, "stderr": proc.stderr}

        def live(stream: str, data: bytes) -> None:
            queue.put_nowait((stream, data))

        proc.followers.append(live)
        conn.event(**started)
        feeder = asyncio.create_task(self._feed_from(conn, proc)) if proc.want_stdin else None
        watcher = None if feeder else asyncio.create_task(self._watch_hangup(conn, proc))
        waiter = asyncio.create_task(proc.done.wait())
        while True:
            getter = asyncio.create_task(queue.get())
            finished, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                stream, data = getter.result()
                room = buffers[stream].head_cap - head[stream]
                part = data[: max(room, 0)]
                head[stream] += len(part)
                if part:
                    conn.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, part)
                    await conn.drain()
                continue
            getter.cancel()
            while not queue.empty():
                stream, data = queue.get_nowait()
                room = buffers[stream].head_cap - head[stream]
                if part := data[: max(room, 0)]:
                    head[stream] += len(part)
                    conn.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, part)
            break
        for task in (feeder, watcher):
            if task is not None:
                task.cancel()
        for name, kind in (("stdout", protocol.STDOUT), ("stderr", protocol.STDERR)):
            buf = buffers[name]
            if buf.tail_len:
                conn.event(event="tail", stream=name, omitted=buf.omitted)
                conn.send(kind, buf.tail_bytes())
        conn.event(**proc.result())

    async def _feed_from(self, conn: _Conn, proc: _Process) -> None:
        """Host -> process for a foreground command: stdin, EOF, controls; a vanished host kills it."""
        try:
            while not proc.done.is_set():
                kind, payload = await conn.recv()
                if kind == protocol.STDIN:
                    proc.stdin.put_nowait(payload)
                elif kind == protocol.STDIN_EOF:
                    proc.stdin.put_nowait(b"")
                elif kind == protocol.CONTROL:
                    _control(proc, protocol.decode_json(payload))
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError):
            proc.kill()

    async def _watch_hangup(self, conn: _Conn, proc: _Process) -> None:
        try:
            while not proc.done.is_set():
                kind, payload = await conn.recv()
                if kind == protocol.CONTROL:
                    _control(proc, protocol.decode_json(payload))
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError):
            proc.kill()

    async def _follow(self, conn: _Conn, proc: _Process, first: dict[str, Any], *, replay: bool) -> None:
        """Send `first`, the kept output (if `replay`), then every new byte until the process ends or the host
        leaves (the process goes on)."""
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        proc.followers.append(lambda s, d: queue.put_nowait((s, d)))
        conn.event(**first)
        if replay:
            for name, kind, buf in (("stdout", protocol.STDOUT, proc.stdout), ("stderr", protocol.STDERR,
                                                                               proc.stderr)):
                if buf.head:
                    conn.send(kind, bytes(buf.head))
                if buf.tail_len:
                    conn.event(event="tail", stream=name, omitted=buf.omitted)
                    conn.send(kind, buf.tail_bytes())
            while not queue.empty():
                queue.get_nowait()  # what is kept was sent above
        hangup = asyncio.create_task(conn.reader.read(1))
        waiter = asyncio.create_task(proc.done.wait())
        try:
            while True:
                getter = asyncio.create_task(queue.get())
                finished, _ = await asyncio.wait({getter, waiter, hangup}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    stream, data = getter.result()
                    conn.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, data)
                    await conn.drain()
                    continue
                getter.cancel()
                if hangup in finished:
                    return
                while not queue.empty():
                    stream, data = queue.get_nowait()
                    conn.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, data)
                conn.event(**proc.result())
                return
        finally:
            hangup.cancel()
            waiter.cancel()

    def _find(self, req: dict[str, Any]) -> _Process:
        given = [key for key in ("id", "pid", "tag") if req.get(key) is not None]
        if len(given) != 1:
            raise AgentFailure("invalid_request", "name the process by exactly one of id, pid or tag")
        key = given[0]
        value = req[key]
        if key == "pid" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise AgentFailure("invalid_request", f"pid must be a positive integer, not {value!r}")
        found = [p for p in self.processes.values() if getattr(p, key) == value]
        if not found:
            if key == "id":
                raise AgentFailure("not_found", f"no process {value!r} in this sandbox")
            raise AgentFailure("not_found", f"no process with {key} {value!r} in this sandbox")
        running = [p for p in found if not p.done.is_set()]
        return (running or found)[-1]

    async def op_ps(self, conn: _Conn, req: dict[str, Any]) -> None:
        if any(req.get(key) is not None for key in ("id", "pid", "tag")):
            conn.event(event="done", process=self._find(req).info())
        else:
            conn.event(event="done", processes=[p.info() for p in self.processes.values()])

    async def op_kill(self, conn: _Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        sig = int(req.get("signal") or 9)
        proc.kill()
        if sig == 9:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.done.wait(), 5)
            proc.signal = 9 if proc.killed else proc.signal
            conn.event(event="done", reaped=proc.done.is_set())
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.done.wait(), 5)
            proc.exit_code, proc.signal = 128 + sig, sig
            conn.event(event="done")

    async def op_stdin(self, conn: _Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        if not proc.stdin_open:
            raise AgentFailure("conflict",
                               f"process {proc.id} was started without stdin (or its stdin is closed)")
        conn.event(event="ready")
        await conn.drain()
        while True:
            kind, payload = await conn.recv()
            if kind == protocol.STDIN:
                proc.stdin.put_nowait(payload)
            elif kind == protocol.STDIN_EOF:
                proc.stdin.put_nowait(b"")
                proc.stdin_open = False
                break
            elif kind == protocol.DATA_END:
                break
        conn.event(event="done")

    async def op_resize(self, conn: _Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        raise AgentFailure("conflict", f"process {proc.id} has no terminal")

    async def op_wait(self, conn: _Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        timeout = req.get("timeout")
        try:
            await asyncio.wait_for(proc.done.wait(), None if timeout is None else float(timeout))
        except TimeoutError:
            conn.event(event="running", id=proc.id)
            return
        if req.get("output", True):
            for kind, buf in ((protocol.STDOUT, proc.stdout), (protocol.STDERR, proc.stderr)):
                if buf.head:
                    conn.send(kind, bytes(buf.head))
                if buf.tail_len:
                    conn.event(event="tail", stream="stdout" if kind == protocol.STDOUT else "stderr",
                               omitted=buf.omitted)
                    conn.send(kind, buf.tail_bytes())
        conn.event(**proc.result())

    async def op_attach(self, conn: _Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        attached = {"event": "attached", "id": proc.id, "pid": proc.pid, "max_output": proc.max_output}
        await self._follow(conn, proc, attached, replay=bool(req.get("replay", True)))

    # -- files --------------------------------------------------------------------------------------------

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

    async def op_read(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        if host.is_dir():
            raise AgentFailure("invalid_request", f"{path} is a directory; download it as an archive instead")
        try:
            data = host.read_bytes()
        except OSError as exc:
            raise _os_failure(exc, path) from exc
        conn.event(event="file", size=len(data))
        for i in range(0, len(data), protocol.CHUNK):
            conn.send(protocol.DATA, data[i : i + protocol.CHUNK])
            await conn.drain()
        conn.send(protocol.DATA_END)
        conn.event(event="done", size=len(data))

    async def op_write(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        if host.is_dir():
            raise AgentFailure("invalid_request", f"{path} is a directory")
        try:
            host.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_failure(exc, path) from exc
        conn.event(event="ready")
        await conn.drain()
        data = bytearray()
        while True:
            kind, payload = await conn.recv()
            if kind == protocol.DATA_END:
                break
            if kind != protocol.DATA:
                raise AgentFailure("invalid_request", f"unexpected frame kind {kind} during upload of {path}")
            data += payload
        host.write_bytes(bytes(data))
        host.chmod(int(req.get("mode", 0o644)) & 0o7777)
        conn.event(event="done", size=len(data), path=path)

    async def op_list(self, conn: _Conn, req: dict[str, Any]) -> None:
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

    async def op_stat(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path, follow=False)
        if not host.exists() and not host.is_symlink():
            raise AgentFailure("not_found", f"{path}: No such file or directory")
        conn.event(event="done", entry=self._entry(path, host))

    async def op_exists(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path, follow=False)
        conn.event(event="done", exists=host.exists() or host.is_symlink())

    async def op_mkdir(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        created = not host.is_dir()
        try:
            host.mkdir(parents=bool(req.get("parents", True)), exist_ok=True)
        except OSError as exc:
            raise _os_failure(exc, path) from exc
        conn.event(event="done", created=created)

    async def op_remove(self, conn: _Conn, req: dict[str, Any]) -> None:
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
            raise _os_failure(exc, path) from exc
        conn.event(event="done")

    async def op_rename(self, conn: _Conn, req: dict[str, Any]) -> None:
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
            raise _os_failure(exc, src) from exc
        conn.event(event="done", entry=self._entry(dst, hdst))

    async def op_tar_get(self, conn: _Conn, req: dict[str, Any]) -> None:
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

    async def op_tar_put(self, conn: _Conn, req: dict[str, Any]) -> None:
        path = self._path(req.get("path"), req.get("roots"))
        host = self.fs.host(path)
        conn.event(event="ready")
        await conn.drain()
        data = bytearray()
        while True:
            kind, payload = await conn.recv()
            if kind == protocol.DATA_END:
                break
            data += payload
        host.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
                members = tar.getmembers()
                tar.extractall(host, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise AgentFailure("invalid_request", f"not a usable tar archive: {exc}") from exc
        conn.event(event="done", entries=len(members))


def _control(proc: _Process, msg: dict[str, Any]) -> None:
    if msg.get("kill") or "signal" in msg:
        proc.kill()


async def _heartbeats(conn: _Conn, interval: float) -> None:
    while not conn.closed:
        await asyncio.sleep(interval / 2)
        if time.monotonic() - conn.last_sent >= interval:
            conn.send(protocol.HEARTBEAT)
