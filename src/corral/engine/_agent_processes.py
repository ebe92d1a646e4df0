"""The agent client's processes: commands in the foreground or followed (`run`), background processes (`launch`,
`ps`, `kill`, stdin, `wait`, `attach`) and terminals (`pty`, `PtySession`), with their output collected into
`ExecResult`s (docs/architecture.md, "Agent liveness", for the waits)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from .._exceptions import CorralError
from .._output import reclaimed_from_wire
from ..agent import protocol
from ._agent_calls import AgentCalls, OutputCallback, StartCallback, call_output, optional
from ._agent_connection import AgentConnection, Source, chunks
from ._exec_options import ExecOptions
from ._models import ExecResult, FollowedOutput, OutputCollector, ProcessInfo, ProcessRef, ProcessSelector


class AgentProcesses(AgentCalls):
    """What `AgentClient` does with processes in the sandbox."""

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

    async def _stdin_of(self, options: ExecOptions, conn: AgentConnection, started: dict[str, Any]) -> None:
        """A command's stdin: on its own connection (a foreground one's), or fed to the process by id."""
        assert options.stdin is not None
        if options.detached:
            await self._feed(ProcessRef(id=str(started["id"])), options.stdin, eof=_stdin_eof(options))
        else:
            await _feed_stdin(conn, options.stdin)

    async def _feed(self, ref: ProcessRef, data: Source, *, eof: bool) -> None:
        async with self._op("stdin", **ref.selector(), eof=eof) as conn:
            await conn.event()
            async for chunk in chunks(data):
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
                      **optional(cmd_env=cmd_env))
        conn = await cm.__aenter__()
        try:
            started = await conn.event()
        except BaseException:
            await cm.__aexit__(None, None, None)
            raise
        return PtySession(conn, cm, str(started["id"]), int(started["pid"]))


class PtySession:
    """An interactive terminal: raw bytes both ways, resize, and the exit result at the end."""

    def __init__(self, conn: AgentConnection, cm: contextlib.AbstractAsyncContextManager[AgentConnection], pid_id: str,
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


async def _collect(conn: AgentConnection, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                   *, allow_running: bool = False) -> ExecResult | None:
    out, err = OutputCollector(), OutputCollector()
    tail_mode = {"stdout": False, "stderr": False}
    while True:
        kind, payload = await conn.recv()
        if kind == protocol.STDOUT:
            out.data += payload
            if on_stdout is not None and not tail_mode["stdout"]:
                await call_output(on_stdout, payload)
        elif kind == protocol.STDERR:
            err.data += payload
            if on_stderr is not None and not tail_mode["stderr"]:
                await call_output(on_stderr, payload)
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


async def _follow(conn: AgentConnection, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
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
                await call_output(callback, payload)
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


async def _feed_stdin(conn: AgentConnection, stdin: Source) -> None:
    try:
        async for chunk in chunks(stdin):
            await conn.send(protocol.STDIN, chunk)
        await conn.send(protocol.STDIN_EOF)
    except OSError:
        pass  # the command exited without reading all of its stdin; its result says what happened


def _process_info(p: dict[str, Any]) -> ProcessInfo:
    exit_ = p.get("exit") or {}
    return ProcessInfo(id=str(p["id"]), pid=int(p["pid"]), argv=list(p["argv"]), running=bool(p["running"]),
                       pty=bool(p.get("pty")), started_at=float(p.get("started_at") or 0),
                       exit_code=exit_.get("exit_code"), tag=p.get("tag"), cwd=p.get("cwd"),
                       env=dict(p.get("env") or {}))
