"""Processes inside the sandbox: spawn, reap, cap output, enforce timeouts, kill whole trees.

Every command's root process is a *child subreaper*: anything it double-forks or `setsid`s away is re-parented
to the root, not to us, so the whole tree stays findable under the root's pid until the root exits. A timeout
or kill walks `/proc` for the root's descendants and SIGKILLs them until none is left, then the root.

One reaper thread owns `waitpid(-1)`: we are PID 1, so we must reap orphans, and a single owner means no exit
status is ever stolen from the process it belongs to.
"""

from __future__ import annotations

import collections
import ctypes
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
from .users import AGENT_IS_ROOT, ROOT, USER, User, named, privileged

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
# Signal numbers as plain ints: the `signal` module builds enums on import, and every import here delays
# every sandbox's start. Linux numbering (the agent only runs on Linux).
SIGINT, SIGKILL, SIGSTOP, SIGPIPE, SIGXFSZ = 2, 9, 19, 13, 25
# What the agent ignores or handles for itself and every command must get back at its default (see `__main__`).
CHILD_DEFAULT_SIGNALS = (SIGINT, SIGPIPE, SIGXFSZ)
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_CAPBSET_DROP = 24
SIG_DFL = 0

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
EXIT_GRACE = 0.1  # after the root exits, how long leftover holders of its pipes may keep us reading
KILL_PASSES = 200
SPAWN_RETRY = 0.5  # how long a start waits out an EAGAIN (a killed tree's zombies not yet reaped)
REAP_WAIT = 5.0  # after a SIGKILL, how long `kill` waits for the root's exit status (a D-state root may linger)
FINISHED_KEPT = 64
ORIGINS_KEPT = 256  # roots whose leftovers a reclaim can still name (see `room`)
COMMAND_SHOWN = 200  # characters of a command line a reclaim notice shows
RECLAIMS = 3  # per start: how often a refused spawn asks for room before it calls the limit reached
MAX_TAG = 256
CHILD_OOM_SCORE_ADJ = 500
# Built by the host from spawn.c next to this file; see there for why. Absent: fall back to preexec_fn.
SPAWN_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corral-spawn")

BASE_ENV = USER.base_env()
ROOT_NOT_ENABLED = ("this sandbox was created without root: its commands and files act as the user 'user' "
                    "(uid 1000); create the sandbox with root=True to run as root")


class ProcessError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def set_dumpable(on: bool) -> None:
    _libc.prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)


def resolve_user(name: Any) -> User:
    """The user a request names (none: the sandbox user); root only in a sandbox created with it."""
    user = named(name)
    if user is None:
        shown = name[:64] if isinstance(name, str) else name
        raise ProcessError("invalid_request", f"unknown user {shown!r}: a sandbox has the users 'user' and 'root'")
    if user is ROOT and not AGENT_IS_ROOT:
        raise ProcessError("permission_denied", ROOT_NOT_ENABLED)
    return user


Sink = Callable[[str, bytes], None]  # (stream name, bytes) -> None


class OutputBuffer:
    """One stream's kept bytes: a head (streamed live) and a tail ring, plus the true total size."""

    def __init__(self, max_output: int) -> None:
        self.tail_cap = max_output // 4
        self.head_cap = max_output - self.tail_cap
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_len = 0
        self.total = 0

    def feed(self, data: bytes) -> bytes:
        """Keep `data`; return the part of it that belongs to the head (what may be streamed live)."""
        self.total += len(data)
        room = self.head_cap - len(self.head)
        live = data[:room] if room > 0 else b""
        self.head += live
        rest = data[len(live) :]
        if rest and self.tail_cap:
            self.tail.append(rest)
            self.tail_len += len(rest)
            self._trim()
        return live

    def _trim(self) -> None:
        while self.tail_len - len(self.tail[0]) >= self.tail_cap:
            self.tail_len -= len(self.tail.popleft())
        excess = self.tail_len - self.tail_cap
        if excess > 0:
            self.tail[0] = self.tail[0][excess:]
            self.tail_len -= excess

    @property
    def omitted(self) -> int:
        return self.total - len(self.head) - self.tail_len

    def tail_bytes(self) -> bytes:
        return b"".join(self.tail)


class Process:
    """A command and its kept output; foreground processes also stream to a live sink.

    `env` is the command's own environment (what it asked for on top of the base and the sandbox's), `tag` the
    name it was started under, if any: both are what `ps` shows, not what it runs with.
    """

    def __init__(self, pid_id: str, argv: list[str], *, background: bool, timeout: float | None,
                 max_output: int, is_pty: bool, cwd: str = "/workspace", env: dict[str, str] | None = None,
                 tag: str | None = None, user: User = USER) -> None:
        self.id = pid_id
        self.user = user
        self.argv = argv
        self.background = background
        self.is_pty = is_pty
        self.cwd = cwd
        self.env = env or {}
        self.tag = tag
        self.max_output = max_output
        self.pid = 0
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.deadline = None if timeout is None else self.started + timeout
        self.stdout = OutputBuffer(max_output)
        self.stderr = OutputBuffer(max_output)
        self.stdin_fd: int | None = None
        self.master_fd: int | None = None
        self.status: int | None = None
        self.timed_out = False
        self.killed = False
        self.duration = 0.0
        self.done = threading.Event()
        self.exited = threading.Event()  # the root's exit status is in: its pid is free again (no zombie)
        self.lock = threading.Lock()
        self.fds: dict[int, str] = {}  # our read ends: fd -> "stdout" | "stderr"
        self.sinks: list[Sink] = []
        self.follow: list[Sink] = []  # attached followers get every byte, not only the head
        self.on_done: list[Callable[[], None]] = []  # called (without the lock) once `done` is set
        self.reclaimed: list[dict[str, Any]] = []  # what was stopped to make room for it (`room.notice`)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # -- called by the reaper thread -------------------------------------------------------------

    def on_exit(self, status: int) -> None:
        self.status = status
        self.duration = time.monotonic() - self.started
        self.exited.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- results -----------------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        code, sig = decode_status(self.status)
        return {
            "event": "exit",
            "id": self.id,
            "pid": self.pid,
            "exit_code": code,
            "signal": sig,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "duration": round(self.duration, 6),
            "stdout_size": self.stdout.total,
            "stderr_size": self.stderr.total,
            "truncated": bool(self.stdout.omitted or self.stderr.omitted),
            **({"reclaimed": self.reclaimed} if self.reclaimed else {}),
        }

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pid": self.pid,
            "tag": self.tag,
            "argv": self.argv,
            "cwd": self.cwd,
            "env": self.env,
            "background": self.background,
            "pty": self.is_pty,
            "running": not self.done.is_set(),
            "started_at": self.started_wall,
            "exit": self.result() if self.done.is_set() else None,
        }

    # -- control -----------------------------------------------------------------------------------

    def write_stdin(self, data: bytes) -> None:
        fd = self.master_fd if self.is_pty else self.stdin_fd
        if fd is None and self.is_pty:
            raise ProcessError("conflict", f"process {self.id} has ended; its terminal is gone")
        if fd is None:
            raise ProcessError("conflict", "this process was started without stdin")
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except BrokenPipeError:
                return  # the process stopped reading; the bytes have nowhere to go
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.EBADF):
                    return
                raise
            view = view[n:]

    def close_stdin(self) -> None:
        if self.is_pty:
            if self.master_fd is not None:
                self.write_stdin(b"\x04")  # ^D: a terminal has no half-close
            return
        fd, self.stdin_fd = self.stdin_fd, None
        if fd is not None:
            _close_quietly(fd)

    def resize(self, rows: int, cols: int) -> None:
        if not self.is_pty:
            raise ProcessError("conflict", "resize needs a process started with a PTY")
        fd = self.master_fd
        try:
            if fd is None:
                raise OSError(errno.EBADF, "closed")
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        except OSError as exc:  # its terminal is closed: the process ended (maybe while we looked)
            raise ProcessError("conflict", f"process {self.id} has ended; its terminal is gone") from exc

    def signal(self, sig: int) -> None:
        """`sig` to the process group the root leads (its own session: the command and its jobs)."""
        if not self.exited.is_set() and self.pid:
            try:
                with privileged():  # a request acting as the user may signal root's processes too
                    os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def close_wake(self) -> None:
        """Close the wake pipe, for a process no pump ever moves (its pump closes it otherwise)."""
        _close_quietly(self._wake_r)
        _close_quietly(self._wake_w)

    def check_stdin_closable(self) -> None:
        """Refuse a host's request to close a terminal's input: a terminal has no EOF (its ^D is input)."""
        if self.is_pty:
            raise ProcessError("invalid_request", f"process {self.id} runs in a terminal, whose input cannot be "
                               "closed; send Ctrl-D (the byte 0x04) as input to end it instead")

    def kill_tree(self, *, timed_out: bool = False) -> None:
        # Once the root is reaped its pid may be another process's: never signal it again.
        if self.done.is_set() or self.exited.is_set():
            return
        self.timed_out = self.timed_out or timed_out
        self.killed = self.killed or not timed_out
        kill_tree(self.pid)

    def kill_and_reap(self) -> bool:
        """SIGKILL the tree and wait (bounded) until the root's exit status is collected, so that its pid no
        longer answers (`kill -0`) when the caller hears back, and its end is recorded (no longer running, its
        tag free). False: the root outlived the wait."""
        deadline = time.monotonic() + REAP_WAIT
        self.kill_tree()
        reaped = self.exited.wait(REAP_WAIT)
        self.done.wait(max(0.0, deadline - time.monotonic()))  # follows within EXIT_GRACE, unless output stalls
        return reaped


def decode_status(status: int | None) -> tuple[int | None, int | None]:
    if status is None:
        return None, None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# -- the process tree -------------------------------------------------------------------------------


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, state, _) in room.processes().items():  # never PID 1: it descends from no one
        if state != "Z":
            children[ppid].append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(root: int) -> None:
    """SIGKILL every descendant of `root` until none is left, then `root` itself.

    The root is a subreaper, so escaped (setsid, double-forked) children hang under it while it lives: kill it
    last. Bounded: a tree that keeps forking is stopped by the pids limit long before the passes run out.
    """
    with privileged():  # whoever the calling request acts as, the agent kills any tree
        _kill_tree(root)


def _kill_tree(root: int) -> None:
    # Stop the root first: it must stay alive (as the subreaper holding the tree) until the tree is gone, and
    # stopped it cannot spawn more. Killing its process group first would re-parent escapees to us.
    try:
        os.kill(root, SIGSTOP)
    except OSError:
        pass
    for _ in range(KILL_PASSES):
        tree = descendants(root)
        if not tree:
            break
        for pid in tree:
            try:
                os.kill(pid, SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)
    try:
        os.kill(root, SIGKILL)
    except OSError:
        pass


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
        tag = _check_tag(req.get("tag"))
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
        timeout = _positive_or_none(req.get("timeout"), "timeout")
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
                _close_quietly(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):  # the child's ends
                _close_quietly(fd)
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
        found = _which(argv[0], env.get("PATH", "")) if "/" not in argv[0] else argv[0]
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
                pid = _posix_spawn(argv, env, cwd, stdio, tty=tty, drop=drop)
            else:
                pid = _popen_fallback(argv, env, cwd, stdio, tty=tty, drop=drop)
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
                _close_quietly(fd)
            proc.master_fd = None
            if not proc.is_pty:
                proc.close_stdin()
            _close_quietly(proc._wake_r)
            _close_quietly(proc._wake_w)
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


def _positive_or_none(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ProcessError("invalid_request", f"{name} must be a positive number of seconds")
    return float(value)


def pty_size(size: Any) -> tuple[int, int]:
    try:
        rows, cols = int(size["rows"]), int(size["cols"])
    except (TypeError, KeyError, ValueError) as exc:
        raise ProcessError("invalid_request", "pty needs {'rows': int, 'cols': int}") from exc
    if not (0 < rows < 10000 and 0 < cols < 10000):
        raise ProcessError("invalid_request", "pty rows and cols must be between 1 and 9999")
    return rows, cols


def build_argv(cmd: Any) -> list[str]:
    if isinstance(cmd, str):
        _check_text(cmd, "command")
        return ["/bin/bash", "-lc", cmd]
    if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
        for arg in cmd:
            _check_text(arg, "argument")
        return list(cmd)
    raise ProcessError("invalid_request", "cmd must be a shell string or a non-empty list of strings")


def _check_tag(tag: Any) -> str | None:
    if tag is None:
        return None
    if not isinstance(tag, str) or not 0 < len(tag) <= MAX_TAG:
        raise ProcessError("invalid_request", f"tag must be a string of 1 to {MAX_TAG} characters")
    _check_text(tag, "tag")
    return tag


def build_env(extra: Any, *, base: dict[str, str] = BASE_ENV) -> dict[str, str]:
    env = dict(base)
    if extra is None:
        return env
    if not isinstance(extra, dict):
        raise ProcessError("invalid_request", "env must be an object of strings")
    for key, value in extra.items():
        if not isinstance(value, str) or not key or "=" in key:
            raise ProcessError("invalid_request", f"bad environment variable {key!r}")
        _check_text(key, "environment variable name")
        _check_text(value, f"environment variable {key}")
        env[key] = value
    return env


def _check_text(value: str, what: str) -> None:
    if "\x00" in value:
        raise ProcessError("invalid_request", f"{what} contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProcessError("invalid_request", f"{what} is not valid UTF-8") from exc


def _posix_spawn(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
                 tty: bool, drop: User | None = None) -> int:
    user = ["--user", f"{drop.uid}:{drop.gid}"] if drop is not None else []
    shim_args = [SPAWN_SHIM, *(["--tty"] if tty else []), *user, "--cwd", cwd, "--", *argv]
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)]
    # The agent ignores SIGINT, SIGPIPE and SIGXFSZ for itself; commands must get the default actions back.
    return os.posix_spawn(SPAWN_SHIM, shim_args, env, file_actions=actions, setsid=True,
                          setsigdef=CHILD_DEFAULT_SIGNALS)


def _popen_fallback(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
                    tty: bool, drop: User | None = None) -> int:
    """Without the shim: subprocess with a preexec_fn (a full fork of the agent: slower, same result)."""
    import subprocess

    def setup() -> None:
        _child_setup(drop)
        if tty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    popen = subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], cwd=cwd, env=env,
                             close_fds=True, start_new_session=True, preexec_fn=setup)
    popen.returncode = 0  # the reaper owns the exit status; stop Popen from ever waiting on it
    return popen.pid


def _epoll_timeout(wait: float | None) -> float:
    return -1 if wait is None else wait


def _drain_wake(fd: int) -> None:
    try:
        os.read(fd, 64)
    except BlockingIOError:
        pass


def _which(name: str, path: str) -> str | None:
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _child_setup(drop: User | None) -> None:
    # Runs in the child between fork and exec: make the root a subreaper (see module docstring), the OOM
    # killer's first choice over us (if PID 1 died the whole sandbox would go), the user's (as the shim does:
    # `drop_privileges`), with the signal the agent ignores back at its default, and dumpable again.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(CHILD_OOM_SCORE_ADJ))
    except OSError:
        pass
    if drop is not None:
        drop_privileges(drop)
    _libc.signal(SIGINT, SIG_DFL)
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def drop_privileges(user: User) -> None:
    """Become `user` for good: an empty bounding set (while CAP_SETPCAP is still ours), no supplementary
    groups, its gid, then its uid, which clears the permitted and effective sets (no SECBIT_KEEP_CAPS)."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the kernel's last capability, all dropped
        raise OSError(ctypes.get_errno(), "cannot drop the capability bounding set")
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)
