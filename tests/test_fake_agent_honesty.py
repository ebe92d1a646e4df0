"""The fake agent (tests/fake_agent.py) and the real one answer the same exchanges alike.

Every test here runs twice, through the same engine API: on the fake engine (the fast tier) and on a real runc
sandbox (marked runc), asserting the same observable results. The fast tier's front-end tests lean on the fake
behaving as the agent does; this file is where that is checked, one exchange of each kind the fronts make:
commands (streams, exit codes, a timeout, a kill, stdin), files and their errors, code cells, a terminal, a
directory watch and a port tunnel.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest

from corral import AgentError, ConflictError, InvalidRequestError, NotFoundError
from corral.engine import Engine, SandboxSession, SandboxSpec

from .conftest import TEMPLATE, on_both_engines

pytestmark = pytest.mark.anyio

ON_BOTH = on_both_engines  # the fake engine, and (marked runc) a real one


@pytest.fixture
async def sb(front_engine: Engine) -> AsyncIterator[SandboxSession]:
    async with await front_engine.create(SandboxSpec(template=TEMPLATE)) as session:
        yield session


# -- commands ----------------------------------------------------------------------------------------------------


@ON_BOTH
async def test_a_command_streams_stdout_and_stderr_apart_and_ends_with_its_exit_code(sb: SandboxSession) -> None:
    seen: list[tuple[str, bytes]] = []

    async def out(b: bytes) -> None:
        seen.append(("out", b))

    async def err(b: bytes) -> None:
        seen.append(("err", b))

    r = await sb.exec("echo out; echo err >&2; exit 3", on_stdout=out, on_stderr=err)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.killed, r.signal) == (3, "out\n", "err\n", False, False,
                                                                                  None)
    assert b"".join(b for s, b in seen if s == "out") == b"out\n"
    assert b"".join(b for s, b in seen if s == "err") == b"err\n"
    assert (r.stdout_size, r.stderr_size, r.truncated) == (4, 4, False)


@ON_BOTH
async def test_a_failing_and_a_missing_command_exit_as_bash_says(sb: SandboxSession) -> None:
    assert (await sb.exec("false")).exit_code == 1
    missing = await sb.exec("no-such-command-here")
    assert missing.exit_code == 127
    assert "no-such-command-here: command not found" in missing.stderr


@ON_BOTH
async def test_stdin_reaches_the_command(sb: SandboxSession) -> None:
    r = await sb.exec("cat", stdin=b"line one\nline two\n")
    assert (r.exit_code, r.stdout) == (0, "line one\nline two\n")


@ON_BOTH
async def test_a_command_past_its_timeout_is_killed_and_says_so(sb: SandboxSession) -> None:
    r = await sb.exec("echo before; sleep 30", timeout=1)
    assert (r.timed_out, r.killed, r.signal, r.exit_code, r.stdout) == (True, False, 9, 137, "before\n")


@ON_BOTH
async def test_a_killed_background_process_ends_killed_by_sigkill(sb: SandboxSession) -> None:
    started = await sb.processes.start("sleep 30", tag="sleeper")
    listed = {p.tag: p for p in await sb.processes.list()}
    assert listed["sleeper"].running and listed["sleeper"].pid == started.pid
    await sb.processes.kill(started.id)
    result = await sb.processes.wait(started.id, timeout=30)
    assert result is not None
    assert (result.killed, result.timed_out, result.signal, result.exit_code) == (True, False, 9, 137)
    assert not (await sb.processes.get(started.id)).running


# -- files ---------------------------------------------------------------------------------------------------------


@ON_BOTH
async def test_files_round_trip_and_list_and_stat_alike(sb: SandboxSession) -> None:
    data = bytes(range(256)) * 5
    await sb.files.write("/workspace/d/blob.bin", data)
    assert await sb.files.read("/workspace/d/blob.bin") == data
    (entry,) = await sb.files.list("/workspace/d")
    assert (entry.name, entry.path, entry.type, entry.size) == ("blob.bin", "/workspace/d/blob.bin", "file", 1280)
    st = await sb.files.stat("/workspace/d")
    assert (st.name, st.type) == ("d", "dir")
    assert await sb.files.exists("/workspace/d/blob.bin")
    assert not await sb.files.exists("/workspace/d/nothing")
    moved = await sb.files.rename("/workspace/d/blob.bin", "/workspace/d/moved.bin")
    assert (moved.path, moved.size) == ("/workspace/d/moved.bin", 1280)
    assert (await sb.exec("cat /workspace/d/moved.bin | wc -c")).stdout.strip() == "1280"


@ON_BOTH
async def test_file_errors_are_the_same_errors(sb: SandboxSession) -> None:
    await sb.files.write("/workspace/a.txt", b"a")
    await sb.files.write("/workspace/b.txt", b"b")
    with pytest.raises(NotFoundError):
        await sb.files.stat("/workspace/missing")
    with pytest.raises(NotFoundError):
        await sb.files.read("/workspace/missing")
    with pytest.raises(NotFoundError):
        await sb.files.list("/workspace/missing")
    with pytest.raises(InvalidRequestError):
        await sb.files.read("/workspace")  # a directory
    with pytest.raises(InvalidRequestError):
        await sb.files.list("/workspace/a.txt")  # not a directory
    with pytest.raises(ConflictError):
        await sb.files.rename("/workspace/a.txt", "/workspace/b.txt")
    assert await sb.files.read("/workspace/b.txt") == b"b"  # the refused rename changed nothing


# -- code cells ----------------------------------------------------------------------------------------------------


@ON_BOTH
async def test_a_code_cell_prints_returns_keeps_state_and_reports_errors(sb: SandboxSession) -> None:
    first = await sb.run_code("x = 6 * 7\nprint('hi')\nx")
    assert (first.stdout, first.error, first.timed_out) == ("hi\n", None, False)
    assert [(r.is_main_result, r.data["text/plain"]) for r in first.results] == [(True, "42")]
    again = await sb.run_code("x + 1")
    assert [r.data["text/plain"] for r in again.results] == ["43"]
    assert again.execution_count == (first.execution_count or 0) + 1
    failed = await sb.run_code("print('before'); 1 / 0")
    assert failed.stdout == "before\n"
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("ZeroDivisionError", "division by zero")
    assert "ZeroDivisionError" in failed.error.traceback
    assert [s.name for s in await sb.code_sessions()] == ["default"]


@ON_BOTH
async def test_a_cell_past_its_timeout_is_interrupted_and_the_session_lives_on(sb: SandboxSession) -> None:
    await sb.run_code("y = 5")
    slow = await sb.run_code("while True:\n    pass", timeout=1)
    assert slow.timed_out
    assert slow.error is not None and slow.error.name == "KeyboardInterrupt"
    assert not slow.session_restarted
    assert [r.data["text/plain"] for r in (await sb.run_code("y")).results] == ["5"]


# -- a terminal ------------------------------------------------------------------------------------------------------


async def _until(stream: AsyncIterator[bytes], buf: bytearray, wanted: bytes, seconds: float = 30) -> None:
    """Read the terminal into `buf` until `wanted` shows (bounded)."""
    async with asyncio.timeout(seconds):
        while wanted not in buf:
            buf += await anext(stream)


@ON_BOTH
async def test_a_terminal_echoes_input_runs_it_and_knows_its_size(sb: SandboxSession) -> None:
    term = await sb.pty("bash", rows=30, cols=100)
    try:
        stream = aiter(term)
        seen = bytearray()
        await term.write(b"echo ab''cd\r")
        await _until(stream, seen, b"abcd\r\n")
        assert b"echo ab''cd" in seen  # the terminal echoed what was typed
        await term.write(b"stty size\r")
        await _until(stream, seen, b"30 100\r\n")
        await term.resize(40, 120)
        await term.write(b"stty size\r")
        await _until(stream, seen, b"40 120\r\n")
        await term.write(b"exit 4\r")
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
        assert term.result is not None and term.result.exit_code == 4
    finally:
        await term.close()


# -- a directory watch ---------------------------------------------------------------------------------------------


async def _events(sb: SandboxSession, watcher: str, name: str, wanted: set[str]) -> set[str]:
    """The event types of `name` polled until they include `wanted` (bounded)."""
    got: set[str] = set()
    deadline = time.monotonic() + 30
    while not wanted <= got and time.monotonic() < deadline:
        got |= {e.type for e in await sb.files.watcher_events(watcher) if e.name == name}
        await asyncio.sleep(0.05)
    return got


@ON_BOTH
async def test_a_watcher_reports_a_file_made_written_and_removed(sb: SandboxSession) -> None:
    await sb.files.make_dir("/workspace/w")
    watcher = await sb.files.create_watcher("/workspace/w", recursive=True)
    await sb.files.write("/workspace/w/put.txt", b"renamed into place whole")
    assert await _events(sb, watcher, "put.txt", {"create"}) == {"create"}
    assert (await sb.exec("echo content > /workspace/w/f.txt")).exit_code == 0
    assert {"create", "write"} <= await _events(sb, watcher, "f.txt", {"create", "write"})
    await sb.files.remove("/workspace/w/f.txt")
    assert "remove" in await _events(sb, watcher, "f.txt", {"remove"})
    await sb.files.remove_watcher(watcher)
    with pytest.raises(NotFoundError):
        await sb.files.watcher_events(watcher)
    with pytest.raises(InvalidRequestError):
        await sb.files.create_watcher("/etc/passwd")  # not a directory


# -- a port tunnel ---------------------------------------------------------------------------------------------------


async def _http_get(sb: SandboxSession, port: int, path: str) -> bytes:
    """GET `path` from the sandbox's `port` through the agent, retrying (bounded) until the server listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = await sb.open_port(port)
            break
        except AgentError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer = bytearray()
        async with asyncio.timeout(30):
            while chunk := await loop.sock_recv(sock, 65536):
                answer += chunk
        return bytes(answer)
    finally:
        sock.close()


@ON_BOTH
async def test_a_port_tunnel_reaches_a_server_in_the_sandbox(sb: SandboxSession) -> None:
    with pytest.raises(AgentError, match="8124"):
        await sb.open_port(8124)
    await sb.files.write("/workspace/www/hello.txt", b"hello through the tunnel\n")
    server = await sb.processes.start("python3 -m http.server 8123 --bind 127.0.0.1 --directory /workspace/www")
    try:
        answer = await _http_get(sb, 8123, "/hello.txt")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200")
        assert body == b"hello through the tunnel\n"
        assert (await _http_get(sb, 8123, "/missing")).startswith(b"HTTP/1.0 404")
    finally:
        await sb.processes.kill(server.id)
