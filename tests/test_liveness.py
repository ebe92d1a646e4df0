"""Agent liveness (docs/architecture.md, "Agent liveness"): heartbeats during long silences, and an idle timeout
that turns a silent agent into `AgentError`, never a hung call.

The first tests run the host's client against a scripted agent on a Unix socket (the timer, an agent of protocol
version 1, Corral's own freeze); the rest stop the real agent of a runc sandbox with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import AgentError
from corral.agent import heartbeats, protocol
from corral.agent.channel import Channel
from corral.backends import UnixEndpoint
from corral.control import ControlStore
from corral.engine import AgentClient, Engine, Liveness, SandboxSession
from corral.server import create_app

from .conftest import TEMPLATE, started_engine

pytestmark = pytest.mark.anyio

FAST = Liveness(heartbeat_interval=0.5, idle_timeout=2.0)
MARGIN = 1.5  # seconds past the idle timeout a failing call may take (a beat's slack, the event loop, CI load)

# -- the timer, against a scripted agent ------------------------------------------------------------------

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]
Agents = Callable[[int, Script], Awaitable[AgentClient]]


def _event(**fields: Any) -> bytes:
    return protocol.encode_json(protocol.EVENT, fields)


_STARTED = _event(event="started", id="p1", pid=7, max_output=1024)
_EXIT = _event(event="exit", exit_code=0, duration=0.0)
_BEAT = protocol.encode(protocol.HEARTBEAT)


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[tuple[Agents, list[dict[str, Any]]]]:
    """Agents of a given protocol version that answer pings themselves and anything else with a script; and
    every request they got."""
    servers: list[asyncio.Server] = []
    handlers: set[asyncio.Task[Any]] = set()
    requests: list[dict[str, Any]] = []

    async def make(version: int, script: Script) -> AgentClient:
        """`version` 0: an agent that answers nothing, not even a ping."""
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handlers.add(task := asyncio.current_task())  # type: ignore[arg-type]
            try:
                _, length = protocol.parse_header(await reader.readexactly(protocol.HEADER.size))
                requests.append(request := protocol.decode_json(await reader.readexactly(length)))
                if request["op"] == "ping" and version:
                    writer.write(_event(event="pong", version=version))
                else:
                    await script(writer)
                await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()
                handlers.discard(task)

        path = tmp_path / f"agent-{len(servers)}.sock"
        servers.append(await asyncio.start_unix_server(handle, str(path)))
        return AgentClient(UnixEndpoint(str(path)), "t", label="sandbox sb-x", liveness=Liveness(0.1, 0.5),
                           sandbox_id="sb-x")

    yield make, requests
    for server in servers:
        server.close()
    for task in list(handlers):
        task.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)


async def test_heartbeats_carry_a_silence_longer_than_the_idle_timeout(agents: Any) -> None:
    make, requests = agents

    async def beats_then_exit(writer: asyncio.StreamWriter) -> None:
        writer.write(_STARTED)
        for _ in range(12):  # 1.2 s of silence but for heartbeats, with an idle timeout of 0.5 s
            writer.write(_BEAT)
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(_EXIT)

    result = await (await make(2, beats_then_exit)).exec("sleep 1")
    assert result.exit_code == 0
    assert [r["op"] for r in requests] == ["ping", "exec"]  # the version is learnt once, then asked for
    assert requests[1]["heartbeat"] == 0.1


async def test_a_silent_agent_is_an_agent_error_within_the_idle_timeout(agents: Any) -> None:
    make, _ = agents

    async def silent(writer: asyncio.StreamWriter) -> None:
        writer.write(_STARTED)
        await writer.drain()
        await asyncio.sleep(5)

    client = await make(2, silent)
    start = time.monotonic()
    with pytest.raises(AgentError, match=r"sandbox sb-x stopped answering: no frame, not even a heartbeat, "
                                         r"for 0\.5s during 'exec'") as caught:
        await client.exec("sleep 60")
    assert time.monotonic() - start < 0.5 + MARGIN
    assert caught.value.details == {"sandbox_id": "sb-x", "op": "exec", "idle_timeout": 0.5}


async def test_an_agent_of_before_heartbeats_is_not_asked_and_waited_out(agents: Any) -> None:
    make, requests = agents

    async def quiet_then_exit(writer: asyncio.StreamWriter) -> None:
        writer.write(_STARTED)
        await writer.drain()
        await asyncio.sleep(1.0)  # twice the idle timeout: an old agent's silence proves nothing
        writer.write(_EXIT)

    result = await (await make(1, quiet_then_exit)).exec("sleep 1")
    assert result.exit_code == 0
    assert "heartbeat" not in requests[1]


async def test_an_agent_that_answers_nothing_fails_the_first_call(agents: Any) -> None:
    """The ping that learns the agent's version is bounded whatever that version: every agent answers it at
    once, so a call to an agent frozen before its first answer fails too."""
    make, _ = agents

    async def never(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    start = time.monotonic()
    with pytest.raises(AgentError, match=r"for 0\.5s during 'ping'"):
        await (await make(0, never)).stat("/")
    assert time.monotonic() - start < 0.5 + MARGIN


async def test_corral_s_own_freeze_is_waited_through(agents: Any) -> None:
    make, _ = agents

    async def frozen_a_while(writer: asyncio.StreamWriter) -> None:
        writer.write(_STARTED)
        await writer.drain()
        await asyncio.sleep(1.2)
        writer.write(_EXIT)

    client = await make(2, frozen_a_while)
    client.freeze()

    async def thaw_later() -> None:
        await asyncio.sleep(0.9)
        client.thaw()  # 0.3 s of silence left, well within the idle timeout that starts again here

    thawing = asyncio.create_task(thaw_later())
    assert (await client.exec("sleep 1")).exit_code == 0
    await thawing


# -- the agent's side: one thread beats on every silent connection that asked ----------------------------


def _frames(sock: socket.socket) -> list[int]:
    """The kinds of the frames waiting on `sock` (all of them empty: heartbeats)."""
    sock.setblocking(False)
    kinds = []
    with contextlib.suppress(BlockingIOError):
        while header := sock.recv(protocol.HEADER.size):
            kinds.append(protocol.parse_header(header)[0])
    return kinds


def test_a_silent_channel_gets_heartbeats_and_a_busy_one_none() -> None:
    silent_host, silent_agent = socket.socketpair()
    busy_host, busy_agent = socket.socketpair()
    silent, busy = Channel(silent_agent), Channel(busy_agent)
    try:
        heartbeats.register(silent, 0.05)
        heartbeats.register(busy, 0.05)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            busy.event(event="tick")  # a frame every 10 ms: never silent for 50 ms
            time.sleep(0.01)
        heartbeats.unregister(silent)
        heartbeats.unregister(busy)
        beats = _frames(silent_host)
        assert set(beats) == {protocol.HEARTBEAT} and 5 <= len(beats) <= 11, beats
        busy_host.setblocking(False)
        got = busy_host.recv(1 << 20)
        assert protocol.encode(protocol.HEARTBEAT) not in got.replace(protocol.encode_json(
            protocol.EVENT, {"event": "tick"}), b"")
        time.sleep(0.15)
        assert _frames(silent_host) == []  # unregistered: no more beats
    finally:
        for sock in (silent_host, silent_agent, busy_host, busy_agent):
            sock.close()


def test_a_beat_never_blocks_on_a_host_that_stopped_reading() -> None:
    host, agent = socket.socketpair()
    try:
        agent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        agent.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                agent.send(b"x" * 4096)
        agent.setblocking(True)  # as the agent's sockets are
        start = time.monotonic()
        Channel(agent).heartbeat()  # the buffer is full: skipped, at once
        assert time.monotonic() - start < 0.1
    finally:
        host.close()
        agent.close()


def test_a_request_asks_for_a_bounded_interval() -> None:
    assert heartbeats.interval_of(None) is None
    assert heartbeats.interval_of(True) is None
    assert heartbeats.interval_of("5") is None
    assert heartbeats.interval_of(-1) is None
    assert heartbeats.interval_of(0.001) == heartbeats.MIN_INTERVAL
    assert heartbeats.interval_of(1e9) == heartbeats.MAX_INTERVAL
    assert heartbeats.interval_of(5) == 5.0


# -- real sandboxes whose agent is stopped ----------------------------------------------------------------


@pytest.fixture
async def engine(test_home: Path) -> AsyncIterator[Engine]:
    """conftest's `engine` (and so its `sandbox`), with heartbeats every 0.5 s and a 2 s idle timeout."""
    async with started_engine(test_home, liveness=FAST) as eng:
        yield eng


def _agent_pid(engine: Engine, sandbox_id: str) -> int:
    """The host pid of the sandbox's agent (its PID 1), from the runtime's pid file."""
    record = engine.lookup(sandbox_id).record
    return int((record.dir / "pid").read_text())  # type: ignore[attr-defined]


@contextlib.contextmanager
def stopped(pid: int, after: float = 0.0) -> Iterator[None]:
    """SIGSTOP the agent (after `after` seconds, from a timer), and always SIGCONT it at the end."""
    loop = asyncio.get_running_loop()
    handle = loop.call_later(after, os.kill, pid, signal.SIGSTOP)
    try:
        yield
    finally:
        handle.cancel()
        os.kill(pid, signal.SIGCONT)


async def _fails_in_time(call: Awaitable[Any]) -> AgentError:
    start = time.monotonic()
    with pytest.raises(AgentError) as caught:
        await asyncio.wait_for(call, 30)  # a hang fails here, as a TimeoutError, not the test run
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 2.0 + MARGIN, elapsed
    return caught.value


@pytest.mark.runc
async def test_a_stopped_agent_ends_a_long_command_with_agent_error(engine: Engine,
                                                                    sandbox: SandboxSession) -> None:
    with stopped(_agent_pid(engine, sandbox.id), after=0.5):
        err = await _fails_in_time(sandbox.exec("sleep 60", timeout=120))
    assert f"the agent of sandbox {sandbox.id} stopped answering" in err.message
    assert err.details["sandbox_id"] == sandbox.id and err.details["idle_timeout"] == 2.0
    # Running again, the agent saw the host hang up and killed the command's tree: the sandbox serves calls.
    assert (await sandbox.exec("pgrep -x sleep || echo none")).stdout.strip() == "none"


@pytest.mark.runc
async def test_a_stopped_agent_ends_a_command_silent_for_a_while(engine: Engine,
                                                                 sandbox: SandboxSession) -> None:
    with stopped(_agent_pid(engine, sandbox.id), after=0.5):
        err = await _fails_in_time(sandbox.exec("sleep 3; echo late", timeout=60))
    assert "not even a heartbeat, for 2s during 'exec'" in err.message


@pytest.mark.runc
async def test_a_long_healthy_silence_is_carried_by_heartbeats(sandbox: SandboxSession) -> None:
    # 5 s of silence against an idle timeout of 2 s: without heartbeats this fails.
    result = await sandbox.exec("sleep 5; echo done", timeout=30)
    assert (result.exit_code, result.stdout) == (0, "done\n")


@pytest.mark.runc
async def test_a_stopped_agent_ends_a_followed_process_a_cell_and_a_download(engine: Engine,
                                                                             sandbox: SandboxSession) -> None:
    proc = await sandbox.processes.start("sleep 60")
    assert (await sandbox.run_code("print(1 + 1)")).stdout == "2\n"  # the session runs: below, a cell only computes
    await sandbox.files.write("/workspace/a.bin", b"x" * 1000)
    with stopped(_agent_pid(engine, sandbox.id), after=0.5):
        err = await _fails_in_time(sandbox.processes.attach(proc.id))
        assert "during 'attach'" in err.message
        err = await _fails_in_time(sandbox.run_code("import time; time.sleep(60)"))
        assert "during 'code_run'" in err.message
        err = await _fails_in_time(sandbox.files.read("/workspace/a.bin"))
        assert "during 'read'" in err.message
        err = await _fails_in_time(sandbox.processes.list())
        assert "during 'ps'" in err.message


@pytest.mark.runc
async def test_a_command_waits_through_corral_s_own_pause(sandbox: SandboxSession) -> None:
    running = asyncio.create_task(sandbox.exec("sleep 1; echo after", timeout=60))
    await asyncio.sleep(0.3)
    await sandbox.pause()
    await asyncio.sleep(3.0)  # longer than the idle timeout: frozen by Corral is not wedged
    await sandbox.resume()
    result = await asyncio.wait_for(running, 30)
    assert result.stdout == "after\n"


@pytest.mark.runc
async def test_the_api_answers_a_stopped_agent_with_a_structured_502(engine: Engine, tmp_path: Path) -> None:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        await store.bootstrap_admin(None)
        tenant = await store.create_tenant("a")
        from corral.control import Role

        key = (await store.create_key(tenant.id, Role.DEVELOPER, "dev")).key
        app = create_app(engine, store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://corral.test",
                                     headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            r = await client.post("/v1/sandboxes", json={"template": TEMPLATE})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            try:
                with stopped(_agent_pid(engine, sid), after=0.5):
                    start = time.monotonic()
                    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 60", "timeout": 120})
                    assert time.monotonic() - start < 0.5 + 2.0 + MARGIN
                assert r.status_code == 502, r.text
                error = r.json()["error"]
                assert error["code"] == "agent_error"
                assert f"the agent of sandbox {sid} stopped answering" in error["message"]
                assert error["details"]["sandbox_id"] == sid
            finally:
                await client.delete(f"/v1/sandboxes/{sid}")
    finally:
        await store.close()
