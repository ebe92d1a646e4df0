"""Detached commands, terminals and process selectors through the service layer (what the E2B front end calls),
over a real engine, real runc sandboxes and a real control store: one audit record per stream, the process's
id and pid in it, a client that leaves only detaches, and pids and tags that stay within their tenant."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral import ConflictError, InvalidRequestError, NotFoundError
from corral.control import AuditEntry, ControlStore, Principal, Role
from corral.engine import Engine, ProcessRef, PtySize
from corral.service import Command, CreateSandbox, Service

from .conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

BOUND = 20.0  # seconds any wait here may take: a regression fails, it does not hang


@dataclass
class Live:
    service: Service
    store: ControlStore
    dev: Principal  # tenant a's developer
    other: Principal  # tenant b's developer
    sandbox: str  # tenant a's, running, created with env {"SB": "1"}

    async def records(self, action: str) -> list[AuditEntry]:
        return await self.store.audit.query(action=action)

    async def record(self, action: str) -> AuditEntry:
        [only] = await self.records(action)
        return only

    async def alive(self, pid: int) -> bool:
        result = await self.service.commands.run(self.dev, self.sandbox, Command(f"kill -0 {pid}"))
        return result.exit_code == 0


@pytest.fixture
async def live(engine: Engine, tmp_path: Path) -> AsyncIterator[Live]:
    async with ControlStore(home=tmp_path) as store:
        tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
        dev, other = [await store.authenticate((await store.create_key(tenants[t], Role.DEVELOPER, t)).key)
                      for t in ("a", "b")]
        service = Service(engine, store)  # not started: the engine fixture and the store are
        record = await service.sandboxes.create(dev, CreateSandbox(template=TEMPLATE, env={"SB": "1"}))
        try:
            yield Live(service, store, dev, other, record.id)
        finally:
            with contextlib.suppress(NotFoundError):
                await service.sandboxes.kill(dev, record.id)


@dataclass
class Seen:
    """What a stream handed over, in order: ("start", (id, pid)), ("stdout", bytes), ("stderr", bytes)."""

    events: list[tuple[str, Any]] = field(default_factory=list)

    async def start(self, process_id: str, pid: int) -> None:
        self.events.append(("start", (process_id, pid)))

    async def stdout(self, data: bytes) -> None:
        self.events.append(("stdout", data))

    async def stderr(self, data: bytes) -> None:
        self.events.append(("stderr", data))

    @property
    def out(self) -> bytes:
        return b"".join(data for kind, data in self.events if kind == "stdout")

    @property
    def started(self) -> tuple[str, int]:
        assert self.events and self.events[0][0] == "start", self.events
        started: tuple[str, int] = self.events[0][1]
        return started

    async def until(self, text: bytes) -> None:
        async with asyncio.timeout(BOUND):
            while text not in self.out:
                await asyncio.sleep(0.02)


async def test_a_detached_stream_starts_before_its_output_and_leaves_one_record(live: Live) -> None:
    command = Command("echo hi; echo oops >&2; exit 2", detached=True, tag="job", cwd="/home/user",
                      env={"FOO": "secret-value"})
    stream = await live.service.commands.stream(live.dev, live.sandbox, command)
    seen = Seen()
    try:
        async with asyncio.timeout(BOUND):
            result = await stream.run(seen.stdout, seen.stderr, on_start=seen.start)
    finally:
        await stream.close()
    process_id, pid = seen.started
    assert [kind for kind, _ in seen.events] == ["start", "stdout", "stderr"]
    assert (result.exit_code, result.signal, result.stdout, result.stderr) == (2, None, "hi\n", "oops\n")
    record = await live.record("sandbox.exec")
    assert record.params == {"cmd": command.cmd, "cwd": "/home/user", "env_names": ["FOO"], "timeout": None,
                             "max_output": None, "stdin_size": None, "detached": True, "tag": "job",
                             "stream": True}
    assert record.outcome == {"status": 200, "process": process_id, "pid": pid, "exit_code": 2, "signal": None,
                              "timed_out": False, "oom_killed": False, "truncated": False}
    assert "secret-value" not in record.to_json()


async def test_a_client_that_leaves_a_detached_stream_only_detaches(live: Live) -> None:
    procs = live.service.processes
    stream = await live.service.commands.stream(
        live.dev, live.sandbox, Command("for i in $(seq 1 400); do echo tick$i; sleep 0.05; done", detached=True,
                                        tag="ticker"))
    seen = Seen()
    task = asyncio.create_task(stream.run(seen.stdout, on_start=seen.start))
    await seen.until(b"tick2\n")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.close()
    process_id, pid = seen.started
    assert (await live.record("sandbox.exec")).outcome == {"status": 200, "process": process_id, "pid": pid,
                                                           "disconnected": True}
    info = await procs.get(live.dev, live.sandbox, ProcessRef(pid=pid))
    assert info.id == process_id and info.running and info.tag == "ticker"

    attach = await procs.attach(live.dev, live.sandbox, ProcessRef(tag="ticker"), replay=False)
    later = Seen()
    follower = asyncio.create_task(attach.run(later.stdout, on_start=later.start))
    await later.until(b"\ntick")
    assert later.started == (process_id, pid) and not later.out.startswith(b"tick1\n")
    await procs.kill(live.dev, live.sandbox, ProcessRef(tag="ticker"))
    async with asyncio.timeout(BOUND):
        ended = await follower
    assert ended is not None and ended.killed and ended.signal == 9
    assert not await live.alive(pid)
    kill = await live.record("process.kill")
    assert kill.params == {"process": {"tag": "ticker"}, "signal": None} and kill.outcome == {"status": 204}
    assert (await live.record("process.attach")).params == {"process": {"tag": "ticker"}, "timeout": None,
                                                            "replay": False}


async def test_a_terminal_runs_as_a_detached_command_addressed_by_pid(live: Live) -> None:
    procs = live.service.processes
    command = Command(["/bin/bash", "-i", "-l"], detached=True, pty=PtySize(24, 80), cwd="/home/user",
                      env={"FOO": "bar"})
    stream = await live.service.commands.stream(live.dev, live.sandbox, command)
    seen = Seen()
    task = asyncio.create_task(stream.run(seen.stdout, seen.stderr, on_start=seen.start))
    async with asyncio.timeout(BOUND):
        while not seen.events:
            await asyncio.sleep(0.01)
    ref = ProcessRef(pid=seen.started[1])
    await procs.resize(live.dev, live.sandbox, ref, 30, 100)
    await procs.send_stdin(live.dev, live.sandbox, ref, b'stty size; echo "v=$FOO $SB"\n')
    await seen.until(b"v=bar 1")
    assert b"30 100" in seen.out
    with pytest.raises(InvalidRequestError, match="Ctrl-D"):
        await procs.close_stdin(live.dev, live.sandbox, ref)
    await procs.send_stdin(live.dev, live.sandbox, ref, b"exit 3\n")
    async with asyncio.timeout(BOUND):
        result = await task
    await stream.close()
    assert result.exit_code == 3 and not [kind for kind, _ in seen.events if kind == "stderr"]  # a terminal: stdout
    record = await live.record("sandbox.exec")
    assert record.params["pty"] == {"rows": 24, "cols": 80} and record.outcome["exit_code"] == 3
    resize = await live.record("process.resize")
    assert resize.params == {"process": {"pid": ref.pid}, "rows": 30, "cols": 100}
    refused = [r for r in await live.records("process.stdin") if r.params["eof"]]
    assert [r.outcome for r in refused] == [{"status": 400, "error": "invalid_request"}]


async def test_list_shows_each_processs_own_env_cwd_and_tag(live: Live) -> None:
    procs = live.service.processes
    started = await procs.start(live.dev, live.sandbox, Command(["sleep", "30"], cwd="/tmp", env={"FOO": "bar"},
                                                               tag="sleeper"))
    assert started.running and started.tag == "sleeper" and started.started_at > 0
    [listed] = [p for p in await procs.list(live.dev, live.sandbox) if p.id == started.id]
    assert (listed.pid, listed.tag, listed.cwd, listed.env) == (started.pid, "sleeper", "/tmp", {"FOO": "bar"})
    with pytest.raises(ConflictError, match="sleeper"):
        await procs.start(live.dev, live.sandbox, Command("sleep 1", tag="sleeper"))
    await procs.kill(live.dev, live.sandbox, started.id)


async def test_a_detached_run_waits_for_the_result_and_names_the_process(live: Live) -> None:
    result = await live.service.commands.run(live.dev, live.sandbox, Command("echo $FOO", detached=True,
                                                                             env={"FOO": "once"}))
    assert result.stdout == "once\n" and result.exit_code == 0
    record = await live.record("sandbox.exec")
    assert record.outcome["process"] == result.id and record.outcome["pid"] == result.pid
    again = await live.service.commands.run(live.dev, live.sandbox, Command('echo "[${FOO:-}]"'))
    assert again.stdout == "[]\n"  # the detached command's env stayed its own


async def test_another_tenant_reaches_no_process_by_pid_or_tag(live: Live) -> None:
    procs = live.service.processes
    started = await procs.start(live.dev, live.sandbox, Command("sleep 30", tag="mine"))
    for call in (procs.get(live.other, live.sandbox, ProcessRef(pid=started.pid)),
                 procs.kill(live.other, live.sandbox, ProcessRef(tag="mine")),
                 procs.resize(live.other, live.sandbox, ProcessRef(pid=started.pid), 30, 100),
                 procs.close_stdin(live.other, live.sandbox, ProcessRef(pid=started.pid)),
                 procs.attach(live.other, live.sandbox, ProcessRef(tag="mine"), replay=False)):
        with pytest.raises(NotFoundError):
            await call
    assert (await procs.get(live.dev, live.sandbox, ProcessRef(tag="mine"))).running  # untouched
    with pytest.raises(NotFoundError, match="pid 999999"):
        await procs.kill(live.dev, live.sandbox, ProcessRef(pid=999999))
    await procs.kill(live.dev, live.sandbox, started.id)
