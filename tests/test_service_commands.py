"""The command services (corral.service: Commands, Processes, Pty, Code) over a small fake engine and a real
ControlStore: each operation is authorized (another tenant's sandbox is unknown; an auditor may not run anything),
calls the engine, and leaves exactly one audit record, also when it fails, is cancelled or is never run."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from corral import AgentError, InvalidRequestError, NotFoundError, PermissionDeniedError
from corral.control import AuditEntry, ControlStore, Principal, Role
from corral.engine import (
    CodeError,
    CodeResult,
    CodeSession,
    Engine,
    ExecOptions,
    ExecResult,
    ProcessInfo,
    RichResult,
    SandboxSpec,
)
from corral.service import Cell, Command, PtyRequest, Service

pytestmark = pytest.mark.anyio

BOUND = 5.0  # seconds any wait here may take: a regression fails, it does not hang
Output = Callable[[bytes], Awaitable[None]]


def result(**fields: Any) -> ExecResult:
    return ExecResult(**{"exit_code": 3, "stdout_bytes": b"out", "stderr_bytes": b"err", "pid": 42, **fields})


async def _emit(script: list[tuple[str, bytes]], on_stdout: Output | None, on_stderr: Output | None) -> None:
    for stream, data in script:
        callback = on_stdout if stream == "stdout" else on_stderr
        if callback is not None:
            await callback(data)


@dataclass
class FakeProcesses:
    """The engine's per-sandbox `processes`: one known process, `p-1`."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    infos: dict[str, ProcessInfo] = field(default_factory=lambda: {
        "p-1": ProcessInfo(id="p-1", pid=42, argv=["sleep", "9"], running=True)})
    output: list[tuple[str, bytes]] = field(default_factory=lambda: [("stdout", b"so far"), ("stderr", b"e")])
    result: ExecResult | None = field(default_factory=result)
    hang: bool = False  # attach and wait block until cancelled (or their timeout)

    async def launch(self, options: ExecOptions) -> ProcessInfo:
        self.calls.append(("launch", options))
        info = ProcessInfo(id="p-2", pid=43, argv=["/bin/bash", "-lc", str(options.cmd)], running=True)
        self.infos[info.id] = info
        return info

    async def list(self) -> list[ProcessInfo]:
        return list(self.infos.values())

    async def get(self, process_id: str) -> ProcessInfo:
        if process_id not in self.infos:
            raise NotFoundError(f"no process with id {process_id!r} in this sandbox")
        return self.infos[process_id]

    async def send_stdin(self, process_id: str, data: bytes, *, eof: bool = False) -> None:
        self.calls.append(("send_stdin", process_id, data, eof))

    async def kill(self, process_id: str, signal: int | None = None) -> None:
        self.calls.append(("kill", process_id, signal))

    async def wait(self, process_id: str, timeout: float | None = None) -> ExecResult | None:
        return None if self.hang else self.result

    async def attach(self, process_id: str, on_stdout: Output | None = None,
                     on_stderr: Output | None = None, *, replay: bool = True,
                     on_start: Callable[[str, int], Awaitable[None]] | None = None) -> ExecResult:
        await _emit(self.output, on_stdout, on_stderr)
        if self.hang:
            await asyncio.sleep(3600)
        assert self.result is not None
        return self.result


@dataclass
class FakeTerminal:
    """An engine PtySession: records keystrokes and controls, plays `output`, then sets `result`."""

    id: str = "p-9"
    pid: int = 99
    output: list[bytes] = field(default_factory=lambda: [b"$ ", b"bye\r\n"])
    exit: ExecResult = field(default_factory=lambda: result(exit_code=4, duration=0.5))
    result: ExecResult | None = None
    fail: BaseException | None = None  # raised by write/resize/kill and the output
    got: list[tuple[Any, ...]] = field(default_factory=list)
    closed: bool = False

    async def _do(self, *call: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.got.append(call)

    async def write(self, data: bytes) -> None:
        await self._do("write", data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._do("resize", rows, cols)

    async def kill(self) -> None:
        await self._do("kill")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.output:
            if self.fail is not None:
                raise self.fail
            yield chunk
        self.result = self.exit

    async def close(self) -> None:
        self.closed = True


class FakeEngine:
    """Just the engine methods the command services call; `live` are the sandboxes it runs."""

    def __init__(self, live: set[str]) -> None:
        self.live = live
        self.calls: list[tuple[str, Any]] = []
        self.exec_result = result()
        self.code_result = CodeResult(session="default", language="python", stdout_bytes=b"2\n",
                                      stderr_bytes=b"", results=(RichResult(True, {"text/plain": "2"}),))
        self.script: list[tuple[str, bytes]] = [("stdout", b"a"), ("stderr", b"b"), ("stdout", b"c")]
        self.fail: Exception | None = None  # raised after the script
        self.hang = False  # block after the script until cancelled
        self.processes = FakeProcesses()
        self.terminal = FakeTerminal()
        self.sessions = {"default": CodeSession("default", "python", 7, 1e9)}

    def info(self, sandbox_id: str) -> None:
        if sandbox_id not in self.live:
            raise NotFoundError(f"no sandbox {sandbox_id!r}")

    backend = None  # what the service's composition reads (Info, Templates); the command services never do
    templates = None
    home = Path("/nonexistent")  # the eval reports' home: never read here

    def get(self, sandbox_id: str) -> SimpleNamespace:
        """The sandbox's session: this engine's operations with the sandbox's id bound, as the real one has them."""
        self.info(sandbox_id)
        ops = ("run", "run_code", "code_sessions", "interrupt_code", "restart_code", "close_code",
               "create_code_context", "code_contexts")
        bound = {op: functools.partial(getattr(self, op), sandbox_id) for op in ops}
        return SimpleNamespace(processes=self.processes, pty=self._pty, **bound)

    async def _pty(self, cmd: str | list[str], *, rows: int, cols: int, cwd: str | None,
                   env: dict[str, str] | None, timeout: float | None, user: str | None = None) -> FakeTerminal:
        self.calls.append(("pty", (cmd, rows, cols, cwd, env, timeout)))
        return self.terminal

    async def _script(self, on_stdout: Output | None, on_stderr: Output | None) -> None:
        await _emit(self.script, on_stdout, on_stderr)
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.sleep(3600)

    async def run(self, sandbox_id: str, options: ExecOptions, *, on_stdout: Output | None = None,
                  on_stderr: Output | None = None, **given: Any) -> ExecResult:  # on_start: not played here
        self.info(sandbox_id)
        o = options
        self.calls.append(("exec", (o.cmd, o.cwd, o.env or None, o.stdin, o.timeout, o.max_output)))
        await self._script(on_stdout, on_stderr)
        return self.exec_result

    async def run_code(self, sandbox_id: str, code: str, *, language: str, timeout: float | None,
                       on_stdout: Output | None = None, on_stderr: Output | None = None,
                       on_result: Callable[[RichResult], Awaitable[None]] | None = None,
                       **given: Any) -> CodeResult:
        self.info(sandbox_id)
        self.calls.append(("run_code", (code, language, timeout, given)))
        await self._script(on_stdout, on_stderr)
        if on_result is not None:
            for rich in self.code_result.results:
                await on_result(rich)
        return self.code_result

    async def code_sessions(self, sandbox_id: str) -> list[CodeSession]:
        return list(self.sessions.values())

    def _session(self, op: str, sandbox_id: str, session: str) -> None:
        if session not in self.sessions:
            raise NotFoundError(f"no code session {session!r} in this sandbox")
        self.calls.append((op, session))

    async def interrupt_code(self, sandbox_id: str, session: str) -> None:
        self._session("interrupt_code", sandbox_id, session)

    async def restart_code(self, sandbox_id: str, session: str) -> None:
        self._session("restart_code", sandbox_id, session)

    async def close_code(self, sandbox_id: str, session: str) -> None:
        self._session("close_code", sandbox_id, session)

    async def create_code_context(self, sandbox_id: str, language: str, *, cwd: str | None,
                                  show_saved_images: bool) -> CodeSession:
        self.info(sandbox_id)
        self.calls.append(("create_code_context", (language, cwd, show_saved_images)))
        context = CodeSession("c-1", language, 0, 0, cwd=cwd or "/workspace")
        self.sessions[context.name] = context
        return context

    async def code_contexts(self, sandbox_id: str, *, cwd: str | None, show_saved_images: bool) -> list[CodeSession]:
        self.calls.append(("code_contexts", (cwd, show_saved_images)))
        return list(self.sessions.values())


@dataclass
class World:
    service: Service
    store: ControlStore
    engine: FakeEngine
    dev: Principal  # tenant a's developer
    auditor: Principal  # tenant a's auditor
    other: Principal  # tenant b's developer
    sandbox: str  # tenant a's, running

    async def records(self, action: str | None = None) -> list[AuditEntry]:
        return await self.store.audit.query(action=action)

    async def record(self, action: str) -> AuditEntry:
        [only] = await self.records(action)
        return only


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with ControlStore(home=tmp_path) as store:
        tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
        dev, auditor, other = [await store.authenticate((await store.create_key(tenants[t], role, f"{t}-{role}")).key)
                               for t, role in (("a", Role.DEVELOPER), ("a", Role.AUDITOR), ("b", Role.DEVELOPER))]
        sandbox = (await store.reserve_sandbox(dev, SandboxSpec())).id
        await store.mark_running(sandbox)
        engine = FakeEngine({sandbox})
        service = Service(cast(Engine, engine), store)  # not started: the store is, and the engine is a fake
        yield World(service, store, engine, dev, auditor, other, sandbox)


def streamed_into(got: list[tuple[str, bytes]]) -> tuple[Output, Output]:
    async def out(data: bytes) -> None:
        got.append(("stdout", data))

    async def err(data: bytes) -> None:
        got.append(("stderr", data))

    return out, err


async def started(task: asyncio.Task[Any], seen: list[Any]) -> None:
    """Wait until `task` has produced something into `seen` (it is then blocked where the test wants it)."""
    async with asyncio.timeout(BOUND):
        while not seen:
            await asyncio.sleep(0.01)
    assert not task.done()


COMMAND = Command("echo 'verbatim  $HOME'", cwd="/tmp", env={"SECRET": "hunter2"}, timeout=5, max_output=100,
                  stdin=b"in")
EXEC_PARAMS = {"cmd": "echo 'verbatim  $HOME'", "cwd": "/tmp", "env_names": ["SECRET"], "timeout": 5,
               "max_output": 100, "stdin_size": 2}
EXIT_OUTCOME = {"exit_code": 3, "signal": None, "timed_out": False, "oom_killed": False, "truncated": False}


# -- commands -------------------------------------------------------------------------------------------------------


async def test_run_calls_the_engine_and_audits_the_command_verbatim(world: World) -> None:
    got = await world.service.commands.run(world.dev, world.sandbox, COMMAND)
    assert got == world.engine.exec_result
    assert world.engine.calls == [("exec", ("echo 'verbatim  $HOME'", "/tmp", {"SECRET": "hunter2"}, b"in", 5, 100))]
    record = await world.record("sandbox.exec")
    assert (record.target, record.tenant_id, record.key_id) == (world.sandbox, world.dev.tenant_id, world.dev.key_id)
    assert record.params == {**EXEC_PARAMS, "stream": False}
    assert record.outcome == {"status": 200, **EXIT_OUTCOME}
    assert "hunter2" not in record.to_json()


async def test_another_tenants_sandbox_is_unknown_and_the_attempt_audited(world: World) -> None:
    with pytest.raises(NotFoundError):
        await world.service.commands.run(world.other, world.sandbox, COMMAND)
    with pytest.raises(NotFoundError):
        await world.service.commands.stream(world.other, world.sandbox, COMMAND)
    assert world.engine.calls == []
    records = await world.records("sandbox.exec")
    assert [(r.tenant_id, r.params["stream"], r.outcome) for r in records] == [
        (world.other.tenant_id, stream, {"status": 404, "error": "not_found"}) for stream in (False, True)]


async def test_an_auditor_may_not_run_commands(world: World) -> None:
    with pytest.raises(PermissionDeniedError):
        await world.service.commands.run(world.auditor, world.sandbox, COMMAND)
    assert world.engine.calls == []
    assert (await world.record("sandbox.exec")).outcome == {"status": 403, "error": "permission_denied"}


async def test_an_engine_failure_is_audited_with_its_status(world: World) -> None:
    world.engine.fail = AgentError("the agent went away")
    with pytest.raises(AgentError):
        await world.service.commands.run(world.dev, world.sandbox, COMMAND)
    assert (await world.record("sandbox.exec")).outcome == {"status": 502, "error": "agent_error"}


async def test_a_stream_hands_output_over_as_produced_and_audits_when_it_ends(world: World) -> None:
    stream = await world.service.commands.stream(world.dev, world.sandbox, COMMAND)
    assert world.engine.calls == [] and await world.records() == []  # begun, not run
    got: list[tuple[str, bytes]] = []
    assert await stream.run(*streamed_into(got)) == world.engine.exec_result
    assert got == world.engine.script
    record = await world.record("sandbox.exec")
    assert record.params == {**EXEC_PARAMS, "stream": True}
    assert record.outcome == {"status": 200, **EXIT_OUTCOME}
    await stream.close()  # after the end: nothing more
    assert len(await world.records()) == 1
    with pytest.raises(RuntimeError):
        await stream.run()


async def test_a_sandbox_the_engine_lost_is_refused_before_the_stream(world: World) -> None:
    world.engine.live.clear()
    with pytest.raises(NotFoundError):
        await world.service.commands.stream(world.dev, world.sandbox, COMMAND)
    assert (await world.record("sandbox.exec")).outcome == {"status": 404, "error": "not_found"}


@pytest.mark.parametrize(("failure", "code"), [(AgentError("lost it"), "agent_error"),
                                               (RuntimeError("a bug"), "server_error")])
async def test_a_stream_that_fails_midway_records_the_error_under_its_200(world: World, failure: Exception,
                                                                         code: str) -> None:
    world.engine.fail = failure
    stream = await world.service.commands.stream(world.dev, world.sandbox, COMMAND)
    got: list[tuple[str, bytes]] = []
    with pytest.raises(type(failure)):
        await stream.run(*streamed_into(got))
    assert got == world.engine.script  # what came before the failure was handed over
    assert (await world.record("sandbox.exec")).outcome == {"status": 200, "error": code}


async def test_a_cancelled_stream_is_recorded_as_disconnected(world: World) -> None:
    world.engine.hang = True
    stream = await world.service.commands.stream(world.dev, world.sandbox, COMMAND)
    got: list[tuple[str, bytes]] = []
    task = asyncio.create_task(stream.run(*streamed_into(got)))
    await started(task, got)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.close()
    assert (await world.record("sandbox.exec")).outcome == {"status": 200, "disconnected": True}


async def test_a_stream_closed_before_it_ran_is_recorded_as_disconnected_once(world: World) -> None:
    stream = await world.service.commands.stream(world.dev, world.sandbox, COMMAND)
    await stream.close()
    await stream.close()
    assert (await world.record("sandbox.exec")).outcome == {"status": 200, "disconnected": True}
    with pytest.raises(RuntimeError):  # closed: it may not run any more
        await stream.run()
    assert world.engine.calls == []


# -- background processes ---------------------------------------------------------------------------------------------


async def test_start_audits_the_command_and_feeds_initial_stdin(world: World) -> None:
    info = await world.service.processes.start(world.dev, world.sandbox, COMMAND)
    assert info.id == "p-2" and info.running and info.started_at > 0
    # The command as given: its initial stdin (written by the engine, then EOF), the stdin not kept open.
    assert world.engine.processes.calls == [("launch", COMMAND)]
    record = await world.record("process.start")
    assert record.params == {**EXEC_PARAMS, "stdin": False}
    assert record.outcome == {"status": 201, "process": "p-2", "pid": 43}


async def test_start_may_keep_stdin_open(world: World) -> None:
    await world.service.processes.start(world.dev, world.sandbox, Command(["cat"]), keep_stdin=True)
    assert world.engine.processes.calls == [("launch", Command(["cat"], keep_stdin=True))]
    assert (await world.record("process.start")).params["stdin"] is True


async def test_process_operations_are_audited(world: World) -> None:
    svc, dev, sb = world.service.processes, world.dev, world.sandbox
    assert [p.id for p in await svc.list(dev, sb)] == ["p-1"]
    assert (await svc.get(dev, sb, "p-1")).pid == 42
    assert await svc.wait(dev, sb, "p-1", 1) == world.engine.processes.result
    await svc.kill(dev, sb, "p-1", "TERM")
    await svc.kill(dev, sb, "p-1")
    assert world.engine.processes.calls == [("kill", "p-1", 15), ("kill", "p-1", None)]
    assert (await world.record("process.list")).outcome == {"status": 200, "count": 1}
    assert (await world.record("process.get")).params == {"process": "p-1"}
    wait = await world.record("process.wait")
    assert wait.params == {"process": "p-1", "timeout": 1} and wait.outcome == {"status": 200, **EXIT_OUTCOME}
    kills = await world.records("process.kill")
    assert [(k.params, k.outcome) for k in kills] == [({"process": "p-1", "signal": "TERM"}, {"status": 204}),
                                                      ({"process": "p-1", "signal": None}, {"status": 204})]


async def test_a_wait_that_times_out_is_running(world: World) -> None:
    world.engine.processes.hang = True
    assert await world.service.processes.wait(world.dev, world.sandbox, "p-1", 0.1) is None
    assert (await world.record("process.wait")).outcome == {"status": 200, "running": True}


async def test_unknown_processes_and_signals_are_refused_and_audited(world: World) -> None:
    svc, dev, sb = world.service.processes, world.dev, world.sandbox
    with pytest.raises(NotFoundError):
        await svc.get(dev, sb, "p-404")
    with pytest.raises(InvalidRequestError, match="SIGNOPE"):
        await svc.kill(dev, sb, "p-1", "SIGNOPE")
    assert world.engine.processes.calls == []
    assert (await world.record("process.get")).outcome == {"status": 404, "error": "not_found"}
    assert (await world.record("process.kill")).outcome == {"status": 400, "error": "invalid_request"}


async def test_another_tenants_processes_are_unknown(world: World) -> None:
    for call in (world.service.processes.list(world.other, world.sandbox),
                 world.service.processes.kill(world.other, world.sandbox, "p-1"),
                 world.service.processes.attach(world.other, world.sandbox, "p-1")):
        with pytest.raises(NotFoundError):
            await call
    assert world.engine.processes.calls == []
    assert {r.outcome["status"] for r in await world.records()} == {404}


async def test_stdin_arrives_in_batches_and_is_audited_with_its_size(world: World) -> None:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"x" * 600_000

    sent = await world.service.processes.send_stdin(world.dev, world.sandbox, "p-1", body(), eof=True)
    assert sent == 1_800_000
    writes = [(len(c[2]), c[3]) for c in world.engine.processes.calls]
    assert writes == [(1_200_000, False), (600_000, True)]  # gathered to at least 1 MiB, EOF with the last
    assert (await world.record("process.stdin")).params == {"process": "p-1", "eof": True, "size": 1_800_000}
    assert await world.service.processes.send_stdin(world.dev, world.sandbox, "p-1", b"tail") == 4


async def test_attach_replays_follows_and_audits(world: World) -> None:
    stream = await world.service.processes.attach(world.dev, world.sandbox, "p-1")
    got: list[tuple[str, bytes]] = []
    assert await stream.run(*streamed_into(got)) == world.engine.processes.result
    assert got == world.engine.processes.output
    record = await world.record("process.attach")
    assert record.params == {"process": "p-1", "timeout": None}
    assert record.outcome == {"status": 200, **EXIT_OUTCOME}


async def test_an_attach_to_an_unknown_process_is_refused_before_the_stream(world: World) -> None:
    with pytest.raises(NotFoundError):
        await world.service.processes.attach(world.dev, world.sandbox, "p-404")
    assert (await world.record("process.attach")).outcome == {"status": 404, "error": "not_found"}


async def test_an_attach_past_its_timeout_ends_running(world: World) -> None:
    world.engine.processes.hang = True
    stream = await world.service.processes.attach(world.dev, world.sandbox, "p-1", timeout=0.1)
    assert await asyncio.wait_for(stream.run(), BOUND) is None
    assert (await world.record("process.attach")).outcome == {"status": 200, "running": True}


async def test_a_cancelled_attach_only_detaches(world: World) -> None:
    world.engine.processes.hang = True
    stream = await world.service.processes.attach(world.dev, world.sandbox, "p-1")
    got: list[tuple[str, bytes]] = []
    task = asyncio.create_task(stream.run(*streamed_into(got)))
    await started(task, got)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert world.engine.processes.calls == []  # nothing was killed
    assert (await world.record("process.attach")).outcome == {"status": 200, "disconnected": True}


# -- PTY --------------------------------------------------------------------------------------------------------------


REQUEST = PtyRequest(cmd="exit 4", rows=30, cols=100, cwd="/tmp", env={"TOKEN": "s3cret"}, timeout=60)


def asked(request: PtyRequest | None, log: list[str]) -> Callable[[], Awaitable[PtyRequest | None]]:
    async def read() -> PtyRequest | None:
        log.append("asked")
        return request

    return read


async def test_a_terminal_opens_carries_bytes_and_records_its_exit(world: World) -> None:
    log: list[str] = []
    term = await world.service.pty.open(world.dev, world.sandbox, asked(REQUEST, log))
    assert term is not None and (term.id, term.pid) == ("p-9", 99)
    assert world.engine.calls == [("pty", ("exit 4", 30, 100, "/tmp", {"TOKEN": "s3cret"}, 60))]
    await term.write(b"ls\n")
    await term.resize(40, 120)
    await term.kill()
    assert [chunk async for chunk in term.output()] == [b"$ ", b"bye\r\n"]
    assert term.result is not None and term.result.exit_code == 4
    assert world.engine.terminal.got == [("write", b"ls\n"), ("resize", 40, 120), ("kill",)]
    assert await world.records() == []  # recorded when it closes
    await term.close()
    assert world.engine.terminal.closed
    record = await world.record("sandbox.pty")
    assert record.params == {"cmd": "exit 4", "rows": 30, "cols": 100, "cwd": "/tmp", "env_names": ["TOKEN"],
                             "timeout": 60}
    assert record.outcome == {"status": 200, "process": "p-9", "pid": 99, "exit_code": 4, "signal": None,
                              "timed_out": False, "killed": False, "duration": 0.5}
    assert "s3cret" not in record.to_json()


@pytest.mark.parametrize(("who", "error", "status"), [("other", NotFoundError, 404),
                                                      ("auditor", PermissionDeniedError, 403)])
async def test_a_terminal_is_refused_before_the_client_is_asked_for_it(world: World, who: str,
                                                                       error: type[Exception], status: int) -> None:
    log: list[str] = []
    with pytest.raises(error):
        await world.service.pty.open(getattr(world, who), world.sandbox, asked(REQUEST, log))
    assert log == [] and world.engine.calls == []
    assert (await world.record("sandbox.pty")).outcome["status"] == status


async def test_a_client_that_leaves_before_asking_is_recorded_as_disconnected(world: World) -> None:
    log: list[str] = []
    assert await world.service.pty.open(world.dev, world.sandbox, asked(None, log)) is None
    assert log == ["asked"] and world.engine.calls == []
    assert (await world.record("sandbox.pty")).outcome == {"status": 200, "disconnected": True}


async def test_a_bad_request_is_refused_and_audited(world: World) -> None:
    async def bad() -> PtyRequest | None:
        raise InvalidRequestError("no start frame within 30 seconds")

    with pytest.raises(InvalidRequestError):
        await world.service.pty.open(world.dev, world.sandbox, bad)
    assert (await world.record("sandbox.pty")).outcome == {"status": 400, "error": "invalid_request"}


async def test_a_lost_agent_connection_is_an_agent_error(world: World) -> None:
    world.engine.terminal.fail = ConnectionResetError("reset by peer")
    term = await world.service.pty.open(world.dev, world.sandbox, asked(REQUEST, []))
    assert term is not None
    with pytest.raises(AgentError, match="lost the terminal's connection"):
        await term.write(b"x")
    with pytest.raises(AgentError):
        await anext(term.output())
    await term.close(AgentError("lost"))
    assert world.engine.terminal.closed
    record = await world.record("sandbox.pty")
    assert record.outcome == {"status": 200, "process": "p-9", "pid": 99, "error": "agent_error"}


async def test_a_terminal_whose_client_left_is_hung_up_and_recorded(world: World) -> None:
    term = await world.service.pty.open(world.dev, world.sandbox, asked(REQUEST, []))
    assert term is not None
    await term.close(disconnected=True)
    assert world.engine.terminal.closed
    assert (await world.record("sandbox.pty")).outcome == {"status": 200, "process": "p-9", "pid": 99,
                                                           "disconnected": True}


# -- code -------------------------------------------------------------------------------------------------------------


CELL = Cell("print(1 + 1)", timeout=9)
CODE_PARAMS = {"code": "print(1 + 1)", "language": "python", "session": None, "timeout": 9}
CODE_OUTCOME = {"timed_out": False, "oom_killed": False, "session_restarted": False}


async def test_a_cell_runs_in_the_languages_default_session_and_is_audited(world: World) -> None:
    assert await world.service.code.run(world.dev, world.sandbox, CELL) == world.engine.code_result
    assert world.engine.calls == [("run_code", ("print(1 + 1)", "python", 9, {}))]  # the engine picks the session
    record = await world.record("code.run")
    assert record.params == {**CODE_PARAMS, "stream": False}
    assert record.outcome == {"status": 200, **CODE_OUTCOME}


async def test_a_cell_that_raises_is_no_error_of_the_request(world: World) -> None:
    world.engine.code_result = CodeResult(session="s", language="python", stdout_bytes=b"", stderr_bytes=b"",
                                          error=CodeError("ZeroDivisionError", "division by zero", ""))
    cell = Cell("1/0", session="s", stdin=b"x")
    await world.service.code.run(world.dev, world.sandbox, cell)
    assert world.engine.calls == [("run_code", ("1/0", "python", None, {"session": "s", "stdin": b"x"}))]
    record = await world.record("code.run")
    assert record.params == {"code": "1/0", "language": "python", "session": "s", "timeout": None, "stdin": True,
                             "stream": False}
    assert record.outcome == {"status": 200, **CODE_OUTCOME, "exception": "ZeroDivisionError"}


async def test_a_streamed_cell_hands_over_output_and_results(world: World) -> None:
    stream = await world.service.code.stream(world.dev, world.sandbox, CELL)
    got: list[tuple[str, bytes]] = []
    results: list[RichResult] = []

    async def on_result(rich: RichResult) -> None:
        results.append(rich)

    assert await stream.run(*streamed_into(got), on_result) == world.engine.code_result
    assert got == world.engine.script and results == list(world.engine.code_result.results)
    record = await world.record("code.run")
    assert record.params == {**CODE_PARAMS, "stream": True} and record.outcome == {"status": 200, **CODE_OUTCOME}


async def test_code_is_refused_to_other_tenants_and_auditors(world: World) -> None:
    with pytest.raises(NotFoundError):
        await world.service.code.stream(world.other, world.sandbox, CELL)
    with pytest.raises(PermissionDeniedError):
        await world.service.code.run(world.auditor, world.sandbox, CELL)
    with pytest.raises(NotFoundError):
        await world.service.code.sessions(world.other, world.sandbox)
    assert world.engine.calls == []
    assert [r.outcome["status"] for r in await world.records()] == [404, 403, 404]


async def test_a_cancelled_streamed_cell_is_recorded_as_disconnected(world: World) -> None:
    world.engine.hang = True
    stream = await world.service.code.stream(world.dev, world.sandbox, CELL)
    got: list[tuple[str, bytes]] = []
    task = asyncio.create_task(stream.run(*streamed_into(got)))
    await started(task, got)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await world.record("code.run")).outcome == {"status": 200, "disconnected": True}


async def test_sessions_are_listed_interrupted_restarted_and_closed(world: World) -> None:
    code, dev, sb = world.service.code, world.dev, world.sandbox
    assert [s.name for s in await code.sessions(dev, sb)] == ["default"]
    await code.interrupt(dev, sb, "default")
    await code.restart(dev, sb, "default")
    await code.close(dev, sb, "default")
    with pytest.raises(NotFoundError):
        await code.close(dev, sb, "nope")
    assert world.engine.calls == [("interrupt_code", "default"), ("restart_code", "default"),
                                  ("close_code", "default")]
    assert (await world.record("code.sessions")).outcome == {"status": 200, "count": 1}
    for action in ("code.interrupt", "code.restart"):
        record = await world.record(action)
        assert (record.params, record.outcome) == ({"session": "default"}, {"status": 204})
    closes = await world.records("code.close")
    assert [(r.params, r.outcome) for r in closes] == [({"session": "default"}, {"status": 204}),
                                                       ({"session": "nope"}, {"status": 404, "error": "not_found"})]


async def test_a_cell_in_a_context_with_its_own_env_is_audited_without_the_values(world: World) -> None:
    cell = Cell("import os; os.environ['TOKEN']", context="c-1", env={"TOKEN": "hunter2", "A": "b"},
                cwd="/home/user", show_saved_images=True)
    await world.service.code.run(world.dev, world.sandbox, cell)
    assert world.engine.calls == [("run_code", (cell.code, "python", None, {
        "context": "c-1", "env": {"TOKEN": "hunter2", "A": "b"}, "cwd": "/home/user", "show_saved_images": True}))]
    record = await world.record("code.run")
    assert record.params == {"code": cell.code, "language": None, "session": None, "timeout": None,
                             "context": "c-1", "env": ["A", "TOKEN"], "cwd": "/home/user",
                             "show_saved_images": True, "stream": False}
    assert "hunter2" not in str(record.params)


async def test_contexts_are_made_and_listed_audited(world: World) -> None:
    code, dev, sb = world.service.code, world.dev, world.sandbox
    made = await code.create_context(dev, sb, "javascript", "/home/user", show_saved_images=True)
    assert (made.name, made.cwd) == ("c-1", "/home/user")
    assert [c.name for c in await code.contexts(dev, sb, cwd="/home/user")] == ["default", "c-1"]
    assert world.engine.calls == [("create_code_context", ("javascript", "/home/user", True)),
                                  ("code_contexts", ("/home/user", False))]
    record = await world.record("code.create_context")
    assert record.params == {"language": "javascript", "cwd": "/home/user", "show_saved_images": True}
    assert record.outcome == {"status": 200, "context": "c-1"}
    assert (await world.record("code.contexts")).outcome == {"status": 200, "count": 2}


async def test_contexts_are_refused_to_other_tenants_and_auditors(world: World) -> None:
    with pytest.raises(NotFoundError):
        await world.service.code.create_context(world.other, world.sandbox)
    with pytest.raises(PermissionDeniedError):
        await world.service.code.create_context(world.auditor, world.sandbox)
    with pytest.raises(NotFoundError):
        await world.service.code.contexts(world.other, world.sandbox)
    assert world.engine.calls == []
    assert [r.outcome["status"] for r in await world.records()] == [404, 403, 404]
