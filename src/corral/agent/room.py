"""Making room under the pids limit: stop what ended commands left behind, so that the next command can start.

A command's root is a subreaper, so while it runs its whole tree hangs under it. Once it has exited, whatever it
left running (a fork bomb's last generations, a `nohup` daemon) is re-parented to us, PID 1, and belongs to no
live command. When the sandbox is at (or near) its pids limit, and only then, `make_room` stops those leftovers,
largest session first, until there is room again; what it stopped becomes a notice on the next command's result.

Never stopped: the agent itself (its threads are not in `/proc`'s list), any live root in the reaper's registry
(commands, background processes, PTYs, code sessions, `sudo`) and all of its descendants. A leftover's origin is
its session: every root is a session leader (`setsid` at spawn), a session keeps its id while any member lives
(the kernel does not reuse a pid that names a session), so a leftover whose session is an ended root's pid came
from that command. One that called `setsid` itself is a session of its own, of no known command.

A tree that keeps forking while it is killed: each pass stops (SIGSTOP) every member of the chosen sessions
before it kills (SIGKILL) them, so that none forks into the room the kills free, and the passes repeat until the
sessions are empty, bounded in count and time.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

SIGKILL, SIGSTOP = 9, 19
PASSES = 100  # per reclaim: a bomb at 128 pids is gone in 2-5 passes
RECLAIM_FOR = 2.0  # seconds: the most a reclaim spends killing (then the caller refuses as before)
SETTLE_FOR = 0.5  # seconds: after the kills, how long to wait for the reaper to free the zombies' pids
HEADROOM_MIN, HEADROOM_MAX = 4, 16  # free pids wanted: a command, its pump thread and a few children
# Where the pids controller may be: cgroup v2's unified tree, v1's pids hierarchy (runc and Docker mount the
# sandbox's own cgroup there); neither: room is unknown and only a refused spawn or thread triggers a reclaim.
PIDS_DIRS = ("/sys/fs/cgroup", "/sys/fs/cgroup/pids")
NOTICE_KEPT = 32  # entries waiting for a command's result: bounded, whatever keeps leaving leftovers


_pids_dir: list[str | None] = []  # the one of PIDS_DIRS that has the files, found on first use


def _pids_state() -> tuple[int, int] | None:
    """(limit, current) of the sandbox's pids controller, None when it has none (or no limit: "max")."""
    if not _pids_dir:
        _pids_dir.append(next((d for d in PIDS_DIRS if os.path.exists(f"{d}/pids.current")), None))
    directory = _pids_dir[0]
    if directory is None:
        return None
    try:
        with open(f"{directory}/pids.max", "rb") as f:
            limit = f.read().strip()
        with open(f"{directory}/pids.current", "rb") as f:
            current = int(f.read())
        return None if limit == b"max" else (int(limit), current)
    except (OSError, ValueError):
        return None


def headroom(limit: int | None) -> int:
    """Free pids wanted: an eighth of the limit, at least a command with its pump thread and a few children."""
    return HEADROOM_MIN if limit is None else max(HEADROOM_MIN, min(HEADROOM_MAX, limit // 8))


def room() -> tuple[int | None, int]:
    """(free pids, free pids wanted); free is None when the limit is unknown."""
    state = _pids_state()
    if state is None:
        return None, headroom(None)
    return state[0] - state[1], headroom(state[0])


def room_is_short() -> bool:
    """True when the sandbox is within its headroom of its pids limit (False when the limit is unknown)."""
    free, want = room()
    return free is not None and free < want


def processes() -> dict[int, tuple[int, str, int]]:
    """pid -> (ppid, state, session) of every process in the sandbox but us."""
    table: dict[int, tuple[int, str, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()  # comm may hold spaces and parentheses: split after the last ')'
        if len(fields) >= 4:
            table[int(name)] = (int(fields[1]), fields[0].decode(), int(fields[3]))
    return table


def leftovers(live_roots: Iterable[int], table: dict[int, tuple[int, str, int]]) -> dict[int, list[int]]:
    """session -> its members that belong to no live root (neither a root nor a descendant of one)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    live: set[int] = set()
    stack = [pid for pid in live_roots if pid in table]
    while stack:
        pid = stack.pop()
        if pid not in live:
            live.add(pid)
            stack.extend(children.get(pid, ()))
    found: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (_, state, session) in table.items():
        if pid not in live and state not in ("Z", "X"):  # a zombie is the reaper's, already freeing its pid
            found[session].append(pid)
    return found


class Reclaim:
    """One call of `make_room`: which sessions it stops, and how many processes it killed of each."""

    def __init__(self, snapshot: Callable[[], tuple[set[int], dict[int, tuple[int, str, int]]]]) -> None:
        self.snapshot = snapshot  # (live roots, process table), taken while no spawn is half-registered
        self.killed: dict[int, set[int]] = collections.defaultdict(set)  # session -> pids killed

    def choose(self, want: int, room: int | None) -> set[int]:
        """The sessions to stop: the largest first, until `want` pids would be free (the largest alone when the
        room is unknown: the caller retries, and comes back if that was not enough)."""
        roots, table = self.snapshot()
        sessions = sorted(leftovers(roots, table).items(), key=lambda item: -len(item[1]))
        chosen: set[int] = set()
        free = room
        for session, members in sessions:
            if free is not None and free >= want:
                break
            chosen.add(session)
            if free is None:
                break
            free += len(members)
        return chosen

    def stop(self, sessions: set[int]) -> None:
        """Stop, then kill, every member of `sessions` until none is left (bounded in passes and time)."""
        deadline = time.monotonic() + RECLAIM_FOR
        for _ in range(PASSES):
            roots, table = self.snapshot()
            members = [(session, pid) for session, pids in leftovers(roots, table).items() if session in sessions
                       for pid in pids]
            if not members:
                return
            for _, pid in members:  # frozen first: none forks into the room the kills are about to free
                _signal(pid, SIGSTOP)
            for session, pid in members:
                if _signal(pid, SIGKILL):
                    self.killed[session].add(pid)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def settle(want: int) -> None:
    """Wait (bounded) until the killed processes' pids are free again: the reaper collects them as they die."""
    deadline = time.monotonic() + SETTLE_FOR
    while time.monotonic() < deadline:
        free, _ = room()
        if free is None or free >= want:
            return
        time.sleep(0.005)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def notice(killed: dict[int, set[int]], origins: dict[int, tuple[str, str]]) -> list[dict[str, Any]]:
    """The result's `reclaimed`: per ended command (id and command line), how many processes were stopped; the
    sessions of no known command together in one entry without them."""
    found: list[dict[str, Any]] = []
    unknown = 0
    for session, pids in sorted(killed.items(), key=lambda item: -len(item[1])):
        if not pids:
            continue
        origin = origins.get(session)
        if origin is None:
            unknown += len(pids)
        else:
            found.append({"id": origin[0], "command": origin[1], "processes": len(pids)})
    if unknown:
        found.append({"id": None, "command": None, "processes": unknown})
    return found


__all__ = ["Reclaim", "headroom", "leftovers", "notice", "processes", "room", "room_is_short", "settle"]
