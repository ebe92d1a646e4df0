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

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
# Signal numbers as plain ints: the `signal` module builds enums on import, and every import here delays
# every sandbox's start. Linux numbering (the agent only runs on Linux).
SIGKILL, SIGSTOP, SIGPIPE, SIGXFSZ = 9, 19, 13, 25
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
EXIT_GRACE = 0.1  # after the root exits, how long leftover holders of its pipes may keep us reading
KILL_PASSES = 200
FINISHED_KEPT = 64
CHILD_OOM_SCORE_ADJ = 500
# Built by the host from spawn.c next to this file; see there for why. Absent: fall back to preexec_fn.
SPAWN_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corral-spawn")

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/user",
    "USER": "user",
    "LOGNAME": "user",
    "SHELL": "/bin/bash",
    "LANG": "C.UTF-8",
}


class ProcessError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def set_dumpable(on: bool) -> None:
    _libc.prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)


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
    """A command and its kept output; foreground processes also stream to a live sink."""

    def __init__(self, pid_id: str, argv: list[str], *, background: bool, timeout: float | None,
                 max_output: int, is_pty: bool) -> None:
        self.id = pid_id
        self.argv = argv
        self.background = background
        self.is_pty = is_pty
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
        self.lock = threading.Lock()
        self.fds: dict[int, str] = {}  # our read ends: fd -> "stdout" | "stderr"
        self.sinks: list[Sink] = []
        self.follow: list[Sink] = []  # attached followers get every byte, not only the head
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # -- called by the reaper thread -------------------------------------------------------------

    def on_exit(self, status: int) -> None:
        self.status = status
        self.duration = time.monotonic() - self.started
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
        }

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pid": self.pid,
            "argv": self.argv,
            "background": self.background,
            "pty": self.is_pty,
            "running": not self.done.is_set(),
            "started_at": self.started_wall,
            "exit": self.result() if self.done.is_set() else None,
        }

    # -- control -----------------------------------------------------------------------------------

    def write_stdin(self, data: bytes) -> None:
        fd = self.master_fd if self.is_pty else self.stdin_fd
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
        if self.master_fd is None:
            raise ProcessError("conflict", "resize needs a process started with a PTY")
        fcntl.ioctl(self.master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def signal(self, sig: int) -> None:
        if not self.done.is_set() and self.pid:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill_tree(self, *, timed_out: bool = False) -> None:
        if self.done.is_set():
            return
        self.timed_out = self.timed_out or timed_out
        self.killed = self.killed or not timed_out
        kill_tree(self.pid)


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


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process we can see."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: split after the last ')'.
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) >= 2:
            table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int) -> list[int]:
    table = _proc_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, state) in table.items():
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

    def spawn(self, req: dict[str, Any]) -> Process:
        argv = build_argv(req.get("cmd"))
        cwd = req.get("cwd") or "/workspace"
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise ProcessError("invalid_request", f"working directory {cwd!r} does not exist in the sandbox")
        env = build_env(req.get("env"))
        timeout = _positive_or_none(req.get("timeout"), "timeout")
        max_output = int(req.get("max_output") or DEFAULT_MAX_OUTPUT)
        if max_output < 4:
            raise ProcessError("invalid_request", "max_output must be at least 4 bytes")
        pty_size = req.get("pty")
        proc = Process(str(next(self._ids)), argv, background=bool(req.get("background")),
                       timeout=timeout, max_output=max_output, is_pty=pty_size is not None)
        if pty_size is not None:
            env.setdefault("TERM", "xterm-256color")
            self._spawn_pty(proc, env, cwd, pty_size)
        else:
            self._spawn_pipes(proc, env, cwd, want_stdin=bool(req.get("stdin")))
        with self.lock:
            self.processes[proc.id] = proc
        return proc

    def pump(self, proc: Process) -> None:
        """Start moving output; call after attaching sinks (until then output waits in the pipes)."""
        try:
            threading.Thread(target=self._pump, args=(proc,), name=f"pump-{proc.id}", daemon=True).start()
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
        rows, cols = _pty_size(size)
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
        with self.reaper.lock:  # held until registered: a fast exit is never reaped as an unknown orphan
            try:
                if os.access(SPAWN_SHIM, os.X_OK):
                    pid = _posix_spawn(argv, env, cwd, stdio, tty=tty)
                else:
                    pid = _popen_fallback(argv, env, cwd, stdio, tty=tty)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    raise ProcessError("quota_exceeded", "the sandbox's process limit is reached") from exc
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise ProcessError("permission_denied", f"cannot execute {argv[0]}: permission denied") from exc
                raise ProcessError("server_error", f"could not start {argv[0]}: {exc}") from exc
            proc.pid = pid
            self.reaper.registry[pid] = proc
        self.reaper.have_children.set()

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
            proc.done.set()
            self._retire(proc)

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


def _pty_size(size: Any) -> tuple[int, int]:
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


def build_env(extra: Any) -> dict[str, str]:
    env = dict(BASE_ENV)
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
                 tty: bool) -> int:
    shim_args = [SPAWN_SHIM, *(["--tty"] if tty else []), "--cwd", cwd, "--", *argv]
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)]
    # Python ignores SIGPIPE and SIGXFSZ for itself; commands must get the default actions back.
    return os.posix_spawn(SPAWN_SHIM, shim_args, env, file_actions=actions, setsid=True,
                          setsigdef=(SIGPIPE, SIGXFSZ))


def _popen_fallback(argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int], *,
                    tty: bool) -> int:
    """Without the shim: subprocess with a preexec_fn (a full fork of the agent: slower, same result)."""
    import subprocess

    popen = subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], cwd=cwd, env=env,
                             close_fds=True, start_new_session=True,
                             preexec_fn=_child_setup_tty if tty else _child_setup)
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


def _child_setup() -> None:
    # Runs in the child between fork and exec: make the root a subreaper (see module docstring), the OOM
    # killer's first choice over us (if PID 1 died the whole sandbox would go), and dumpable again.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(CHILD_OOM_SCORE_ADJ))
    except OSError:
        pass


def _child_setup_tty() -> None:
    _child_setup()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
