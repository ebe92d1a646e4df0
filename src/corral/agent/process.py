"""`Process`: one command in the sandbox, its kept output (`OutputBuffer`s), its stdin or terminal, its exit
status (handed over by the reaper), and the signals and kills sent to it; `decode_status`, its status as the wire
says it."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import termios
import threading
import time
from collections.abc import Callable

from .output import OutputBuffer
from .process_requests import ProcessError
from .tree import kill_tree
from .users import USER, User, privileged

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

REAP_WAIT = 5.0  # after a SIGKILL, how long `kill` waits for the root's exit status (a D-state root may linger)


Sink = Callable[[str, bytes], None]  # (stream name, bytes) -> None


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
            close_quietly(fd)

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
        close_quietly(self._wake_r)
        close_quietly(self._wake_w)

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


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
