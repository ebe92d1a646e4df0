"""A fake in-sandbox agent that speaks `corral/agent/protocol.py`, for tests of the layers above the engine.

It answers what the engine's agent client sends, with the real agent's event shapes and error codes
(`tests/test_fake_agent_honesty.py` runs the same exchanges against both): ping, exec (foreground with stdin,
streamed stdout/stderr, exit codes, timeouts, max_output; background with ps, stdin, kill, wait, attach,
follow), PTY terminals (echo, line editing, CR-LF output, resize, `stty size`), files and tar both ways
(`tests/fake_files.py`), code cells (`tests/fake_code.py`), directory watches (`tests/fake_watch.py`), port
tunnels to servers in the sandbox (`tests/fake_ports.py`), and heartbeats. Commands run in `tests/fake_shell.py`'s
toy shell over a temp directory: no host process, no host path outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.agent import protocol
from corral.agent.output import OutputBuffer
from corral.agent.process_requests import ProcessError, build_argv, pty_size

from .fake_code import FakeCode
from .fake_files import FileOps
from .fake_ports import PortHandler, PortOps
from .fake_shell import FakeFs, Io, Shell, is_interactive_shell
from .fake_watch import WatchOps, WatchRegistry
from .fake_wire import AgentFailure, Conn, os_failure

__all__ = ["AgentFailure", "FakeAgent"]

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024


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
    terminal: list[int] | None = None  # [rows, cols] of a PTY process (shared with its shell: `stty size`)
    interactive: bool = False  # a shell reading commands from its terminal: ^C clears the line, not the shell
    line: bytearray = field(default_factory=bytearray)  # a terminal's line being typed (canonical mode)
    kill_signal: int = 9

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
                "background": self.background, "pty": self.terminal is not None, "running": not self.done.is_set(),
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

    def write_stdin(self, data: bytes) -> None:
        """Host input: straight to the process, or through a terminal's line discipline."""
        if self.terminal is None:
            self.stdin.put_nowait(data)
            return
        for byte in data:
            self._tty_byte(byte)

    def _tty_byte(self, byte: int) -> None:
        """Canonical mode with echo, as a Linux PTY: CR is NL, DEL erases, ^D ends input, ^C interrupts."""
        if byte in (0x0D, 0x0A):
            self.emit("stdout", b"\r\n")
            self.stdin.put_nowait(bytes(self.line) + b"\n")
            self.line.clear()
        elif byte == 0x7F:
            if self.line:
                self.line.pop()
                self.emit("stdout", b"\b \b")
        elif byte == 0x04:
            self.stdin.put_nowait(bytes(self.line)) if self.line else self.stdin.put_nowait(b"")
            self.line.clear()
        elif byte == 0x03:
            self.emit("stdout", b"^C\r\n")
            self.line.clear()
            if not self.interactive:
                self.kill(signal=2)
        else:
            self.line.append(byte)
            self.emit("stdout", bytes([byte]))

    def kill(self, *, timed_out: bool = False, signal: int = 9) -> None:
        if self.done.is_set() or self.task is None:
            return
        self.timed_out = self.timed_out or timed_out
        self.killed = self.killed or not timed_out
        self.kill_signal = signal
        self.task.cancel()


class FakeAgent(FileOps, WatchOps, PortOps):
    """One sandbox's agent: `handle` serves one connection (one request), as the real agent does."""

    def __init__(self, root: Path, token: str) -> None:
        self.fs = FakeFs(root)
        self.token = token
        self.code = FakeCode(self)
        self.ports: dict[int, PortHandler] = {}  # what listens in the sandbox (tests/fake_ports.py)
        self.watches = WatchRegistry(self.fs)
        self.processes: dict[str, _Process] = {}
        self._ids = itertools.count(1)
        self._pids = itertools.count(100)
        self.started = time.time()
        self.base_env = {"HOME": "/home/user", "USER": "user", "PATH": "/usr/local/bin:/usr/bin:/bin",
                         "LANG": "C.UTF-8"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
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
        except (AgentFailure, ProcessError) as exc:  # ProcessError: the real agent's validators, reused
            conn.send(protocol.ERROR, protocol.encode_json(protocol.ERROR, {
                "code": exc.code, "message": exc.message, "details": {}})[protocol.HEADER.size:])
        except OSError as exc:
            failure = os_failure(exc, str(exc.filename or ""))
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
        self.watches.close()
        for proc in self.processes.values():
            proc.kill()
        tasks = [p.task for p in self.processes.values() if p.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def dispatch(self, conn: Conn, req: dict[str, Any]) -> None:
        op = req.get("op")
        target: object = self
        if isinstance(op, str) and op.startswith("code_"):
            target, op = self.code, op[len("code_"):]
        handler: Callable[[Conn, dict[str, Any]], Awaitable[None]] | None = getattr(target, f"op_{op}", None)
        if not isinstance(op, str) or handler is None:
            raise AgentFailure("invalid_request", f"unknown operation {op!r}")
        await handler(conn, req)

    async def op_ping(self, conn: Conn, req: dict[str, Any]) -> None:
        conn.event(event="pong", version=protocol.VERSION, uptime=time.time() - self.started, python="fake")

    # -- processes ----------------------------------------------------------------------------------------

    def _spawn(self, req: dict[str, Any]) -> _Process:
        try:
            argv = build_argv(req.get("cmd"))
        except Exception as exc:  # the real agent's ProcessError: its code and message
            raise AgentFailure(getattr(exc, "code", "invalid_request"), getattr(exc, "message", str(exc))) from exc
        terminal = None if req.get("pty") is None else list(pty_size(req["pty"]))
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
                        bool(req.get("background")), max_output, bool(req.get("stdin")) or terminal is not None,
                        timeout)
        proc.terminal = terminal
        proc.interactive = terminal is not None and is_interactive_shell(argv)
        if terminal is not None:
            env.setdefault("TERM", "xterm")
        shell = Shell(self.fs, env, cwd, user="root" if req.get("user") == "root" else "user", terminal=terminal,
                      ports=self.ports)
        proc.task = asyncio.create_task(self._run(proc, shell))
        self.processes[proc.id] = proc
        return proc

    async def _run(self, proc: _Process, shell: Shell) -> None:
        async def out(b: bytes) -> None:
            proc.emit("stdout", b)

        async def err(b: bytes) -> None:
            proc.emit("stderr", b)

        if proc.terminal is not None:  # one stream, and the terminal's output processing (ONLCR)
            async def out(b: bytes) -> None:
                proc.emit("stdout", b.replace(b"\n", b"\r\n"))

            err = out

        stdio = Io(proc.read_stdin, out, err)
        try:
            async with asyncio.timeout(proc.timeout):
                proc.exit_code = await shell.run_argv(proc.argv, stdio)
        except (TimeoutError, asyncio.CancelledError):
            proc.timed_out = proc.timed_out or not proc.killed
            proc.exit_code, proc.signal = 128 + proc.kill_signal, proc.kill_signal
        finally:
            proc.ended = time.monotonic()
            proc.done.set()

    async def op_exec(self, conn: Conn, req: dict[str, Any]) -> None:
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
        getter: asyncio.Task[tuple[str, bytes]] | None = None
        try:
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
        finally:  # a cancelled request leaves no task behind
            for task in (getter, waiter, feeder, watcher):
                if task is not None:
                    task.cancel()
        for name, kind in (("stdout", protocol.STDOUT), ("stderr", protocol.STDERR)):
            buf = buffers[name]
            if buf.tail_len:
                conn.event(event="tail", stream=name, omitted=buf.omitted)
                conn.send(kind, buf.tail_bytes())
        conn.event(**proc.result())

    async def _feed_from(self, conn: Conn, proc: _Process) -> None:
        """Host -> process for a foreground command: stdin, EOF, controls; a vanished host kills it."""
        try:
            while not proc.done.is_set():
                kind, payload = await conn.recv()
                if kind == protocol.STDIN:
                    proc.write_stdin(payload)
                elif kind == protocol.STDIN_EOF and proc.terminal is None:
                    proc.stdin.put_nowait(b"")
                elif kind == protocol.CONTROL:
                    _control(proc, protocol.decode_json(payload))
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError):
            proc.kill()

    async def _watch_hangup(self, conn: Conn, proc: _Process) -> None:
        try:
            while not proc.done.is_set():
                kind, payload = await conn.recv()
                if kind == protocol.CONTROL:
                    _control(proc, protocol.decode_json(payload))
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError):
            proc.kill()

    async def _follow(self, conn: Conn, proc: _Process, first: dict[str, Any], *, replay: bool) -> None:
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
        getter: asyncio.Task[tuple[str, bytes]] | None = None
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
            if getter is not None:
                getter.cancel()

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

    async def op_ps(self, conn: Conn, req: dict[str, Any]) -> None:
        if any(req.get(key) is not None for key in ("id", "pid", "tag")):
            conn.event(event="done", process=self._find(req).info())
        else:
            conn.event(event="done", processes=[p.info() for p in self.processes.values()])

    async def op_kill(self, conn: Conn, req: dict[str, Any]) -> None:
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

    async def op_stdin(self, conn: Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        if not proc.stdin_open:
            raise AgentFailure("conflict",
                               f"process {proc.id} was started without stdin (or its stdin is closed)")
        if req.get("eof"):
            _check_closable(proc)
        conn.event(event="ready")
        await conn.drain()
        while True:
            kind, payload = await conn.recv()
            if kind == protocol.STDIN:
                proc.write_stdin(payload)
            elif kind == protocol.STDIN_EOF:
                _check_closable(proc)
                proc.stdin.put_nowait(b"")
                proc.stdin_open = False
                break
            elif kind == protocol.DATA_END:
                break
        conn.event(event="done")

    async def op_resize(self, conn: Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        rows, cols = pty_size(req)
        if proc.terminal is None:
            raise AgentFailure("conflict", f"process {proc.id} has no terminal")
        proc.terminal[:] = [rows, cols]
        conn.event(event="done")

    async def op_wait(self, conn: Conn, req: dict[str, Any]) -> None:
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

    async def op_attach(self, conn: Conn, req: dict[str, Any]) -> None:
        proc = self._find(req)
        attached = {"event": "attached", "id": proc.id, "pid": proc.pid, "max_output": proc.max_output}
        await self._follow(conn, proc, attached, replay=bool(req.get("replay", True)))


def _control(proc: _Process, msg: dict[str, Any]) -> None:
    if "resize" in msg and proc.terminal is not None:
        proc.terminal[:] = [int(msg["resize"][0]), int(msg["resize"][1])]
    if msg.get("kill") or "signal" in msg:
        proc.kill(signal=9 if msg.get("kill") else int(msg["signal"]))


def _check_closable(proc: _Process) -> None:
    if proc.terminal is not None:  # the real agent's words (process.Process.check_stdin_closable)
        raise AgentFailure("invalid_request", f"process {proc.id} runs in a terminal, whose input cannot be "
                           "closed; send Ctrl-D (the byte 0x04) as input to end it instead")


async def _heartbeats(conn: Conn, interval: float) -> None:
    while not conn.closed:
        await asyncio.sleep(interval / 2)
        if time.monotonic() - conn.last_sent >= interval:
            conn.send(protocol.HEARTBEAT)
