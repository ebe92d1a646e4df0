"""The host side of the agent protocol: one asyncio connection per operation.

Foreign errors (OSError, asyncio.IncompleteReadError, protocol violations) are mapped to `AgentError` here, at
the boundary; errors the agent reports come back through `error_from_code`.

Every wait on an agent is bounded (docs/architecture.md, "Agent liveness"): an agent of protocol version 2 sends a
heartbeat on a connection silent for `Liveness.heartbeat_interval`, and a connection silent for
`Liveness.idle_timeout` fails with `AgentError` (unless Corral itself froze the sandbox: `freeze`/`thaw`).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import socket
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import IO, Any, TypeVar

from .._exceptions import AgentError, CorralError, error_from_code
from .._output import reclaimed_from_wire
from ..agent import protocol
from ..agent.processes import DEFAULT_MAX_OUTPUT, OutputBuffer
from ..backends import Endpoint, UnixEndpoint
from ._code import CodeResult, CodeSession, ResultCallback, RichResult, code_result, code_session, rich_result
from ._exec_options import ExecOptions
from ._models import (
    Entry,
    ExecResult,
    FollowedOutput,
    OutputCollector,
    ProcessInfo,
    ProcessRef,
    ProcessSelector,
    WatchEvent,
)

OutputCallback = Callable[[bytes], Awaitable[None] | None]
StartCallback = Callable[[str, int], Awaitable[None] | None]  # (Corral's process id, its pid in the sandbox)
Roots = list[str] | None  # directories the file API may touch; None: anywhere the user can
Source = bytes | bytearray | memoryview | str | IO[bytes] | AsyncIterable[bytes] | Iterable[bytes]
_TCP_CONNECT_TIMEOUT = 10.0
_UPLOAD_SEND_BUFFER = 1024 * 1024  # a frame in flight while the agent writes the last one
_SO_SNDBUFFORCE = 32  # Linux; the socket module does not name it
_T = TypeVar("_T")


@dataclass(frozen=True)
class Liveness:
    """How long the host waits on a silent agent: the agent beats every `heartbeat_interval` seconds of silence,
    and `idle_timeout` seconds without any frame end the call with `AgentError` (None: wait forever)."""

    heartbeat_interval: float = 5.0
    idle_timeout: float | None = 30.0


class _AgentState:
    """What every client of one agent shares (`as_user` makes more): whether it beats, and whether Corral froze
    it (its own pause: a frozen agent is silent, not wedged)."""

    def __init__(self) -> None:
        self.heartbeats: bool | None = None  # None: not known until a ping tells the agent's protocol version
        self.frozen = False
        self.thawed_at = -float("inf")

    def excused(self, idle: float) -> bool:
        """Whether a silence of `idle` seconds is Corral's doing: frozen now, or thawed since it began."""
        return self.frozen or time.monotonic() - self.thawed_at < idle


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, label: str, *, op: str = "",
                 idle: float | None = None, state: _AgentState | None = None,
                 details: dict[str, Any] | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.label = label
        self.op = op
        self.idle = idle  # None: an agent of before heartbeats, whose silences prove nothing
        self.state = state or _AgentState()
        self.details = details or {}

    async def send(self, kind: int, payload: bytes = b"", *, bounded: bool = False) -> None:
        """`bounded`: the agent must take the bytes within the idle timeout (file data, which it reads as fast
        as it writes; not stdin, which waits for a process that may rightly not read it for hours)."""
        for i in range(0, max(len(payload), 1), protocol.CHUNK):
            self.writer.write(protocol.encode(kind, payload[i : i + protocol.CHUNK]))
        if bounded:
            await self.within_idle(self.writer.drain)
        else:
            await self.writer.drain()

    async def send_json(self, kind: int, obj: dict[str, Any]) -> None:
        self.writer.write(protocol.encode_json(kind, obj))
        await self.writer.drain()

    async def recv(self) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat; `AgentError` after the idle timeout without any frame."""
        while True:
            kind, payload = await self._frame()
            if kind != protocol.HEARTBEAT:
                break
        if kind == protocol.ERROR:
            err = protocol.decode_json(payload)
            raise error_from_code(str(err.get("code")), str(err.get("message")), err.get("details"))
        return kind, payload

    async def _frame(self) -> tuple[int, bytes]:
        # Header and payload waited for apart: a pause may freeze the agent mid-frame, and a wait that starts
        # again must not have dropped the header it had read.
        header = await self.within_idle(lambda: self.reader.readexactly(protocol.HEADER.size))
        kind, length = protocol.parse_header(header)
        if not length:
            return kind, b""
        return kind, await self.within_idle(lambda: self.reader.readexactly(length))

    async def within_idle(self, step: Callable[[], Awaitable[_T]]) -> _T:
        """`step()`, failing with `AgentError` if it makes no progress for the idle timeout. Cancelling a read or
        a drain loses nothing (the bytes stay buffered), so a silence Corral caused (a pause) just waits again."""
        if self.idle is None:
            return await step()
        while True:
            deadline = asyncio.timeout(self.idle)
            try:
                async with deadline:
                    return await step()
            except TimeoutError:
                if not deadline.expired():
                    raise  # the step's own (a TCP ETIMEDOUT), mapped by `_op`
                if not self.state.excused(self.idle):
                    raise _silent_agent(self.label, self.op, self.idle, self.details) from None

    async def event(self) -> dict[str, Any]:
        kind, payload = await self.recv()
        if kind != protocol.EVENT:
            raise protocol.ProtocolError(f"expected an event frame, got kind {kind}")
        return protocol.decode_json(payload)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self.writer.wait_closed()


def _silent_agent(label: str, op: str, idle: float, details: Mapping[str, Any]) -> AgentError:
    """The error of a call whose agent said nothing, not even a heartbeat, for the idle timeout."""
    during = f" during {op!r}" if op else ""
    return AgentError(f"the agent of {label} stopped answering: no frame, not even a heartbeat, for {idle:g}s"
                      f"{during}; its process may be stopped, frozen (not by Corral's pause) or wedged",
                      details={**details, "op": op, "idle_timeout": idle})


class AgentClient:
    """Talks to one sandbox's agent at its endpoint (a Unix socket on this host, or TCP to a Pod), sending the
    sandbox's token with every request.

    `user`: whom the agent acts as for this client's requests (commands run as, files opened as): None is the
    sandbox user; "root" only in a sandbox created with root (the agent refuses it elsewhere). `as_user` makes
    such a client. `liveness`: how long a silent agent is waited for; `sandbox_id` goes into its errors'
    details."""

    def __init__(self, endpoint: Endpoint, token: str, *, label: str = "sandbox", user: str | None = None,
                 liveness: Liveness | None = None, sandbox_id: str | None = None,
                 _state: _AgentState | None = None) -> None:
        self.endpoint = endpoint
        self.token = token
        self.label = label
        self.user = user
        self.liveness = liveness or Liveness()
        self.sandbox_id = sandbox_id
        self._state = _state or _AgentState()

    def as_user(self, user: str | None) -> AgentClient:
        """This agent, acting as `user` (None: the sandbox user)."""
        if user == self.user:
            return self
        return AgentClient(self.endpoint, self.token, label=self.label, user=user, liveness=self.liveness,
                           sandbox_id=self.sandbox_id, _state=self._state)

    def freeze(self) -> None:
        """Corral is pausing the sandbox: its silence from now on is no sign of a wedged agent."""
        self._state.frozen = True

    def thaw(self) -> None:
        """The sandbox runs again: calls that waited through the pause get a whole idle timeout from now."""
        self._state.frozen = False
        self._state.thawed_at = time.monotonic()

    @property
    def _details(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id} if self.sandbox_id is not None else {}

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The reader stops taking from the socket past twice this much buffered (readexactly of a bigger frame
        # still works): one chunk keeps a download's buffered bytes near 2 MiB instead of 16 MiB of server memory.
        # (`asyncio.timeout`, not `wait_for`: before Python 3.12 that runs the connect as a task of its own, a loop
        # iteration more on every call.)
        limit = protocol.CHUNK
        async with asyncio.timeout(self._connect_timeout()):
            if isinstance(self.endpoint, UnixEndpoint):
                # Fails at once if nothing listens, but waits if a stopped agent's backlog is full.
                return await asyncio.open_unix_connection(self.endpoint.path, limit=limit)
            # A TCP connect to an address that went away may hang for minutes.
            return await asyncio.open_connection(self.endpoint.host, self.endpoint.port, limit=limit)

    def _connect_timeout(self) -> float:
        if isinstance(self.endpoint, UnixEndpoint):
            return self.liveness.idle_timeout or _TCP_CONNECT_TIMEOUT
        return _TCP_CONNECT_TIMEOUT

    def _unreachable(self, exc: OSError) -> AgentError:
        """A connection to the agent that failed: why, and what it likely means."""
        if isinstance(exc, TimeoutError):
            return AgentError(f"the agent of {self.label} did not accept a connection within "
                              f"{self._connect_timeout():g}s; the sandbox may have stopped", details=self._details)
        return AgentError(f"the agent of {self.label} is unreachable ({exc.strerror or exc}); "
                          "the sandbox may have stopped", details=self._details)

    async def _heartbeat_field(self, op: str) -> dict[str, float]:
        """What asks the agent for heartbeats, if it sends them; a ping (answered at once by any agent) learns
        that once per agent. An agent of before them is not asked, and its silences are waited out."""
        if op == "ping" or self.liveness.idle_timeout is None:
            return {}
        if self._state.heartbeats is None:
            await self.ping()
        return {"heartbeat": self.liveness.heartbeat_interval} if self._state.heartbeats else {}

    @contextlib.asynccontextmanager
    async def _op(self, op: str, **args: Any) -> AsyncIterator[_Conn]:
        beat = await self._heartbeat_field(op)
        try:
            reader, writer = await self._connect()
        except (TimeoutError, OSError) as exc:
            raise self._unreachable(exc) from exc
        # A ping is bounded whatever the agent's version: every agent answers it at once.
        idle = self.liveness.idle_timeout if beat or op == "ping" else None
        conn = _Conn(reader, writer, self.label, op=op, idle=idle, state=self._state, details=self._details)
        try:
            # No `user` field for the sandbox user: requests stay what they were, for agents of before it.
            identity = {"user": self.user} if self.user is not None else {}
            await conn.send_json(protocol.REQUEST, {"op": op, "token": self.token, **identity, **beat, **args})
            yield conn
        except CorralError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:  # EOF, or a reset: its end went away
            raise AgentError(f"the agent of {self.label} closed the connection during {op!r}; "
                             "the sandbox may have been killed or run out of memory") from exc
        except (OSError, protocol.ProtocolError) as exc:
            raise AgentError(f"talking to the agent of {self.label} failed during {op!r}: {exc}") from exc
        finally:
            await conn.close()

    async def _simple(self, op: str, **args: Any) -> dict[str, Any]:
        async with self._op(op, **args) as conn:
            return await conn.event()

    # -- health ------------------------------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        ev = await self._simple("ping")
        self._state.heartbeats = int(ev.get("version") or 1) >= 2  # version 2 brought heartbeats
        return ev

    # -- ports -----------------------------------------------------------------------------------

    async def open_port(self, port: int) -> socket.socket:
        """A connection to `port` inside the sandbox (127.0.0.1, else ::1), through the agent: a connected,
        non-blocking socket that is from now on a raw byte pipe to that port (a half-close is passed on as one).
        The caller owns it and closes it.

        Nothing listening there is an `AgentError` whose message names the port (`details["port"]`); a port
        outside 1..65535 is `InvalidRequestError`, from the agent (docs/ports.md)."""
        request = protocol.encode_json(protocol.REQUEST, {"op": "connect", "token": self.token, "port": port})
        sock = await self._connect_socket()
        loop = asyncio.get_running_loop()
        idle = self.liveness.idle_timeout
        try:
            with self._mapped("connect"):
                await loop.sock_sendall(sock, request)
                try:  # the agent answers a connect at once: no heartbeats, which would corrupt the pipe
                    async with asyncio.timeout(idle):
                        kind, payload = await _sock_read_frame(sock)
                except TimeoutError:
                    raise _silent_agent(self.label, "connect", idle or 0, self._details) from None
                if kind == protocol.ERROR:
                    err = protocol.decode_json(payload)
                    details = {**(err.get("details") or {}), "port": port}
                    raise error_from_code(str(err.get("code")), str(err.get("message")), details)
                event = protocol.decode_json(payload) if kind == protocol.EVENT else {}
                if event.get("event") != "connected":
                    raise protocol.ProtocolError(f"expected the 'connected' event, got frame kind {kind}")
        except BaseException:
            sock.close()
            raise
        return sock

    async def _connect_socket(self) -> socket.socket:
        """A bare non-blocking socket to the agent: a tunnel must not leave bytes of its pipe in a reader's
        buffer, so nothing is read past the one event."""
        loop = asyncio.get_running_loop()
        try:
            if isinstance(self.endpoint, UnixEndpoint):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                address: Any = self.endpoint.path
            else:
                infos = await loop.getaddrinfo(self.endpoint.host, self.endpoint.port, type=socket.SOCK_STREAM)
                family, kind, proto, _, address = infos[0]
                sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(self._connect_timeout()):
                    await loop.sock_connect(sock, address)
            except BaseException:
                sock.close()
                raise
        except (TimeoutError, OSError) as exc:
            raise self._unreachable(exc) from exc
        return sock

    @contextlib.contextmanager
    def _mapped(self, op: str) -> Iterator[None]:
        """Foreign errors while talking to the agent, as `AgentError` (as `_op` maps them)."""
        try:
            yield
        except CorralError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise AgentError(f"the agent of {self.label} closed the connection during {op!r}; "
                             "the sandbox may have been killed or run out of memory") from exc
        except (OSError, protocol.ProtocolError) as exc:
            raise AgentError(f"talking to the agent of {self.label} failed during {op!r}: {exc}") from exc

    # -- processes -------------------------------------------------------------------------------

    async def exec(self, cmd: str | list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                   stdin: bytes | None = None, timeout: float | None = None, max_output: int | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                   on_start: StartCallback | None = None, cmd_env: dict[str, str] | None = None,
                   tag: str | None = None) -> ExecResult:
        """`run` for a Python caller: `cmd` in the foreground, `env` over the agent's base environment, `cmd_env`
        (the command's own, what `ps` shows) over that."""
        options = ExecOptions(cmd, cwd=cwd, env=cmd_env or {}, timeout=timeout, max_output=max_output, stdin=stdin,
                              tag=tag)
        return await self.run(options, env, on_stdout=on_stdout, on_stderr=on_stderr, on_start=on_start)

    async def run(self, options: ExecOptions, env: dict[str, str] | None, *, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None, on_start: StartCallback | None = None) -> ExecResult:
        """Run a command over the sandbox's environment `env`: `on_start(id, pid)` first, then every byte of its
        output as produced, then its result.

        In the foreground, hanging up (cancelling) kills its tree. A `detached` one is a background process that
        this call follows (a terminal's output is stdout; the result's output is bounded as a foreground
        command's): hanging up only stops following, and the process goes on. `stdin` is written after the start,
        then closed (a detached command's stays open with `keep_stdin`, for `send_stdin`; a terminal's input
        always is)."""
        async with self._op("exec", **options.request(env)) as conn:
            started = await conn.event()
            if on_start is not None:
                await _call_start(on_start, started)
            feeder = None
            if options.stdin is not None:
                feeder = asyncio.create_task(self._stdin_of(options, conn, started))
            try:
                if not options.detached:
                    result = await _collect(conn, on_stdout, on_stderr)
                    assert result is not None  # only `wait` may see a running process
                    return result
                return await _follow(conn, on_stdout, on_stderr, int(started["max_output"]))
            finally:
                if feeder is not None:
                    feeder.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError, CorralError):
                        await feeder

    async def launch(self, options: ExecOptions, env: dict[str, str] | None) -> ProcessInfo:
        """Start a background process (`options` as for a detached `run`) and leave it running; its `stdin`, if
        any, is written before this returns."""
        options = replace(options, detached=True)
        async with self._op("exec", **options.request(env, follow=False)) as conn:
            ev = await conn.event()
        argv = options.cmd if isinstance(options.cmd, list) else ["/bin/bash", "-lc", options.cmd]
        info = ProcessInfo(id=str(ev["id"]), pid=int(ev["pid"]), argv=argv, running=True,
                           pty=options.pty is not None, tag=options.tag, env=dict(options.env))
        if options.stdin is not None:
            await self._feed(ProcessRef(id=info.id), options.stdin, eof=_stdin_eof(options))
        return info

    async def _stdin_of(self, options: ExecOptions, conn: _Conn, started: dict[str, Any]) -> None:
        """A command's stdin: on its own connection (a foreground one's), or fed to the process by id."""
        assert options.stdin is not None
        if options.detached:
            await self._feed(ProcessRef(id=str(started["id"])), options.stdin, eof=_stdin_eof(options))
        else:
            await _feed_stdin(conn, options.stdin)

    async def _feed(self, ref: ProcessRef, data: Source, *, eof: bool) -> None:
        async with self._op("stdin", **ref.selector(), eof=eof) as conn:
            await conn.event()
            async for chunk in _chunks(data):
                await conn.send(protocol.STDIN, chunk)
            await conn.send(protocol.STDIN_EOF if eof else protocol.DATA_END)
            await conn.event()

    async def ps(self) -> builtins.list[ProcessInfo]:
        ev = await self._simple("ps")
        return [_process_info(p) for p in ev["processes"]]

    async def process(self, ref: ProcessSelector) -> ProcessInfo:
        """The one process `ref` names (`NotFoundError` if none)."""
        ev = await self._simple("ps", **ProcessRef.of(ref).selector())
        return _process_info(ev["process"])

    async def kill(self, ref: ProcessSelector, signal: int | None = None) -> None:
        """`signal` to the process's group; None (or 9): SIGKILL to its whole tree, answered once its root is
        reaped (so its pid is gone), or after the agent's bounded wait for that."""
        await self._simple("kill", **ProcessRef.of(ref).selector(), signal=signal)

    async def send_stdin(self, ref: ProcessSelector, data: bytes, *, eof: bool = False) -> None:
        """Write `data` to the process's stdin (a terminal's input, for a PTY), then close it with `eof`; a
        terminal refuses `eof` (`InvalidRequestError`: send Ctrl-D), before anything is written."""
        await self._feed(ProcessRef.of(ref), data, eof=eof)

    async def close_stdin(self, ref: ProcessSelector) -> None:
        await self._feed(ProcessRef.of(ref), b"", eof=True)

    async def resize(self, ref: ProcessSelector, rows: int, cols: int) -> None:
        """Resize a PTY process's terminal (`ConflictError` for one without a terminal, or that ended)."""
        await self._simple("resize", **ProcessRef.of(ref).selector(), rows=rows, cols=cols)

    async def wait(self, ref: ProcessSelector, timeout: float | None = None) -> ExecResult | None:
        """The result with the kept output, or None if still running after `timeout` seconds."""
        async with self._op("wait", **ProcessRef.of(ref).selector(), timeout=timeout) as conn:
            return await _collect(conn, None, None, allow_running=True)

    async def attach(self, ref: ProcessSelector, on_stdout: OutputCallback | None = None,
                     on_stderr: OutputCallback | None = None, *, replay: bool = True,
                     on_start: StartCallback | None = None) -> ExecResult:
        """Follow the process until it ends: `on_start(id, pid)`, then the output kept so far (not with
        `replay=False`), then every new byte, then its result. Hanging up (cancelling) never kills it."""
        async with self._op("attach", **ProcessRef.of(ref).selector(), replay=replay) as conn:
            attached = await conn.event()
            if on_start is not None:
                await _call_start(on_start, attached)
            return await _follow(conn, on_stdout, on_stderr, int(attached["max_output"]))

    async def pty(self, cmd: str | list[str], *, rows: int = 24, cols: int = 80, cwd: str | None = None,
                  env: dict[str, str] | None = None, timeout: float | None = None,
                  cmd_env: dict[str, str] | None = None) -> PtySession:
        cm = self._op("exec", cmd=cmd, cwd=cwd, env=env, timeout=timeout, pty={"rows": rows, "cols": cols},
                      **_optional(cmd_env=cmd_env))
        conn = await cm.__aenter__()
        try:
            started = await conn.event()
        except BaseException:
            await cm.__aexit__(None, None, None)
            raise
        return PtySession(conn, cm, str(started["id"]), int(started["pid"]))

    # -- code sessions ---------------------------------------------------------------------------------

    async def run_code(self, code: str, *, language: str | None = "python", session: str | None = None,
                       context: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
                       env: dict[str, str] | None = None, cell_env: Mapping[str, str] | None = None,
                       cwd: str | None = None, show_saved_images: bool = False,
                       on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                       on_result: ResultCallback | None = None, max_output: int | None = None) -> CodeResult:
        """Run one cell (docs/code.md). `env` (the sandbox's), `cwd` and `show_saved_images` apply only if this
        call starts the session; `cell_env` only to this cell; `stdin` only for compiled programs. Of each stream
        the result keeps `max_output` bytes (head and tail; None: 16 MiB, as a command); the callbacks get every
        byte."""
        args: dict[str, Any] = {"code": code, "language": language, "session": session, "timeout": timeout,
                                "env": env, **_context_args(cwd, show_saved_images)}
        if context is not None:
            args["context"] = context
        if cell_env:
            args["cell_env"] = dict(cell_env)
        if stdin is not None:
            args["stdin_b64"] = base64.b64encode(stdin).decode()
        async with self._op("code_run", **args) as conn:
            started = await conn.event()
            # Head and tail only: a cell that prints for an hour must not fill the server's memory.
            kept = max_output or DEFAULT_MAX_OUTPUT
            out, err = OutputBuffer(kept), OutputBuffer(kept)
            results: builtins.list[RichResult] = []
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.STDOUT:
                    out.feed(payload)
                    if on_stdout is not None:
                        await _call(on_stdout, payload)
                elif kind == protocol.STDERR:
                    err.feed(payload)
                    if on_stderr is not None:
                        await _call(on_stderr, payload)
                elif kind == protocol.EVENT:
                    ev = protocol.decode_json(payload)
                    if ev.get("event") == "result":
                        results.append(rich_result(ev))
                        if on_result is not None:
                            await _call_result(on_result, results[-1])
                    elif ev.get("event") == "done":
                        return code_result(str(started.get("session", session)),
                                           str(started.get("language", language)), ev, out, err, results)
                else:
                    raise protocol.ProtocolError(f"unexpected frame kind {kind} in a cell's output")

    async def create_code_context(self, language: str = "python", *, cwd: str | None = None,
                                  name: str | None = None, env: dict[str, str] | None = None,
                                  show_saved_images: bool = False) -> CodeSession:
        ev = await self._simple("code_context_create", language=language, context=name, env=env,
                                **_context_args(cwd, show_saved_images))
        return code_session(ev["context"])

    async def code_contexts(self, *, cwd: str | None = None, env: dict[str, str] | None = None,
                            show_saved_images: bool = False) -> builtins.list[CodeSession]:
        ev = await self._simple("code_contexts", env=env, **_context_args(cwd, show_saved_images))
        return [code_session(c) for c in ev["contexts"]]

    async def code_sessions(self) -> builtins.list[CodeSession]:
        ev = await self._simple("code_list")
        return [code_session(s) for s in ev["sessions"]]

    async def interrupt_code(self, session: str = "default") -> None:
        await self._simple("code_interrupt", session=session)

    async def restart_code(self, session: str = "default", *, env: dict[str, str] | None = None) -> None:
        await self._simple("code_restart", session=session, env=env)

    async def close_code(self, session: str = "default") -> None:
        await self._simple("code_close", session=session)

    # -- files -----------------------------------------------------------------------------------

    async def read_file(self, path: str, *, roots: Roots = None) -> bytes:
        # A list joined once: a growing bytearray, then bytes() of it, copies (and page-faults) twice as much.
        return b"".join([chunk async for chunk in self.iter_file(path, roots=roots)])

    async def iter_file(self, path: str, *, roots: Roots = None) -> AsyncIterator[bytes]:
        async with self._op("read", path=path, roots=roots) as conn:
            await conn.event()  # {"event": "file", "size": ...}: the size when the read began
            received = 0
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.DATA_END:
                    break
                received += len(payload)
                yield payload
            done = await conn.event()
            if received != done["size"]:
                raise AgentError(f"download of {path} lost bytes: got {received} of {done['size']}")

    async def write_file(self, path: str, data: Source, *, mode: int = 0o644, roots: Roots = None,
                         in_place: bool = False, metadata: dict[str, str] | None = None) -> int:
        """Write `data` to `path`: into a temporary file renamed over it at the end, or (`in_place`) into the
        file itself, as E2B's envd does. `metadata` replaces the file's user.e2b.* attributes (None: none)."""
        args: dict[str, Any] = {"path": path, "mode": mode, "roots": roots}
        if in_place:
            args["in_place"] = True
        if metadata is not None:
            args["metadata"] = metadata
        async with self._op("write", **args) as conn:
            _widen_send_buffer(conn)
            await conn.event()  # ready
            sent = await _send_data(conn, data)
            done = await conn.event()
            if done["size"] != sent:
                raise AgentError(f"upload of {path} lost bytes: agent wrote {done['size']} of {sent}")
            return sent

    async def list(self, path: str, *, roots: Roots = None, depth: int = 1) -> builtins.list[Entry]:
        """The entries `depth` levels below `path`, depth first in name order; they come in batches."""
        entries: builtins.list[Entry] = []
        async with self._op("list", path=path, roots=roots, depth=depth) as conn:
            while True:
                ev = await conn.event()
                entries += [_entry(e) for e in ev.get("entries", ())]  # an agent of before batches sends them here
                if ev.get("event") == "done":
                    return entries

    async def stat(self, path: str, *, roots: Roots = None) -> Entry:
        ev = await self._simple("stat", path=path, roots=roots)
        return _entry(ev["entry"])

    async def exists(self, path: str, *, roots: Roots = None) -> bool:
        ev = await self._simple("exists", path=path, roots=roots)
        return bool(ev["exists"])

    async def make_dir(self, path: str, *, parents: bool = True, roots: Roots = None) -> bool:
        ev = await self._simple("mkdir", path=path, parents=parents, roots=roots)
        return bool(ev["created"])

    async def remove(self, path: str, *, recursive: bool = True, roots: Roots = None) -> None:
        await self._simple("remove", path=path, recursive=recursive, roots=roots)

    async def rename(self, src: str, dst: str, *, overwrite: bool = False, roots: Roots = None,
                     parents: bool = False) -> Entry:
        """Move `src` to `dst` (`parents`: making dst's missing parents first); the entry now at `dst`."""
        ev = await self._simple("rename", src=src, dst=dst, overwrite=overwrite, roots=roots, parents=parents)
        if "entry" not in ev:  # an agent started before renames answered with the entry
            return await self.stat(dst, roots=roots)
        return _entry(ev["entry"])

    # -- watching directories (docs: corral/agent/watch.py) -----------------------------------------------

    async def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                    roots: Roots = None) -> WatchStream:
        """Events in the directory `path` as they happen, until the stream is closed. A refusal (not found, not a
        directory, outside the roots, too many watches) raises here, before the stream is returned."""
        cm = self._op("watch", path=path, recursive=recursive, include_entry=include_entry, roots=roots)
        conn = await cm.__aenter__()
        try:
            await conn.event()  # {"event": "started"}: the kernel watches the directory from here on
        except BaseException as exc:
            await cm.__aexit__(type(exc), exc, exc.__traceback__)  # maps a foreign error, closes the connection
            raise
        return WatchStream(conn, cm)

    async def create_watcher(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                             owner: str = "", roots: Roots = None) -> str:
        """A watcher kept by the agent, to poll with `watcher_events`; its id. Only `owner` may use it."""
        ev = await self._simple("watcher_create", path=path, recursive=recursive, include_entry=include_entry,
                                owner=owner, roots=roots)
        return str(ev["id"])

    async def watcher_events(self, watcher_id: str, *, owner: str = "") -> builtins.list[WatchEvent]:
        """The events since the last poll, including those of every change that finished before this call."""
        ev = await self._simple("watcher_events", id=watcher_id, owner=owner)
        return [_watch_event(e) for e in ev["events"]]

    async def remove_watcher(self, watcher_id: str, *, owner: str = "") -> None:
        await self._simple("watcher_remove", id=watcher_id, owner=owner)

    async def download_tar(self, path: str, *, roots: Roots = None,
                           contents: bool = False) -> AsyncIterator[bytes]:
        """A tar of `path`; with `contents`, of what the directory holds (entries named relative to it)."""
        extra = {"contents": True} if contents else {}
        async with self._op("tar_get", path=path, roots=roots, **extra) as conn:
            await conn.event()
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.DATA_END:
                    break
                yield payload
            await conn.event()

    async def upload_tar(self, path: str, data: Source, *, roots: Roots = None, owners: bool = False) -> int:
        """Unpack the tar `data` into the directory `path`; the number of entries. `owners`: entries keep the
        owners the archive names (a client acting as root only: a /tmp saved across a pause to disk)."""
        extra = {"owners": True} if owners else {}
        async with self._op("tar_put", path=path, roots=roots, **extra) as conn:
            _widen_send_buffer(conn)
            await conn.event()
            await _send_data(conn, data)
            done = await conn.event()
            return int(done["entries"])


class PtySession:
    """An interactive terminal: raw bytes both ways, resize, and the exit result at the end."""

    def __init__(self, conn: _Conn, cm: contextlib.AbstractAsyncContextManager[_Conn], pid_id: str,
                 pid: int) -> None:
        self._conn = conn
        self._cm = cm
        self.id = pid_id
        self.pid = pid
        self.result: ExecResult | None = None

    async def write(self, data: bytes) -> None:
        await self._conn.send(protocol.STDIN, data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._conn.send_json(protocol.CONTROL, {"resize": [rows, cols]})

    async def kill(self) -> None:
        await self._conn.send_json(protocol.CONTROL, {"kill": True})

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Terminal output until the process ends; then `result` is set.

        Past the output cap (16 MiB by default) the live stream stops and the kept tail arrives at the end.
        """
        while True:
            kind, payload = await self._conn.recv()
            if kind in (protocol.STDOUT, protocol.STDERR):
                yield payload
                continue
            ev = protocol.decode_json(payload)
            if ev.get("event") == "exit":
                self.result = _result(ev, b"", b"", None, None)
                return

    async def close(self) -> None:
        await self._cm.__aexit__(None, None, None)


class WatchStream:
    """A directory watch begun in the agent: its events, until `aclose()` (which ends the watch in the agent).

    ```python
    async with await agent.watch("/workspace", recursive=True) as events:
        async for event in events:
            ...
    ```
    """

    def __init__(self, conn: _Conn, cm: contextlib.AbstractAsyncContextManager[_Conn]) -> None:
        self._conn = conn
        self._cm = cm
        self._closed = False

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            return _watch_event(await self._conn.event())
        except BaseException as exc:
            await self._end(exc)
            raise

    async def aclose(self) -> None:
        await self._end(None)

    async def _end(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        # With the error, so that `_op` maps a foreign one (EOF: the sandbox went away) to `AgentError`.
        await self._cm.__aexit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)

    async def __aenter__(self) -> WatchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _collect(conn: _Conn, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                   *, allow_running: bool = False) -> ExecResult | None:
    out, err = OutputCollector(), OutputCollector()
    tail_mode = {"stdout": False, "stderr": False}
    while True:
        kind, payload = await conn.recv()
        if kind == protocol.STDOUT:
            out.data += payload
            if on_stdout is not None and not tail_mode["stdout"]:
                await _call(on_stdout, payload)
        elif kind == protocol.STDERR:
            err.data += payload
            if on_stderr is not None and not tail_mode["stderr"]:
                await _call(on_stderr, payload)
        elif kind == protocol.EVENT:
            ev = protocol.decode_json(payload)
            if ev.get("event") == "tail":
                stream = str(ev["stream"])
                (out if stream == "stdout" else err).mark_tail(int(ev["omitted"]))
                tail_mode[stream] = bool(ev["omitted"])
            elif ev.get("event") == "exit":
                return _result(ev, bytes(out.data), bytes(err.data), out.cut, err.cut)
            elif ev.get("event") == "running" and allow_running:
                return None
        else:
            raise protocol.ProtocolError(f"unexpected frame kind {kind} in command output")


async def _follow(conn: _Conn, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                  limit: int) -> ExecResult:
    """A followed process's frames until its exit: every byte to the callbacks (also past a `tail` event, which
    marks bytes the agent no longer had), and a copy bounded by the process's `limit` into the result."""
    kept = {protocol.STDOUT: FollowedOutput(limit), protocol.STDERR: FollowedOutput(limit)}
    callbacks = {protocol.STDOUT: on_stdout, protocol.STDERR: on_stderr}
    while True:
        kind, payload = await conn.recv()
        if kind in kept:
            kept[kind].feed(payload)
            if (callback := callbacks[kind]) is not None:
                await _call(callback, payload)
        elif kind == protocol.EVENT:
            ev = protocol.decode_json(payload)
            if ev.get("event") == "tail" and ev.get("omitted"):
                kept[protocol.STDOUT if ev.get("stream") == "stdout" else protocol.STDERR].gap()
            elif ev.get("event") == "exit":
                (out, out_cut), (err, err_cut) = kept[protocol.STDOUT].kept(), kept[protocol.STDERR].kept()
                return _result(ev, out, err, out_cut, err_cut)
        else:
            raise protocol.ProtocolError(f"unexpected frame kind {kind} in a followed process's output")


async def _call_start(cb: StartCallback, started: dict[str, Any]) -> None:
    res = cb(str(started["id"]), int(started["pid"]))
    if res is not None:
        await res


def _stdin_eof(options: ExecOptions) -> bool:
    """Whether a background process's stdin closes once `options.stdin` is written (a terminal's never does)."""
    return not options.keep_stdin and options.pty is None


def _optional(**fields: Any) -> dict[str, Any]:
    """Request fields worth sending: older requests stay byte-for-byte what they were."""
    return {key: value for key, value in fields.items() if value is not None}


async def _call(cb: OutputCallback, data: bytes) -> None:
    res = cb(data)
    if res is not None:
        await res


async def _call_result(cb: ResultCallback, result: RichResult) -> None:
    res = cb(result)
    if res is not None:
        await res


def _result(ev: dict[str, Any], out: bytes, err: bytes, out_cut: int | None, err_cut: int | None) -> ExecResult:
    return ExecResult(
        exit_code=ev.get("exit_code"),
        stdout_bytes=out,
        stderr_bytes=err,
        signal=ev.get("signal"),
        duration=float(ev.get("duration") or 0.0),
        timed_out=bool(ev.get("timed_out")),
        killed=bool(ev.get("killed")),
        truncated=bool(ev.get("truncated")),
        stdout_size=int(ev.get("stdout_size") or 0),
        stderr_size=int(ev.get("stderr_size") or 0),
        stdout_cut=out_cut,
        stderr_cut=err_cut,
        pid=int(ev.get("pid") or 0),
        id=str(ev.get("id") or ""),
        reclaimed=reclaimed_from_wire(ev.get("reclaimed")),
    )


async def _feed_stdin(conn: _Conn, stdin: Source) -> None:
    try:
        async for chunk in _chunks(stdin):
            await conn.send(protocol.STDIN, chunk)
        await conn.send(protocol.STDIN_EOF)
    except OSError:
        pass  # the command exited without reading all of its stdin; its result says what happened


def _widen_send_buffer(conn: _Conn) -> None:
    """Let an upload keep a whole frame in flight to the agent over a Unix socket.

    With the default buffer (~200 KiB, less than one 256 KiB chunk of a request body) host and agent take turns:
    the host waits while the agent writes to disk, then the agent waits for the host (measured on this hop alone:
    ~560 MB/s, ~950 with this). Forced past `net.core.wmem_max` when we may (root); TCP tunes its own buffers.
    """
    sock = conn.writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _UPLOAD_SEND_BUFFER)
            return


async def _send_data(conn: _Conn, data: Source) -> int:
    sent = 0
    async for chunk in _chunks(data):
        await conn.send(protocol.DATA, chunk, bounded=True)
        sent += len(chunk)
    await conn.send(protocol.DATA_END, bounded=True)
    return sent


async def _chunks(data: Source) -> AsyncIterator[bytes]:
    """Any supported source as chunks of at most one frame."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for i in range(0, len(view), protocol.CHUNK):
            yield bytes(view[i : i + protocol.CHUNK])
        return
    if hasattr(data, "read"):
        while chunk := data.read(protocol.CHUNK):
            yield bytes(chunk)
        return
    if isinstance(data, AsyncIterable):
        async for piece in data:
            for i in range(0, len(piece), protocol.CHUNK):
                yield bytes(piece[i : i + protocol.CHUNK])
        return
    for piece in data:
        for i in range(0, len(piece), protocol.CHUNK):
            yield bytes(piece[i : i + protocol.CHUNK])


async def _sock_read_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = protocol.parse_header(await _sock_read_exactly(sock, protocol.HEADER.size))
    return kind, await _sock_read_exactly(sock, length) if length else b""


async def _sock_read_exactly(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from a non-blocking socket, never more; `IncompleteReadError` at an early EOF."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    return bytes(buf)


def _entry(e: dict[str, Any]) -> Entry:
    # Called once per entry of a listing (tens of thousands): no more work than the fields need.
    metadata = e.get("metadata")
    return Entry(name=e["name"], path=e["path"], type=e["type"], size=int(e["size"]), mode=int(e["mode"]),
                 mtime=float(e["mtime"]), target=e.get("target"), owner=e.get("owner", ""),
                 group=e.get("group", ""), permissions=e.get("permissions", ""),
                 metadata={str(k): str(v) for k, v in metadata.items()} if metadata else {},
                 resolved=e.get("resolved"), target_type=e.get("target_type"))


_WATCH_EVENT_TYPES = frozenset({"create", "write", "chmod", "remove", "rename", "overflow"})


def _watch_event(e: dict[str, Any]) -> WatchEvent:
    kind = e.get("type")
    if kind not in _WATCH_EVENT_TYPES:
        raise protocol.ProtocolError(f"unknown watch event type {kind!r}")
    found = e.get("entry")
    return WatchEvent(type=kind, name=str(e.get("name", "")), entry=_entry(found) if found else None)


def _process_info(p: dict[str, Any]) -> ProcessInfo:
    exit_ = p.get("exit") or {}
    return ProcessInfo(id=str(p["id"]), pid=int(p["pid"]), argv=list(p["argv"]), running=bool(p["running"]),
                       pty=bool(p.get("pty")), started_at=float(p.get("started_at") or 0),
                       exit_code=exit_.get("exit_code"), tag=p.get("tag"), cwd=p.get("cwd"),
                       env=dict(p.get("env") or {}))


def _context_args(cwd: str | None, show_saved_images: bool) -> dict[str, Any]:
    """How a context starts, for the ops that may make one: only what differs from the agent's defaults."""
    return {**({} if cwd is None else {"cwd": cwd}), **({"show_saved_images": True} if show_saved_images else {})}
