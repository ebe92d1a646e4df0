"""A runaway tree left by a command that has ended does not lock its sandbox (issue 25 item 6, checklist item 46).

Real fork bombs under a real pids limit on runc: the next command runs at once and its result names what the
agent stopped to make room (`ExecResult.reclaimed`); live commands and background processes survive it.
"""

from __future__ import annotations

import asyncio

import pytest

from corral.engine import Engine, SandboxSession

from .conftest import spec

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

PIDS = 128
# The issue's bomb: its generations fork until the limit refuses them, and die out over the next seconds.
BOMB = "f(){ f|f & }; f; sleep 3; echo alive"
# One that holds the limit: every generation waits in `sleep` (for 120 s: past any test) once it could fork one.
HOLDING_BOMB = "(f(){ f|f & sleep 120; }; f) >/dev/null 2>&1 & echo started"
SATURATE = 3.0  # seconds for a bomb to fill 128 pids (it takes well under one)


async def _saturated(sb: SandboxSession, command: str) -> str:
    """Run a bomb whose leftovers outlive it; return its id once its tree has had time to fill the limit."""
    started = await sb.exec(command, timeout=60)
    assert started.exit_code == 0, started
    await asyncio.sleep(SATURATE)
    return started.id


async def test_the_next_command_runs_after_the_issues_fork_bomb(engine: Engine) -> None:
    async with await engine.create(spec(pids=PIDS)) as sb:
        bomb = await sb.exec(BOMB, timeout=60)
        assert bomb.stdout == "alive\n", bomb
        after = await sb.exec("echo ok", timeout=30)
        assert (after.exit_code, after.stdout) == (0, "ok\n"), after
        for tree in after.reclaimed:  # the bomb may have died out by itself: then nothing was stopped
            assert tree.id == bomb.id and tree.processes > 0, after.reclaimed


async def test_a_bomb_that_holds_the_limit_is_stopped_and_named_in_the_next_result(engine: Engine) -> None:
    async with await engine.create(spec(pids=PIDS)) as sb:
        bomb_id = await _saturated(sb, HOLDING_BOMB)
        after = await sb.exec("echo ok", timeout=30)
        assert (after.exit_code, after.stdout) == (0, "ok\n"), after
        assert [t.id for t in after.reclaimed] == [bomb_id], after.reclaimed
        tree = after.reclaimed[0]
        assert tree.command == HOLDING_BOMB and tree.processes >= PIDS // 2, tree
        # Told once: the next command has nothing to report, and the sandbox has its room back.
        again = await sb.exec("ps -e --no-headers | wc -l", timeout=30)
        assert again.reclaimed == () and int(again.stdout) < PIDS // 4, again


async def test_background_processes_and_live_commands_survive_a_reclaim(engine: Engine) -> None:
    async with await engine.create(spec(pids=PIDS)) as sb:
        server = await sb.processes.start("sleep 300")
        live = asyncio.ensure_future(sb.exec("sleep 20; echo finished", timeout=60))
        await _saturated(sb, HOLDING_BOMB)
        after = await sb.exec("echo ok", timeout=30)
        assert (after.exit_code, after.stdout) == (0, "ok\n") and after.reclaimed, after
        running = {p.id: p.running for p in await sb.processes.list()}
        assert running.get(server.id) is True, running
        assert not live.done(), live.result() if live.done() else None
        await sb.processes.kill(server.id)
        live.cancel()


async def test_a_sandbox_held_at_its_limit_by_a_live_command_still_refuses(engine: Engine) -> None:
    from corral import QuotaExceededError

    async with await engine.create(spec(pids=PIDS)) as sb:
        bomb = await sb.processes.start("f(){ f|f & sleep 120; }; f; sleep 120")
        await asyncio.sleep(SATURATE)
        with pytest.raises(QuotaExceededError):  # its processes are a live command's: never stopped for room
            await sb.exec("echo ok", timeout=30)
        assert bomb.running
