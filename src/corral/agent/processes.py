"""Processes inside the sandbox: spawn, reap, cap output, enforce timeouts, kill whole trees.

Every command's root process is a *child subreaper*: anything it double-forks or `setsid`s away is re-parented
to the root, not to us, so the whole tree stays findable under the root's pid until the root exits. A timeout
or kill walks `/proc` for the root's descendants and SIGKILLs them until none is left, then the root.

One reaper thread owns `waitpid(-1)`: we are PID 1, so we must reap orphans, and a single owner means no exit
status is ever stolen from the process it belongs to.

The parts: `process.py` (one `Process`), `tree.py` (killing a tree), `spawn.py` (starting a root),
`process_requests.py` (a request's fields checked, `ProcessError`), `output.py` (`OutputBuffer`); here the
`ProcessTable` (spawning, pumping output, naming processes, room under the pids limit) and the `Reaper`.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import os
import select
import struct
import termios
import threading
import time
from collections.abc import Callable

from . import room, threads
from .output import DEFAULT_MAX_OUTPUT
from .process import Process, close_quietly
from .process_requests import ProcessError, build_argv, build_env, check_tag, positive_or_none, pty_size, resolve_user
from .spawn import SPAWN_SHIM, popen_fallback, posix_spawn, which
from .tree import kill_tree
from .users import AGENT_IS_ROOT, ROOT, User, privileged

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

EXIT_GRACE = 0.1  # after the root exits, how long leftover holders of its pipes may keep us reading
SPAWN_RETRY = 0.5  # how long a start waits out an EAGAIN (a killed tree's zombies not yet reaped)
FINISHED_KEPT = 64
ORIGINS_KEPT = 256  # roots whose leftovers a reclaim can still name (see `room`)
COMMAND_SHOWN = 200  # characters of a command line a reclaim notice shows
RECLAIMS = 3  # per start: how often a refused spawn asks for room before it calls the limit reached


# -- reaping ---------------------------------------------------------------------------------------


class Reaper:
    """Owns `waitpid(-1)`; hands each exit status to the process it belongs to and reaps orphans."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held while spawning, so a fast exit is never reaped unregistered
        self.registry: dict[int, Process] = {}
        self.have_children = threading.Event()
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.have_children.clear()
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self.have_children.wait()
                continue
            with self.lock:
                proc = self.registry.pop(pid, None)
            if proc is not None:
                proc.on_exit(status)


# -- the table of processes ---------------------------------------------------------------------


class ProcessTable:
    def __init__(self) -> None:
        self.reaper = Reaper()
        self.processes: dict[str, Process] = {}
        self.finished: collections.deque[str] = collections.deque()
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._claimed: set[str] = set()  # tags of processes being spawned (not in `processes` yet)
        # Root pid -> (id, command line) of recent commands: whose leftovers a reclaim stopped (see `room`).
        self.origins: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        self._reclaimed: list[dict[str, Any]] = []  # stopped, not yet told to a command's result
        self._room_lock = threading.Lock()  # one reclaim at a time: a second caller finds the room made

    # -- room under the pids limit (see `room`) ----------------------------------------------------

    def make_room(self) -> bool:
        """Stop leftovers of ended commands, largest session first, until the pids limit has its headroom again;
        True when a retry may succeed (room made, by us or by another caller meanwhile)."""
        with self._room_lock, privileged():  # whoever the calling request acts as, the agent kills leftovers
            free, want = room.room()
            if free is not None and free >= want:
                return True
            reclaim = room.Reclaim(self._snapshot)
            sessions = reclaim.choose(want, free)
            if not sessions:
                return False
            reclaim.stop(sessions)
            self.reaper.have_children.set()  # the killed are our children now: the reaper must collect them
            room.settle(want)
            with self.lock:
                entries = room.notice(reclaim.killed, dict(self.origins))
                self._reclaimed = (self._reclaimed + entries)[-room.NOTICE_KEPT:]
            return bool(entries)

    def take_reclaimed(self) -> list[dict[str, Any]]:
        """What reclaims stopped since the last call: the next command's result tells it."""
        with self.lock:
            found, self._reclaimed = self._reclaimed, []
        return found

    def start_thread(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> threading.Thread:
        """`threads.start`, making room once if the pids limit refuses the thread (RuntimeError if still full)."""
        if room.room_is_short():
            self.make_room()
        try:
            return threads.start(target, *args, name=name)
        except RuntimeError:
            if not self.make_room():
                raise
            return threads.start(target, *args, name=name)

    def _snapshot(self) -> tuple[set[int], dict[int, tuple[int, str, int]]]:
        """The live roots and the sandbox's processes, read while no spawn is half-way to registering its root."""
        with self.reaper.lock:
            return set(self.reaper.registry), room.processes()

    def _remember(self, proc: Process) -> None:
        argv = proc.argv
        line = argv[2] if len(argv) == 3 and argv[:2] == ["/bin/bash", "-lc"] else " ".join(argv)
        with self.lock:
            self.origins.pop(proc.pid, None)
            self.origins[proc.pid] = (proc.id, line[:COMMAND_SHOWN])
            while len(self.origins) > ORIGINS_KEPT:
                self.origins.popitem(last=False)

    def spawn(self, req: dict[str, Any]) -> Process:
        """Start the command `req` describes. Its environment: the base, then `env` (the sandbox's), then
        `cmd_env` (the command's own, which `ps` shows); `tag` names it, unique among running processes."""
        tag = check_tag(req.get("tag"))
        self._claim(tag)
        try:
            proc, env = self._prepare(req, tag)
            self._start(proc, env, req)
            self._remember(proc)
            with self.lock:
                self.processes[proc.id] = proc
        finally:
            self._release(tag)
        return proc

    def _prepare(self, req: dict[str, Any], tag: str | None) -> tuple[Process, dict[str, str]]:
        """The process `req` asks for (checked, not started yet) and the environment it runs with."""
        argv = build_argv(req.get("cmd"))
        user = resolve_user(req.get("user"))
        cwd = req.get("cwd") or "/workspace"
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise ProcessError("invalid_request", f"working directory {cwd!r} does not exist in the sandbox")
        own_env = build_env(req.get("cmd_env"), base={})
        env = {**build_env(req.get("env"), base=user.base_env()), **own_env}
        timeout = positive_or_none(req.get("timeout"), "timeout")
        max_output = int(req.get("max_output") or DEFAULT_MAX_OUTPUT)
        if max_output < 4:
            raise ProcessError("invalid_request", "max_output must be at least 4 bytes")
        proc = Process(str(next(self._ids)), argv, background=bool(req.get("background")), timeout=timeout,
                       max_output=max_output, is_pty=req.get("pty") is not None, cwd=cwd, env=own_env, tag=tag,
                       user=user)
        return proc, env

    def _start(self, proc: Process, env: dict[str, str], req: dict[str, Any]) -> None:
        try:
            if proc.is_pty:
                env.setdefault("TERM", "xterm-256color")
                self._spawn_pty(proc, env, proc.cwd, req["pty"])
            else:
                self._spawn_pipes(proc, env, proc.cwd, want_stdin=bool(req.get("stdin")))
        except BaseException:  # it never ran, so no pump will close its wake pipe
            proc.close_wake()
            raise

    def spawn_on(self, proc: Process, env: dict[str, str], stdio: tuple[int, int, int]) -> None:
        """Start `proc` on descriptors it was handed (`sudo`'s caller's): nothing is kept of its output, and it is
        no process of the table (not listed, not named): only the reaper knows it. Its owner closes its wake pipe
        (`close_wake`) once it has exited."""
        try:
            self._spawn(proc, env, proc.cwd, stdio, tty=False)
        except BaseException:
            proc.close_wake()
            raise

    def _claim(self, tag: str | None) -> None:
        """Hold `tag` for a process about to start: a running process (or a start under way) with it is a
        conflict, found before anything is spawned."""
        if tag is None:
            return
        with self.lock:
            taken = tag in self._claimed or any(p.tag == tag and not p.done.is_set()
                                                for p in self.processes.values())
            if taken:
                raise ProcessError("conflict", f"a running process already has the tag {tag!r}; tags name one "
                                   "running process each")
            self._claimed.add(tag)

    def _release(self, tag: str | None) -> None:
        if tag is not None:
            with self.lock:
                self._claimed.discard(tag)

    def pump(self, proc: Process) -> None:
        """Start moving output; call after attaching sinks (until then output waits in the pipes)."""
        try:
            self.start_thread(self._pump, proc, name=f"pump-{proc.id}")
        except RuntimeError:  # no thread to be had under a full pids limit: do not leave it running unwatched
            kill_tree(proc.pid)
            self._pump(proc)  # inline: closes its pipes once the killed tree is gone
            raise ProcessError("quota_exceeded", "the sandbox's process limit is reached") from None

    def pump_here(self, proc: Process, watch_fd: int, on_readable: Callable[[], bool]) -> None:
        """Move output in this thread, also watching `watch_fd` (the host's socket): one thread per command.

        `on_readable` handles what arrived there and returns False once that fd is finished with.
        """
        self._pump(proc, watch=(watch_fd, on_readable))

    def _spawn_pipes(self, proc: Process, env: dict[str, str], cwd: str, *, want_stdin: bool) -> None:
        stdin_r, stdin_w = os.pipe() if want_stdin else (os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._spawn(proc, env, cwd, (stdin_r, out_w, err_w), tty=False)
        except BaseException:
            for fd in (stdin_w, out_r, err_r):
                close_quietly(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):  # the child's ends
                close_quietly(fd)
        proc.stdin_fd = stdin_w if want_stdin else None
        proc.fds = {out_r: "stdout", err_r: "stderr"}

    def _spawn_pty(self, proc: Process, env: dict[str, str], cwd: str, size: Any) -> None:
        rows, cols = pty_size(size)
        master, slave = os.openpty()
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        try:
            self._spawn(proc, env, cwd, (slave, slave, slave), tty=True)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        proc.master_fd = master
        proc.fds = {master: "stdout"}

    def _spawn(self, proc: Process, env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
               tty: bool) -> None:
        argv = proc.argv
        # Check here: through the shim a missing program would only show as exit code 127.
        found = which(argv[0], env.get("PATH", "")) if "/" not in argv[0] else argv[0]
        if found is None or not os.path.exists(found):
            raise ProcessError("invalid_request", f"command not found: {argv[0]}")
        # A root agent starts the user's commands through a drop to the user's ids; root's keep the agent's own.
        drop = proc.user if AGENT_IS_ROOT and proc.user is not ROOT else None
        # The agent's own authority to start it (the request's thread may act as the user): the spawn helper
        # drops to the process's user itself.
        # A tree killed a moment ago leaves zombies that count against pids.max until the reaper collects them:
        # an EAGAIN then is transient, so retry for a short, bounded while (outside the reaper's lock, which
        # the reaper needs to hand out what it collects) before calling the limit reached.
        # Leftovers of ended commands at the limit are stopped first (`make_room`), before the spawn if the
        # limit is known to be nearly reached, else once it refuses.
        if room.room_is_short():
            self.make_room()
        deadline = time.monotonic() + SPAWN_RETRY
        pause = 0.005
        reclaims = 0
        while True:
            try:
                self._spawn_registered(proc, argv, env, cwd, stdio, tty=tty, drop=drop)
                break
            except OSError as exc:
                if exc.errno == errno.EAGAIN and reclaims < RECLAIMS and self.make_room():
                    reclaims += 1
                    deadline = time.monotonic() + SPAWN_RETRY
                    continue
                if exc.errno == errno.EAGAIN and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause *= 2
                    continue
                if exc.errno == errno.EAGAIN:
                    raise ProcessError("quota_exceeded", "the sandbox's process limit is reached") from exc
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise ProcessError("permission_denied", f"cannot execute {argv[0]}: permission denied") from exc
                raise ProcessError("server_error", f"could not start {argv[0]}: {exc}") from exc
        self.reaper.have_children.set()

    def _spawn_registered(self, proc: Process, argv: list[str], env: dict[str, str], cwd: str,
                          stdio: tuple[int, int, int], *, tty: bool, drop: User | None) -> None:
        with self.reaper.lock, privileged():  # held until registered: a fast exit is never reaped unregistered
            if os.access(SPAWN_SHIM, os.X_OK):
                pid = posix_spawn(argv, env, cwd, stdio, tty=tty, drop=drop)
            else:
                pid = popen_fallback(argv, env, cwd, stdio, tty=tty, drop=drop)
            proc.pid = pid
            self.reaper.registry[pid] = proc

    def _pump(self, proc: Process, watch: tuple[int, Callable[[], bool]] | None = None) -> None:
        fds = proc.fds
        sel = select.epoll()
        for fd in fds:
            sel.register(fd, select.EPOLLIN)
        sel.register(proc._wake_r, select.EPOLLIN)
        if watch is not None:
            sel.register(watch[0], select.EPOLLIN)
        open_fds = set(fds)
        exit_deadline: float | None = None
        try:
            while open_fds:
                now = time.monotonic()
                if proc.status is not None and exit_deadline is None:
                    exit_deadline = now + EXIT_GRACE
                if exit_deadline is not None and now >= exit_deadline:
                    break
                if proc.deadline is not None and proc.status is None and now >= proc.deadline:
                    proc.kill_tree(timed_out=True)
                    proc.deadline = None
                wait = _min_wait(now, proc.deadline if proc.status is None else None, exit_deadline)
                for fd, _ in sel.poll(_epoll_timeout(wait)):
                    if fd == proc._wake_r:
                        _drain_wake(fd)
                        continue
                    if watch is not None and fd == watch[0]:
                        if not watch[1]():
                            sel.unregister(fd)
                            watch = None
                        continue
                    if not self._read_into(proc, fd, fds[fd]):
                        sel.unregister(fd)
                        open_fds.discard(fd)
            # Pipes are closed (or held by leftovers past the grace): now wait for the root's exit itself.
            while proc.status is None:
                now = time.monotonic()
                if proc.deadline is not None and now >= proc.deadline:
                    proc.kill_tree(timed_out=True)
                    proc.deadline = None
                for fd, _ in sel.poll(_epoll_timeout(_min_wait(now, proc.deadline, None))):
                    if fd == proc._wake_r:
                        _drain_wake(fd)
                    elif watch is not None and fd == watch[0] and not watch[1]():
                        sel.unregister(fd)
                        watch = None
        finally:
            sel.close()
            for fd in fds:
                close_quietly(fd)
            proc.master_fd = None
            if not proc.is_pty:
                proc.close_stdin()
            close_quietly(proc._wake_r)
            close_quietly(proc._wake_w)
            with proc.lock:  # with the lock: a follower registering now either sees `done` or is called
                proc.done.set()
                callbacks = list(proc.on_done)
            self._retire(proc)
            for callback in callbacks:
                callback()

    def _read_into(self, proc: Process, fd: int, stream: str) -> bool:
        try:
            data = os.read(fd, 1024 * 1024)
        except OSError as exc:
            if exc.errno == errno.EIO:  # a PTY whose last slave closed
                return False
            raise
        if not data:
            return False
        buf = proc.stdout if stream == "stdout" else proc.stderr
        with proc.lock:
            live = buf.feed(data)
            sinks = list(proc.sinks) if live else []
            follow = list(proc.follow)
        for sink in sinks:
            sink(stream, live)
        for sink in follow:
            sink(stream, data)
        return True

    def _retire(self, proc: Process) -> None:
        with self.lock:
            if not proc.background:
                self.processes.pop(proc.id, None)
                return
            self.finished.append(proc.id)
            while len(self.finished) > FINISHED_KEPT:
                self.processes.pop(self.finished.popleft(), None)

    def get(self, pid_id: Any) -> Process:
        with self.lock:
            proc = self.processes.get(str(pid_id))
        if proc is None:
            raise ProcessError("not_found", f"no process with id {pid_id!r} in this sandbox")
        return proc

    def find(self, req: dict[str, Any]) -> Process:
        """The process `req` names by exactly one of `id` (ours), `pid` (inside the sandbox) or `tag`.

        A pid or a tag may have named a finished process before a running one (pids are reused, tags are free
        again once their process ends): the running one wins, else the newest.
        """
        given = [key for key in ("id", "pid", "tag") if req.get(key) is not None]
        if len(given) != 1:
            raise ProcessError("invalid_request", "name the process by exactly one of id, pid or tag")
        key = given[0]
        if key == "id":
            return self.get(req["id"])
        value = req[key]
        if key == "pid" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ProcessError("invalid_request", f"pid must be a positive integer, not {value!r}")
        with self.lock:
            found = [p for p in self.processes.values() if getattr(p, key) == value]
        running = [p for p in found if not p.done.is_set()]
        if not found:
            raise ProcessError("not_found", f"no process with {key} {value!r} in this sandbox")
        return (running or found)[-1]

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            procs = list(self.processes.values())
        return [p.info() for p in procs]


def _min_wait(now: float, *deadlines: float | None) -> float | None:
    waits = [d - now for d in deadlines if d is not None]
    return max(0.0, min(waits)) if waits else None

def _epoll_timeout(wait: float | None) -> float:
    return -1 if wait is None else wait


def _drain_wake(fd: int) -> None:
    try:
        os.read(fd, 64)
    except BlockingIOError:
        pass
