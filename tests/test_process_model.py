"""The process model E2B needs, at the engine over real runc sandboxes: detached commands that stream to their
caller and outlive it, PTYs as background processes, processes named by pid or tag, attach without replay,
kills that reap, signals to the group, stdin closing, env layering and timeouts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from corral import ConflictError, InvalidRequestError, NotFoundError
from corral.engine import Engine, ProcessRef, PtySize, SandboxSession, SandboxSpec

from .conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

BOUND = 20.0  # seconds any wait here may take: a regression fails, it does not hang


@dataclass
class Seen:
    """What a followed process handed over, in order: ("start", (id, pid)), ("stdout", bytes), ..."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self, process_id: str, pid: int) -> None:
        self.events.append(("start", (process_id, pid)))
        self.arrived.set()

    async def stdout(self, data: bytes) -> None:
        self.events.append(("stdout", data))
        self.arrived.set()

    async def stderr(self, data: bytes) -> None:
        self.events.append(("stderr", data))
        self.arrived.set()

    def callbacks(self) -> dict[str, Any]:
        return {"on_start": self.start, "on_stdout": self.stdout, "on_stderr": self.stderr}

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
                self.arrived.clear()
                await self.arrived.wait()


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _alive(sandbox: SandboxSession, pid: int) -> bool:
    return (await sandbox.exec(f"kill -0 {pid}")).exit_code == 0


# -- detached commands ----------------------------------------------------------------------------------------


async def test_a_detached_command_streams_to_its_caller_and_is_kept_after_it_ends(sandbox: SandboxSession) -> None:
    seen = Seen()
    began = time.monotonic()
    async with asyncio.timeout(BOUND):
        result = await sandbox.exec("echo a; sleep 1; echo b >&2; exit 3", detached=True, **seen.callbacks())
    ended = time.monotonic()
    process_id, pid = seen.started  # the start came first, before any output
    assert pid > 1 and (result.id, result.pid) == (process_id, pid)
    assert [kind for kind, _ in seen.events] == ["start", "stdout", "stderr"]
    assert seen.out == b"a\n" and result.stdout == "a\n" and result.stderr == "b\n"
    assert (result.exit_code, result.signal, result.killed, result.timed_out) == (3, None, False, False)
    assert ended - began > 1  # and "a" was handed over live, long before the end:
    listed = {p.id: p for p in await sandbox.processes.list()}
    assert not listed[process_id].running and listed[process_id].exit_code == 3  # kept, like any background one
    again = await sandbox.processes.wait(process_id)
    assert again is not None and again.stdout == "a\n" and again.exit_code == 3


async def test_output_arrives_while_the_detached_command_runs(sandbox: SandboxSession) -> None:
    seen = Seen()
    task = asyncio.create_task(sandbox.exec("echo first; sleep 2; echo second", detached=True, **seen.callbacks()))
    await seen.until(b"first\n")
    assert not task.done() and b"second" not in seen.out
    async with asyncio.timeout(BOUND):
        result = await task
    assert result.stdout == "first\nsecond\n"


async def test_a_caller_that_leaves_only_stops_following(sandbox: SandboxSession) -> None:
    seen = Seen()
    task = asyncio.create_task(sandbox.exec("for i in $(seq 1 300); do echo tick$i; sleep 0.05; done",
                                            detached=True, **seen.callbacks()))
    await seen.until(b"tick2\n")
    await _cancel(task)
    process_id, pid = seen.started
    await asyncio.sleep(0.3)
    info = await sandbox.processes.get(ProcessRef(pid=pid))
    assert info.id == process_id and info.running and await _alive(sandbox, pid)
    later = Seen()
    follower = asyncio.create_task(sandbox.processes.attach(process_id, later.stdout, replay=False))
    await later.until(b"\ntick")  # still producing output after its caller left
    await sandbox.processes.kill(process_id)
    async with asyncio.timeout(BOUND):
        result = await follower
    assert result.killed and result.signal == 9 and result.exit_code == 137
    assert not await _alive(sandbox, pid)


async def test_stdin_for_a_detached_command_is_fed_then_closed_or_kept_open(sandbox: SandboxSession) -> None:
    async with asyncio.timeout(BOUND):
        fed = await sandbox.exec(["cat"], detached=True, stdin=b"hello\x00")
    assert fed.stdout_bytes == b"hello\x00" and fed.exit_code == 0

    seen = Seen()
    task = asyncio.create_task(sandbox.exec(["cat"], detached=True, stdin=b"one ", keep_stdin=True,
                                            **seen.callbacks()))
    await seen.until(b"one ")
    process_id, _ = seen.started
    await sandbox.processes.send_stdin(process_id, b"two")
    await sandbox.processes.close_stdin(process_id)  # EOF without data: cat ends
    async with asyncio.timeout(BOUND):
        result = await task
    assert result.stdout == "one two" and result.exit_code == 0
    with pytest.raises(ConflictError, match="stdin"):  # closed now: nothing more goes in
        await sandbox.processes.send_stdin(process_id, b"late")


async def test_a_process_started_without_stdin_refuses_input(sandbox: SandboxSession) -> None:
    p = await sandbox.processes.start("sleep 30")
    with pytest.raises(ConflictError, match="without stdin"):
        await sandbox.processes.send_stdin(ProcessRef(pid=p.pid), b"x")
    with pytest.raises(ConflictError):
        await sandbox.processes.close_stdin(p.id)
    with pytest.raises(ConflictError, match="PTY"):  # and a process without a terminal has nothing to resize
        await sandbox.processes.resize(p.id, 30, 100)
    await sandbox.processes.kill(p.id)


async def test_a_detached_command_with_a_timeout_is_killed_at_its_deadline(sandbox: SandboxSession) -> None:
    seen = Seen()
    async with asyncio.timeout(BOUND):
        result = await sandbox.exec("echo up; sleep 30", detached=True, timeout=0.5, **seen.callbacks())
    assert result.timed_out and not result.killed and result.signal == 9 and result.exit_code == 137
    assert result.stdout == "up\n" and result.duration < 5
    assert not await _alive(sandbox, seen.started[1])


async def test_a_followed_process_hands_over_every_byte_but_keeps_a_bounded_result(sandbox: SandboxSession) -> None:
    seen = Seen()
    async with asyncio.timeout(BOUND):
        result = await sandbox.exec("head -c 200000 /dev/zero | tr '\\0' x; echo END", detached=True,
                                    max_output=4096, **seen.callbacks())
    assert seen.out == b"x" * 200000 + b"END\n"  # the follower got all of it, live
    assert result.truncated and result.stdout_size == 200004
    assert len(result.stdout_bytes) == 4096 and result.stdout_cut == 3072  # the agent's head and tail
    assert result.stdout_bytes.endswith(b"xEND\n") and result.stdout_bytes.startswith(b"x" * 3072)


async def test_pty_and_keep_stdin_need_a_detached_command(sandbox: SandboxSession) -> None:
    with pytest.raises(InvalidRequestError, match="detached"):
        await sandbox.exec("true", pty=PtySize(24, 80))
    with pytest.raises(InvalidRequestError, match="detached"):
        await sandbox.exec("true", keep_stdin=True)


# -- attach ---------------------------------------------------------------------------------------------------


async def test_attach_without_replay_follows_only_what_comes_after(sandbox: SandboxSession) -> None:
    p = await sandbox.processes.start("echo before; read x; echo after-$x", stdin=True)
    attached = asyncio.Event()
    fresh, replayed = Seen(), Seen()

    def on_start(process_id: str, pid: int) -> None:
        assert (process_id, pid) == (p.id, p.pid)
        attached.set()

    both = asyncio.create_task(sandbox.processes.attach(p.id, replayed.stdout))
    await replayed.until(b"before\n")  # out before the second attach begins
    task = asyncio.create_task(sandbox.processes.attach(ProcessRef(pid=p.pid), fresh.stdout, replay=False,
                                                        on_start=on_start))
    await asyncio.wait_for(attached.wait(), BOUND)
    await sandbox.processes.send_stdin(p.id, b"1\n")
    async with asyncio.timeout(BOUND):
        result, full = await task, await both
    assert fresh.out == b"after-1\n" and result.stdout == "after-1\n" and result.exit_code == 0
    assert replayed.out == b"before\nafter-1\n" and full.stdout == "before\nafter-1\n"


# -- selectors: pid and tag -----------------------------------------------------------------------------------


async def test_processes_are_found_by_pid_and_unknown_ones_are_not_found(sandbox: SandboxSession) -> None:
    p = await sandbox.processes.start("sleep 30")
    by_pid = await sandbox.processes.get(ProcessRef(pid=p.pid))
    assert by_pid.id == p.id and by_pid.running
    assert (await sandbox.processes.get(p.id)).pid == p.pid  # a plain str is still Corral's id
    with pytest.raises(NotFoundError, match="pid 999999"):
        await sandbox.processes.kill(ProcessRef(pid=999999))
    with pytest.raises(NotFoundError, match="pid 999999"):
        await sandbox.processes.attach(ProcessRef(pid=999999))
    with pytest.raises(InvalidRequestError, match="positive"):
        await sandbox.processes.get(ProcessRef(pid=-4))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        ProcessRef()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        ProcessRef(pid=p.pid, tag="both")
    await sandbox.processes.kill(ProcessRef(pid=p.pid))


async def test_a_tag_names_one_running_process_and_is_free_once_it_ended(sandbox: SandboxSession) -> None:
    first = await sandbox.processes.start("sleep 30", tag="web")
    before = await sandbox.processes.list()
    with pytest.raises(ConflictError, match="'web'"):
        await sandbox.processes.start("sleep 31", tag="web")
    with pytest.raises(ConflictError, match="'web'"):
        await sandbox.exec("sleep 32", detached=True, tag="web")
    assert [p.id for p in await sandbox.processes.list()] == [p.id for p in before]  # refused: nothing started
    assert (await sandbox.processes.get(ProcessRef(tag="web"))).id == first.id
    await sandbox.processes.kill(ProcessRef(tag="web"))
    second = await sandbox.processes.start("sleep 30", tag="web")  # free again
    found = await sandbox.processes.get(ProcessRef(tag="web"))
    assert found.id == second.id and found.running  # the running one, not the finished one
    with pytest.raises(NotFoundError, match="tag 'nope'"):
        await sandbox.processes.wait(ProcessRef(tag="nope"))
    with pytest.raises(InvalidRequestError, match="tag"):
        await sandbox.processes.start("true", tag="")
    await sandbox.processes.kill(ProcessRef(tag="web"))


async def test_list_shows_pid_tag_argv_cwd_own_env_and_pty(sandbox: SandboxSession) -> None:
    plain = await sandbox.processes.start(["sleep", "30"], cwd="/tmp", env={"FOO": "bar"}, tag="plain")
    term = await sandbox.processes.start(["/bin/bash", "-i", "-l"], pty=PtySize(24, 80))
    listed = {p.id: p for p in await sandbox.processes.list()}
    got = listed[plain.id]
    assert (got.pid, got.tag, got.argv, got.cwd, got.pty, got.running) == (plain.pid, "plain", ["sleep", "30"],
                                                                        "/tmp", False, True)
    assert got.env == {"FOO": "bar"}  # its own: not the base's, not the sandbox's (HTTP_PROXY & co.)
    other = listed[term.id]
    assert other.pty and other.tag is None and other.cwd == "/workspace" and other.env == {}
    for p in (plain, term):
        await sandbox.processes.kill(p.id)


# -- kill and signals -----------------------------------------------------------------------------------------


async def test_a_kill_answers_once_the_process_is_reaped(sandbox: SandboxSession) -> None:
    for cmd in ("sleep 100", "sleep 100 & sleep 100; wait", "setsid sleep 100 & exec sleep 101"):
        p = await sandbox.processes.start(cmd)
        await sandbox.processes.kill(ProcessRef(pid=p.pid))
        info = await sandbox.processes.get(p.id)  # asked at once: its end is already recorded
        assert not info.running and info.exit_code == 137, cmd
        assert not await _alive(sandbox, p.pid), cmd  # no zombie answers `kill -0` right after
    assert (await sandbox.exec("pgrep -c sleep || true")).stdout.strip() == "0"  # the whole trees went


async def test_sigterm_goes_to_the_process_group(sandbox: SandboxSession) -> None:
    seen = Seen()
    task = asyncio.create_task(sandbox.exec("trap 'echo got-term; exit 0' TERM; sleep 107 & echo ready; wait",
                                            detached=True, **seen.callbacks()))
    await seen.until(b"ready\n")
    await sandbox.processes.kill(ProcessRef(pid=seen.started[1]), 15)
    async with asyncio.timeout(BOUND):
        result = await task
    assert "got-term" in result.stdout and result.exit_code == 0 and result.signal is None
    # The shell's child had the TERM too (it is in the group): no `sleep` is left.
    assert (await sandbox.exec("pgrep -xc sleep || true")).stdout.strip() == "0"


async def test_a_killed_background_process_reports_the_signal(sandbox: SandboxSession) -> None:
    p = await sandbox.processes.start("sleep 30")
    await sandbox.processes.kill(p.id)
    result = await sandbox.processes.wait(p.id, timeout=BOUND)
    assert result is not None and (result.exit_code, result.signal, result.killed) == (137, 9, True)
    done = await sandbox.processes.start("exit 5")
    result = await sandbox.processes.wait(done.id, timeout=BOUND)
    assert result is not None and (result.exit_code, result.signal, result.killed) == (5, None, False)


# -- PTYs as background processes -----------------------------------------------------------------------------


async def test_a_pty_runs_detached_resizes_takes_input_and_is_reattached(sandbox: SandboxSession) -> None:
    seen = Seen()
    task = asyncio.create_task(sandbox.exec(["/bin/bash", "-i", "-l"], detached=True, pty=PtySize(24, 80),
                                            env={"FOO": "bar"}, cwd="/home/user", **seen.callbacks()))
    async with asyncio.timeout(BOUND):
        while not seen.events:
            await asyncio.sleep(0.01)
    process_id, pid = seen.started
    ref = ProcessRef(pid=pid)
    await sandbox.processes.send_stdin(ref, b"stty size; echo x$((40+2))\n")
    await seen.until(b"x42")
    assert b"24 80" in seen.out
    await sandbox.processes.resize(ref, 30, 100)
    await sandbox.processes.send_stdin(ref, b"stty size; echo y$((40+2))\n")
    await seen.until(b"y42")
    assert b"30 100" in seen.out
    with pytest.raises(InvalidRequestError, match="Ctrl-D"):
        await sandbox.processes.close_stdin(ref)
    await _cancel(task)  # the client leaves: the terminal stays

    info = await sandbox.processes.get(ref)
    assert info.running and info.pty and info.env == {"FOO": "bar"} and info.cwd == "/home/user"
    again = Seen()
    follower = asyncio.create_task(sandbox.processes.attach(ref, again.stdout, replay=False,
                                                            on_start=again.start))
    async with asyncio.timeout(BOUND):
        while not again.events:
            await asyncio.sleep(0.01)
    await sandbox.processes.send_stdin(ref, b'echo "v=$FOO"; exit 4\n')
    async with asyncio.timeout(BOUND):
        result = await follower
    assert again.started == (process_id, pid)
    assert b"v=bar" in again.out and b"x42" not in again.out  # only what came after the re-attach
    assert result.exit_code == 4 and result.signal is None
    assert not await _alive(sandbox, pid)


async def test_a_killed_pty_is_gone(sandbox: SandboxSession) -> None:
    p = await sandbox.processes.start(["/bin/bash", "-i", "-l"], pty=PtySize(24, 80))
    await sandbox.processes.kill(ProcessRef(pid=p.pid))
    assert not await _alive(sandbox, p.pid)
    with pytest.raises(ConflictError, match="ended"):
        await sandbox.processes.resize(p.id, 30, 100)


# -- environment ----------------------------------------------------------------------------------------------


async def test_a_commands_env_layers_over_the_sandboxs_and_never_leaks(engine: Engine) -> None:
    sandbox = await engine.create(SandboxSpec(template=TEMPLATE, env={"LAYER": "sandbox", "ONLY_SB": "1"}))
    try:
        show = 'echo "$LAYER ${ONLY_SB:-} ${SECRET:-none}"'
        r = await sandbox.exec(show, env={"LAYER": "command", "SECRET": "s3"})
        assert r.stdout == "command 1 s3\n"
        r = await sandbox.exec(show, detached=True, env={"SECRET": "s4"})
        assert r.stdout == "sandbox 1 s4\n"
        await sandbox.processes.start(show, env={"SECRET": "s5"})
        r = await sandbox.exec(show)  # nothing a command was given reached a later one
        assert r.stdout == "sandbox 1 none\n"
    finally:
        await sandbox.destroy()


async def test_followers_that_leave_are_gone_from_the_agent(sandbox: SandboxSession) -> None:
    async def agent_threads() -> int:
        r = await sandbox.exec("awk '/^Threads:/ {print $2}' /proc/1/status")
        return int(r.stdout)

    p = await sandbox.processes.start("sleep 60")
    baseline = await agent_threads()
    for replay in (True, False) * 5:
        seen = Seen()
        task = asyncio.create_task(sandbox.processes.attach(p.id, replay=replay, on_start=seen.start))
        await asyncio.wait_for(seen.arrived.wait(), BOUND)
        await _cancel(task)
    async with asyncio.timeout(BOUND):  # each follower's thread noticed its host leave and ended
        while await agent_threads() > baseline:
            await asyncio.sleep(0.05)
    assert (await sandbox.processes.get(p.id)).running
    await sandbox.processes.kill(p.id)
