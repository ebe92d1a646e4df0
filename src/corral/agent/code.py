"""Code sessions: stateful interpreters in code contexts, each session its own process running `agent/kernel.py`
(docs/code.md).

A context is what a session is started as: an id, a language, a working directory (and kernel options). It is
created explicitly (`code_context_create`), or by the first cell that names it; each language has a default
context (`languages.default_context`), and the default python and javascript ones are listed before they ever
ran. Its session (the process) starts with its first cell; restarting or a crash ends only the process, and the
next cell starts a fresh one in the same context; closing removes the context.

A session is spawned like any command (sandbox user, subreaper root in its own process group), so an OOM or a
crash takes only that session. Its stdin carries cells as `REQUEST` frames; its stdout carries the agent's own
frames back, which are relayed to the host as they come. One cell runs at a time per session; a cell whose host
goes away (or whose timeout passes) is interrupted, and killed 2 s later if it does not stop.

Compiled languages (`c`, `cpp`; `java`, `go`, `rust`, `typescript` with the polyglot template) outside a context
have no session: each call writes the code to a fresh temporary directory, compiles it there and runs the program
(as a command, like exec), with the call's `stdin_b64` as its stdin (`programs.py`). In a context, java and
typescript are sessions (a JShell, a node whose cells lose their types). What a request carries is checked by
`code_requests.py`.

Ops: `code_run`, `code_interrupt`, `code_restart`, `code_close`, `code_list` (running sessions),
`code_context_create`, `code_contexts` (every context, the listed defaults first).
"""

from __future__ import annotations

import os
import select
import threading
import time

from . import languages, protocol
from .channel import Channel, relay
from .code_requests import (
    check_available,
    checked_cell_env,
    checked_cwd,
    checked_name,
    kernel_options,
    language_of,
    missing_tool,
    tool_path,
)
from .process import Process, close_quietly, decode_status
from .process_requests import ProcessError
from .processes import ProcessTable
from .programs import COMPILERS, run_program
from .spawn import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIGINT = 2
MSG_PEEK, MSG_DONTWAIT = 2, 64
LANGUAGES = ("python", "bash", "javascript", *COMPILERS, "r")
UNKNOWN_HINT = "(Java, Go, Rust and TypeScript need the polyglot template, and so does R)"
KILL_GRACE = 2.0  # after an interrupt, how long a cell may take to stop before its session is killed
START_TIMEOUT = 60.0
POLL = 0.25  # the run loop's longest sleep: how late it may notice an interrupt's kill deadline
AGENT_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = f"import sys; sys.path.insert(0, {AGENT_PARENT!r}); from agent.kernel import main; main()"


class SessionDied(Exception):
    pass


class FrameReader:
    """Frames from a session's stdout, with a deadline per read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)

    def next(self, wait: float | None) -> tuple[int, bytes] | None:
        """The next frame, or None after `wait` seconds without one. Raises SessionDied at EOF."""
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            frame = self._parse()
            if frame is not None:
                return frame
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.poller.poll(None if left is None else int(left * 1000)):
                return None
            data = os.read(self.fd, protocol.CHUNK + 64)
            if not data:
                raise SessionDied
            self.buf += data

    def _parse(self) -> tuple[int, bytes] | None:
        if len(self.buf) < protocol.HEADER.size:
            return None
        kind, length = protocol.parse_header(bytes(self.buf[: protocol.HEADER.size]))
        end = protocol.HEADER.size + length
        if len(self.buf) < end:
            return None
        payload = bytes(self.buf[protocol.HEADER.size : end])
        del self.buf[:end]
        return kind, payload


class Context:
    """What a session is started as: an id, a language, a working directory and the kernel's options."""

    def __init__(self, name: str, language: str, cwd: str, options: dict[str, Any]) -> None:
        self.name = name
        self.language = language
        self.cwd = cwd
        self.options = options
        self.session: Session | None = None
        self.starting = threading.Lock()  # one start at a time, without holding up the other contexts
        self.closed = False

    def info(self) -> dict[str, Any]:
        session = self.session if self.session is not None and not self.session.dead else None
        return {"name": self.name, "language": self.language, "cwd": self.cwd,
                "pid": session.proc.pid if session else 0, "started_at": session.started_at if session else 0,
                "busy": session.busy.locked() if session else False,
                "execution_count": session.count if session else 0}


class Session:
    def __init__(self, context: Context, proc: Process) -> None:
        self.context = context
        self.name = context.name
        self.language = context.language
        self.proc = proc
        self.started_at = time.time()
        self.count = 0  # cells run, the running one included: E2B's execution count
        self.busy = threading.Lock()  # one cell at a time
        self.kill_at: float | None = None  # set by an interrupt: kill if the cell still runs by then
        self.killed = False
        self.dead = False
        assert proc.stdin_fd is not None
        self.out_fd, self.err_fd = list(proc.fds)
        self.reader = FrameReader(self.out_fd)
        self.stderr_tail = b""  # what the kernel wrote before it took over its fd 2: start-up failures
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self) -> None:
        try:
            while data := os.read(self.err_fd, 65536):
                self.stderr_tail = (self.stderr_tail + data)[-4096:]
        finally:
            close_quietly(self.err_fd)

    def send_cell(self, code: str, env: dict[str, str]) -> None:
        frame = protocol.encode_json(protocol.REQUEST, {"code": code, "env": env})
        assert self.proc.stdin_fd is not None
        try:
            os.write(self.proc.stdin_fd, frame) if len(frame) < 65536 else _write_all(self.proc.stdin_fd, frame)
        except OSError as exc:  # it died between cells
            raise SessionDied from exc

    def interrupt(self) -> None:
        if self.busy.locked() and not self.dead:
            self.kill_at = time.monotonic() + KILL_GRACE
            try:
                os.killpg(self.proc.pid, SIGINT)
            except OSError:
                pass

    def kill(self) -> None:
        if not self.dead:
            self.killed = True
            self.proc.kill_tree()

    def reap(self) -> tuple[int | None, int | None]:
        """After EOF: wait (briefly) for the reaper's exit status, and release the pipes."""
        self.dead = True
        end = time.monotonic() + 2.0
        while self.proc.status is None and time.monotonic() < end:
            time.sleep(0.005)
        for fd in (self.out_fd, self.proc.stdin_fd, self.proc._wake_r, self.proc._wake_w):
            if fd is not None:
                close_quietly(fd)
        return decode_status(self.proc.status)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Sessions:
    def __init__(self, table: ProcessTable) -> None:
        self.table = table
        self.contexts: dict[str, Context] = {}  # in creation order
        self.lock = threading.Lock()

    # -- ops ---------------------------------------------------------------------------------------------

    def op_run(self, ch: Channel, req: dict[str, Any]) -> None:
        code = req.get("code")
        if not isinstance(code, str):
            raise ProcessError("invalid_request", "code must be a string")
        timeout = req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ProcessError("invalid_request", "timeout must be a positive number of seconds")
        cell_env = checked_cell_env(req.get("cell_env"))
        language = language_of(req.get("language"))
        if req.get("context") is None and (language or "python") in COMPILERS:
            run_program(self.table, ch, req, code, None if timeout is None else float(timeout), cell_env)
            return
        if req.get("stdin_b64") is not None:
            raise ProcessError("invalid_request", f"stdin is not supported for {language or 'python'} sessions; "
                                                  "only for " + ", ".join(COMPILERS))
        context = self._context_to_run(req, language)
        session = self._session(context, req.get("env"))
        with session.busy:
            session.count += 1
            ch.event(event="started", session=context.name, language=context.language, pid=session.proc.pid,
                     execution_count=session.count)
            started = time.monotonic()
            done = self._run_cell(ch, session, code, cell_env, None if timeout is None else float(timeout))
        done["duration"] = round(time.monotonic() - started, 6)
        done["execution_count"] = session.count
        ch.send_json(protocol.EVENT, done)

    def op_interrupt(self, ch: Channel, req: dict[str, Any]) -> None:
        session = self._named(req).session
        if session is not None:
            session.interrupt()
        ch.event(event="done")

    def op_restart(self, ch: Channel, req: dict[str, Any]) -> None:
        """A running session is replaced by a fresh one; one that never ran (or died) is fresh already."""
        context = self._named(req)
        session = context.session
        if session is not None and not session.dead:
            self._end(session)
            self._session(context, req.get("env"))
        ch.event(event="done")

    def op_close(self, ch: Channel, req: dict[str, Any]) -> None:
        context = self._named(req)
        with self.lock:
            if self.contexts.get(context.name) is context:
                del self.contexts[context.name]
        with context.starting:  # a cell that found the context just before now starts no session for it
            context.closed = True
        if context.session is not None:
            self._end(context.session)
        ch.event(event="done")

    def op_list(self, ch: Channel, req: dict[str, Any]) -> None:
        """The running sessions."""
        with self.lock:
            running = [c for c in self.contexts.values() if c.session is not None and not c.session.dead]
        ch.event(event="done", sessions=[c.info() for c in running])

    def op_context_create(self, ch: Channel, req: dict[str, Any]) -> None:
        language = language_of(req.get("language")) or "python"
        if language not in languages.SESSION_LANGUAGES:
            raise ProcessError("invalid_request", f"no code contexts for {language!r}; contexts run "
                                                  f"{', '.join(languages.SESSION_LANGUAGES)}")
        check_available(language, req.get("env"))
        name = req.get("context")
        if name is None:
            import uuid

            name = str(uuid.uuid4())
        context = Context(checked_name(name, "context"), language, checked_cwd(req.get("cwd")), kernel_options(req))
        with self.lock:
            if context.name in self.contexts:
                raise ProcessError("conflict", f"a code context {context.name!r} exists already")
            self.contexts[context.name] = context
        ch.event(event="done", context=context.info())

    def op_contexts(self, ch: Channel, req: dict[str, Any]) -> None:
        """Every context, the listed defaults (made here if need be, with the request's cwd) first."""
        defaults = []
        for language in languages.LISTED_DEFAULTS:
            name = languages.default_context(language)
            if name in self.contexts or missing_tool(language, req.get("env")) is None:
                defaults.append(self._registered(name, language, req))
        with self.lock:
            others = [c for c in self.contexts.values() if c not in defaults]
        ch.event(event="done", contexts=[c.info() for c in [*defaults, *others]])

    # -- contexts and their sessions ---------------------------------------------------------------------

    def _named(self, req: dict[str, Any]) -> Context:
        name = str(req.get("session") or "default")
        with self.lock:
            context = self.contexts.get(name)
        if context is None:
            raise ProcessError("not_found", f"no code session {name!r} in this sandbox")
        return context

    def _registered(self, name: str, language: str, req: dict[str, Any]) -> Context:
        """The context `name`, made with `language` and the request's cwd and options if it does not exist."""
        with self.lock:
            context = self.contexts.get(name)
        if context is None:
            made = Context(name, language, checked_cwd(req.get("cwd")), kernel_options(req))
            with self.lock:
                context = self.contexts.setdefault(name, made)
        return context

    def _context_to_run(self, req: dict[str, Any], language: str | None) -> Context:
        """`context`: an existing context or a default one, whatever its language (unless one is given).
        Otherwise `session` (or the language's default context), made for the language on first use."""
        if req.get("context") is not None:
            name = checked_name(req["context"], "context")
            with self.lock:
                context = self.contexts.get(name)
            if context is None:
                default = languages.DEFAULT_CONTEXTS.get(name)
                if default is None:
                    raise ProcessError("not_found", f"no code context {name!r} in this sandbox")
                check_available(default, req.get("env"))
                context = self._registered(name, default, req)
        else:
            language = language or "python"
            if language not in languages.SESSION_LANGUAGES:
                raise ProcessError("invalid_request", f"unknown language {language!r}; available: "
                                                      f"{', '.join(LANGUAGES)} {UNKNOWN_HINT}")
            name = checked_name(req.get("session") or languages.default_context(language), "session")
            if name not in self.contexts:  # a language the template lacks makes no context
                check_available(language, req.get("env"))
            context = self._registered(name, language, req)
        if language is not None and context.language != language:
            raise ProcessError("conflict", f"code session {context.name!r} runs {context.language}, not "
                                           f"{language}; use another session name")
        return context

    def _session(self, context: Context, env: Any) -> Session:
        with context.starting:
            if context.closed:
                raise ProcessError("not_found", f"the code context {context.name!r} was closed")
            session = context.session
            if session is None or session.dead:
                session = context.session = self._start(context, env)
        return session

    def _end(self, session: Session) -> None:
        if session.context.session is session:
            session.context.session = None
        session.kill()
        if not session.busy.locked():  # a running cell's loop sees the EOF and cleans up itself
            with session.busy:
                if not session.dead:
                    _drain_to_eof(session)
                    session.reap()

    def _start(self, context: Context, env: Any) -> Session:
        check_available(context.language, env)
        if not os.path.isdir(context.cwd):
            raise ProcessError("invalid_request", f"the working directory {context.cwd} of code context "
                                                  f"{context.name!r} no longer exists")
        if not os.access(context.cwd, os.X_OK):
            raise ProcessError("permission_denied", f"the working directory {context.cwd} of code context "
                                                    f"{context.name!r} cannot be entered by the sandbox user; "
                                                    "create a context with a directory it may enter, such as "
                                                    "/home/user or /workspace")
        options = dict(context.options)
        if context.language == "typescript":
            options["typescript"] = _typescript_module(env)
        proc = self.table.spawn({"cmd": ["python3", "-B", "-c", BOOT, context.language, _json(options)],
                                 "cwd": context.cwd, "env": env, "stdin": True})
        with self.table.lock:  # not a command: the processes API must neither list nor reap it
            self.table.processes.pop(proc.id, None)
        session = Session(context, proc)
        try:
            _await_ready(session)
        except BaseException:
            session.kill()
            session.reap()
            raise
        return session

    def _run_cell(self, ch: Channel, session: Session, code: str, env: dict[str, str],
                  timeout: float | None) -> dict[str, Any]:
        session.kill_at = None
        timed_out = host_left = False
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            session.send_cell(code, env)
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    deadline, timed_out = None, True
                    session.interrupt()
                if not host_left and _host_left(ch):
                    host_left = True  # nobody waits for this cell any more: stop it, keep the session
                    session.interrupt()
                if session.kill_at is not None and now >= session.kill_at:
                    session.kill()
                frame = session.reader.next(POLL)
                if frame is None:
                    continue
                kind, payload = frame
                if kind == protocol.EVENT:
                    ev = protocol.decode_json(payload)
                    if ev.get("event") == "done":
                        return {"event": "done", "error": ev.get("error"), "timed_out": timed_out,
                                "session_restarted": False}
                relay(ch, kind, payload)
        except SessionDied:
            return self._died(session, timed_out)

    def _died(self, session: Session, timed_out: bool) -> dict[str, Any]:
        if session.context.session is session:
            session.context.session = None  # the context stays: its next cell starts a fresh session
        code, sig = session.reap()
        how = f"signal {sig}" if sig is not None else f"exit status {code}"
        if session.killed:
            error = {"name": "SessionKilled", "value": "the cell did not stop within 2 s of the interrupt, so the "
                     "session was killed; its state is lost", "traceback": ""}
        else:
            error = {"name": "SessionDied", "value": f"the session's process ended ({how}); its state is lost",
                     "traceback": session.stderr_tail.decode(errors="replace")}
        return {"event": "done", "error": error, "timed_out": timed_out, "session_restarted": True,
                "killed": session.killed, "signal": sig, "exit_code": code}


def _host_left(ch: Channel) -> bool:
    """Did the host close its end? It sends nothing while a cell runs, so a readable socket means EOF."""
    fd = ch.sock.fileno()
    if fd < 0 or not select.select([fd], [], [], 0)[0]:
        return False
    try:
        return ch.sock.recv(1, MSG_PEEK | MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _typescript_module(env: Any) -> str:
    """The TypeScript compiler's module directory, from its `tsc` (`<module>/bin/tsc`, linked from PATH)."""
    tsc = which("tsc", tool_path(env))
    return os.path.dirname(os.path.dirname(os.path.realpath(tsc))) if tsc else ""


def _json(value: Any) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


def _await_ready(session: Session) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    early = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            frame = session.reader.next(left)
            if frame is None:
                break
            kind, payload = frame
            if kind == protocol.EVENT and protocol.decode_json(payload).get("event") == "ready":
                return
            early += payload
    except SessionDied:
        time.sleep(0.05)  # let the stderr reader catch up with the last words
    detail = (early + session.stderr_tail).decode(errors="replace").strip()[-2000:]
    raise ProcessError("server_error", f"the {session.language} session failed to start: {detail or 'timed out'}")


def _drain_to_eof(session: Session) -> None:
    try:
        while session.reader.next(5.0) is not None:
            pass
    except SessionDied:
        pass


__all__ = ["Sessions"]
