"""Items 9 and 13, the parts only a check across sandboxes and the host can see: a fork bomb at its pids limit
leaves other sandboxes and the host responsive, and gigabytes of output pass through a server whose memory stays
flat. (The abuse corpus's tasks prove the rest of them, and items 10 and 11, from inside one sandbox.) Item 46: a
fork bomb whose command has ended, holding the pids limit, does not lock its sandbox out.

All are heavy: the orchestrator runs them one at a time, after everything else, so they neither disturb nor are
disturbed by the other probes.
"""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

from .._exceptions import QuotaExceededError
from .._sdk import AsyncSandbox, CommandResult
from ._context import CheckContext, GiB, MiB, clip, run_ok
from ._model import ItemFailed, NotApplicable

__all__ = ["item_09_process_limit", "item_13_output_cap", "item_46_runaway_tree_does_not_lock", "server_pid"]

PIDS = 64
FORK_PROBE = r"""
import os, sys, time
hold = float(sys.argv[1])
kids, err = [], None
for i in range(500):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
print("FULL", len(kids), err, flush=True)
time.sleep(hold)
for k in kids:
    os.kill(k, 9)
for k in kids:
    os.waitpid(k, 0)
print("DONE", flush=True)
"""
OTHER_SANDBOX_MAX = 5.0  # seconds another sandbox may take to answer while one sits at its pids limit
HOLD = 8  # seconds the bomb holds its processes: long enough for the other sandbox and the host to be asked


async def _until_full(bomb: asyncio.Task[object], full: asyncio.Event, seconds: float) -> None:
    waiter = asyncio.ensure_future(full.wait())
    try:
        await asyncio.wait([bomb, waiter], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def item_09_process_limit(ctx: CheckContext) -> str:
    """A fork bomb stops at the pids limit with EAGAIN, while another sandbox (and the host) stay responsive."""
    async with ctx.sandbox(limits={"pids": PIDS}) as bombed, ctx.sandbox() as other:
        full = asyncio.Event()

        def on_stdout(data: bytes) -> None:
            if b"FULL" in data:
                full.set()

        bomb = asyncio.ensure_future(bombed.commands.run(["python3", "-c", FORK_PROBE, str(HOLD)], timeout=90,
                                                         on_stdout=on_stdout))
        try:
            await _until_full(bomb, full, 60)
            if not full.is_set():
                outcome = clip(str(bomb.exception() or bomb.result())) if bomb.done() else "still running"
                raise ItemFailed(f"the fork probe never reached the pids limit within 60 s ({outcome})")
            t0 = time.monotonic()
            async with asyncio.timeout(20):
                answer = await other.commands.run("echo other", timeout=15)
            other_seconds = time.monotonic() - t0
            host_seconds = await _host_responsiveness(ctx)
            if bomb.done():
                raise ItemFailed(f"the fork probe let its processes go before another sandbox (and the host) had "
                                 f"answered ({other_seconds:.1f} s): the probe proves nothing")
            async with asyncio.timeout(90):
                result = await bomb
        finally:
            bomb.cancel()
        alive = await run_ok(bombed, "echo alive", timeout=15, what="the bombed sandbox afterwards")
    if answer.stdout != "other\n" or other_seconds > OTHER_SANDBOX_MAX:
        raise ItemFailed(f"another sandbox took {other_seconds:.1f} s to answer during the fork bomb "
                         f"(allowed {OTHER_SANDBOX_MAX:.0f} s): {answer.stdout!r}")
    if host_seconds is not None and host_seconds > OTHER_SANDBOX_MAX:
        raise ItemFailed(f"the host took {host_seconds:.1f} s to start a process during the fork bomb")
    first = result.stdout.splitlines()[0].split() if result.stdout else []
    if len(first) != 3 or first[0] != "FULL":
        raise ItemFailed(f"the fork probe's report is missing: {clip(result.stdout)!r} {clip(result.stderr)!r}")
    count, err = int(first[1]), first[2]
    if err != str(errno.EAGAIN) or count >= PIDS:
        raise ItemFailed(f"{count} processes were forked under a pids limit of {PIDS}, then fork failed with "
                         f"errno {err} (expected EAGAIN before the limit)")
    host = f", the host in {host_seconds:.2f} s" if host_seconds is not None else ""
    return (f"fork failed with EAGAIN after {count} processes (pids {PIDS}); another sandbox answered in "
            f"{other_seconds:.2f} s{host}; the bombed sandbox answered {alive.stdout.strip()!r} afterwards")


async def _host_responsiveness(ctx: CheckContext) -> float | None:
    """Seconds to start and finish `true` on this machine, when it is the server's machine."""
    if not ctx.target.on_this_machine:
        return None
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec("true")
    async with asyncio.timeout(30):
        await proc.wait()
    return time.monotonic() - t0


# Item 46: a tree that forks three children a generation, five generations deep, every member then waiting in
# `sleep` (120 s: past the probe; the sandbox is destroyed with it anyway), so that it holds the limit long after
# its command has ended. Bounded (about 730 processes) wherever a pids limit is not what stops it.
HOLDING_BOMB = ("(f(){ if [ $1 -gt 0 ]; then f $(($1-1)) & f $(($1-1)) & f $(($1-1)) & fi; sleep 120; }; f 5) "
                ">/dev/null 2>&1 & echo started")
RUNAWAY_PIDS = 128
SATURATE = 3.0  # seconds for the bomb to fill its limit (it takes well under one)
NEXT_COMMAND_MAX = 5.0  # seconds the next command may take: "at once", with room for a loaded machine


async def item_46_runaway_tree_does_not_lock(ctx: CheckContext) -> str:
    """After a fork bomb's command has ended, the next command runs at once and its result says what was stopped."""
    if ctx.deployment.backend == "kubernetes":
        raise NotApplicable("a Pod's pids limit is its node's (the kubelet's podPidsLimit): a sandbox cannot be "
                            f"given one of {RUNAWAY_PIDS} to fill")
    async with ctx.sandbox(limits={"pids": RUNAWAY_PIDS}) as sb:
        started = await sb.commands.run(HOLDING_BOMB, timeout=60)
        if started.stdout != "started\n":
            raise ItemFailed(f"the fork bomb did not start: exit {started.exit_code}, {clip(started.stderr)!r}")
        await asyncio.sleep(SATURATE)
        t0 = time.monotonic()
        try:
            after = await sb.commands.run("echo ok", timeout=30)
        except QuotaExceededError as exc:
            raise ItemFailed(f"the next command was refused while the ended bomb's processes held the pids limit "
                             f"({RUNAWAY_PIDS}): {exc.message}") from None
        seconds = time.monotonic() - t0
    if (after.exit_code, after.stdout) != (0, "ok\n"):
        raise ItemFailed(f"the next command did not run: exit {after.exit_code}, stdout {clip(after.stdout)!r}, "
                         f"stderr {clip(after.stderr)!r}")
    if seconds > NEXT_COMMAND_MAX:
        raise ItemFailed(f"the next command took {seconds:.1f} s (allowed {NEXT_COMMAND_MAX:.0f} s): the sandbox "
                         "waited for the bomb's leftovers")
    stopped = [t for t in after.reclaimed if t.command == HOLDING_BOMB and t.processes > 0]
    if not stopped:
        raise ItemFailed(f"the next command ran, but its result does not say what was stopped to make room "
                         f"(reclaimed: {after.reclaimed!r})")
    return (f"after a fork bomb's command ended holding the pids limit ({RUNAWAY_PIDS}), the next command ran in "
            f"{seconds:.2f} s and its result says {stopped[0].processes} of the bomb's processes were stopped")


RSS_GROWTH_MAX = 256 * MiB
OUTPUT_SECONDS_MAX = 300.0  # 5 GB take ~10-30 s on an idle 2-core machine
OUTPUT_TIMEOUT = 600


async def item_13_output_cap(ctx: CheckContext) -> str:
    """Gigabytes of stdout come back promptly, capped, head and tail kept, the true size reported, and the
    server's memory stays flat."""
    size = ctx.target.output_bytes
    pid = server_pid(ctx.home) if ctx.home is not None else None
    before = _peak_rss(pid)
    async with ctx.sandbox() as sb:
        t0 = time.monotonic()
        r = await _flood(sb, size)
        seconds = time.monotonic() - t0
    after = _peak_rss(pid)
    kept = r.stdout_bytes
    expected = size + len("START\nEND\n")
    if r.timed_out:
        raise ItemFailed(f"{_human(size)} of output did not finish within {OUTPUT_TIMEOUT} s (is the host "
                         "overloaded?)")
    if r.exit_code != 0:
        raise ItemFailed(f"{_human(size)} of output did not complete: exit {r.exit_code}, signal {r.signal}")
    if not r.truncated or r.stdout_size != expected:
        raise ItemFailed(f"{_human(size)} of output came back with truncated={r.truncated} and a reported size of "
                         f"{r.stdout_size} (true size {expected})")
    if not (kept.startswith(b"START\n\x00") and kept.endswith(b"\x00END\n")) or len(kept) >= size:
        raise ItemFailed(f"the kept output ({len(kept)} bytes) lacks its head or its tail: starts "
                         f"{kept[:8]!r}, ends {kept[-8:]!r}")
    if seconds > OUTPUT_SECONDS_MAX:
        raise ItemFailed(f"{_human(size)} of output took {seconds:.0f} s (allowed {OUTPUT_SECONDS_MAX:.0f} s)")
    memory = ""
    if before is not None and after is not None:
        if after - before > RSS_GROWTH_MAX:
            raise ItemFailed(f"the server's peak memory grew by {(after - before) // MiB} MiB while {_human(size)} "
                             "of output went through it: output is buffered, not capped",
                             fix="upgrade Corral; put no buffering proxy in front of the API")
        memory = f"; the server's peak memory grew by {(after - before) // MiB} MiB"
    elif ctx.home is not None:
        memory = "; the server's memory could not be read (its engine.lock holder was not found)"
    return (f"{_human(size)} in {seconds:.1f} s: truncated to {len(kept) // MiB} MiB with head and tail, true "
            f"size {r.stdout_size} reported{memory}")


async def _flood(sb: AsyncSandbox, size: int) -> CommandResult:
    return await sb.commands.run(f"echo START; head -c {size} /dev/zero; echo END", timeout=OUTPUT_TIMEOUT)


def _human(size: int) -> str:
    return f"{size / GiB:g} GiB" if size >= GiB else f"{size / MiB:g} MiB"


def server_pid(home: Path) -> int | None:
    """The pid of the engine that owns `home`: the holder of the flock on its `engine.lock` (`/proc/locks`)."""
    try:
        inode = (home / "engine.lock").stat().st_ino
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    for line in locks.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return int(fields[4])
    return None


def _peak_rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None
