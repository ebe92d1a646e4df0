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
(as a command, like exec), with the call's `stdin_b64` as its stdin. In a context, java and typescript are
sessions (a JShell, a node whose cells lose their types).

Ops: `code_run`, `code_interrupt`, `code_restart`, `code_close`, `code_list` (running sessions),
`code_context_create`, `code_contexts` (every context, the listed defaults first).
"""

from __future__ import annotations

import os
import re
import select
import threading
import time

from . import languages, protocol
from .channel import Channel, Closed
from .process import Process, close_quietly, decode_status
from .process_requests import ProcessError
from .processes import ProcessTable
from .spawn import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIGINT = 2
MSG_PEEK, MSG_DONTWAIT = 2, 64
# Session languages -> what the template must have for them (the kernel itself needs python3 besides).
KERNEL_TOOLS = {"python": ("python3",), "bash": ("bash",), "javascript": ("node",), "typescript": ("node", "tsc"),
                "r": ("Rscript",), "java": ("java", "jshell")}
# TypeScript without @types/node (bookworm has no package of it) and without the DOM's lib (`--lib es2020`: tsc
# takes ~2 s instead of ~7): just enough for Node's globals and built-in modules to type-check (as `any`), so that
# `console.log(...)`, `process.stdout.write(...)` or `import * as fs from "fs"` compile.
NODE_DTS = "".join(
    [*(f"declare var {name}: any;\n" for name in (
        "process", "Buffer", "require", "module", "exports", "console", "setTimeout", "setInterval", "setImmediate",
        "clearTimeout", "clearInterval", "clearImmediate", "queueMicrotask", "structuredClone", "fetch", "URL",
        "URLSearchParams", "TextEncoder", "TextDecoder", "AbortController", "performance", "global")),
     "declare var __dirname: string;\ndeclare var __filename: string;\n",
     *(f'declare module "{m}";\ndeclare module "node:{m}";\n' for m in (
         "assert", "buffer", "child_process", "crypto", "events", "fs", "fs/promises", "http", "https", "net", "os",
         "path", "process", "readline", "stream", "string_decoder", "timers", "url", "util", "worker_threads",
         "zlib"))])
# language -> source file, compile command (run in the call's temporary directory, "{dir}"), run command (run in
# /workspace), and optionally: what the compiler must have built ("built"), environment added where the call's
# env does not set it ("env"), and further files written next to the source ("files").
COMPILERS: dict[str, dict[str, Any]] = {
    "c": {"source": "main.c", "compile": ["gcc", "-O2", "-std=c17", "-o", "prog", "main.c", "-lm"],
          "run": ["{dir}/prog"]},
    "cpp": {"source": "main.cpp", "compile": ["g++", "-O2", "-std=c++17", "-o", "prog", "main.cpp"],
            "run": ["{dir}/prog"]},
    # javac is a JVM itself: the C1 compiler only starts it faster.
    "java": {"source": "Main.java", "compile": ["javac", "-J-XX:TieredStopAtLevel=1", "Main.java"],
             "run": ["java", "-cp", "{dir}", "Main"], "built": "Main.class"},
    # The build cache outlives the call (under /tmp, per sandbox), so only a sandbox's first build is cold.
    "go": {"source": "main.go", "compile": ["go", "build", "-o", "prog", "main.go"], "run": ["{dir}/prog"],
           "env": {"GOCACHE": "/tmp/corral-go/cache", "GOPATH": "/tmp/corral-go/path"}},
    "rust": {"source": "main.rs", "compile": ["rustc", "-O", "-o", "prog", "main.rs"], "run": ["{dir}/prog"]},
    "typescript": {"source": "main.ts", "compile": ["tsc", "--outDir", "{dir}/out", "--target", "es2020", "--module",
                                                    "commonjs", "--lib", "es2020", "--skipLibCheck", "main.ts",
                                                    "node.d.ts"],
                   "run": ["node", "{dir}/out/main.js"], "files": {"node.d.ts": NODE_DTS}},
}
POLYGLOT = ("java", "go", "rust", "typescript", "r")  # what only the polyglot template has the tools of
LANGUAGES = ("python", "bash", "javascript", *COMPILERS, "r")
UNKNOWN_HINT = "(Java, Go, Rust and TypeScript need the polyglot template, and so does R)"
POLYGLOT_HINT = ("Java, Go, Rust, TypeScript and R need the `polyglot` template: build it with `corral templates "
                 "build polyglot` and create the sandbox with template 'polyglot'")
DEFAULT_CWD = "/workspace"
NAME = re.compile(r"^[^\x00/]{1,128}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PROGRAM_KEPT = 64 * 1024  # what a program's Process keeps of its output: every byte is relayed as it comes
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
        cell_env = _cell_env(req.get("cell_env"))
        language = _language(req.get("language"))
        if req.get("context") is None and (language or "python") in COMPILERS:
            self._run_program(ch, req, code, None if timeout is None else float(timeout), cell_env)
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
        language = _language(req.get("language")) or "python"
        if language not in languages.SESSION_LANGUAGES:
            raise ProcessError("invalid_request", f"no code contexts for {language!r}; contexts run "
                                                  f"{', '.join(languages.SESSION_LANGUAGES)}")
        _check_available(language, req.get("env"))
        name = req.get("context")
        if name is None:
            import uuid

            name = str(uuid.uuid4())
        context = Context(_name(name, "context"), language, _cwd(req.get("cwd")), _options(req))
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
            if name in self.contexts or _missing_tool(language, req.get("env")) is None:
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
            made = Context(name, language, _cwd(req.get("cwd")), _options(req))
            with self.lock:
                context = self.contexts.setdefault(name, made)
        return context

    def _context_to_run(self, req: dict[str, Any], language: str | None) -> Context:
        """`context`: an existing context or a default one, whatever its language (unless one is given).
        Otherwise `session` (or the language's default context), made for the language on first use."""
        if req.get("context") is not None:
            name = _name(req["context"], "context")
            with self.lock:
                context = self.contexts.get(name)
            if context is None:
                default = languages.DEFAULT_CONTEXTS.get(name)
                if default is None:
                    raise ProcessError("not_found", f"no code context {name!r} in this sandbox")
                _check_available(default, req.get("env"))
                context = self._registered(name, default, req)
        else:
            language = language or "python"
            if language not in languages.SESSION_LANGUAGES:
                raise ProcessError("invalid_request", f"unknown language {language!r}; available: "
                                                      f"{', '.join(LANGUAGES)} {UNKNOWN_HINT}")
            name = _name(req.get("session") or languages.default_context(language), "session")
            if name not in self.contexts:  # a language the template lacks makes no context
                _check_available(language, req.get("env"))
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
        _check_available(context.language, env)
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
                _relay(ch, kind, payload)
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

    # -- compiled languages --------------------------------------------------------------------------------

    def _run_program(self, ch: Channel, req: dict[str, Any], code: str, timeout: float | None,
                     cell_env: dict[str, str]) -> None:
        """Compile `code` in a fresh directory and run the program: compile errors apart from runtime ones."""
        import base64
        import binascii
        import shutil
        import tempfile

        language = _language(req.get("language")) or "python"
        name = req.get("session") or languages.default_context(language)  # only echoed: programs keep no state
        stdin = req.get("stdin_b64")
        try:
            data = None if stdin is None else base64.b64decode(str(stdin), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ProcessError("invalid_request", "stdin_b64 is not valid base64") from exc
        chain = COMPILERS[language]
        env = req.get("env")
        path = str((env or {}).get("PATH") or "") or "/usr/local/bin:/usr/bin:/bin"
        compiler = chain["compile"][0]
        tools = [compiler, *([] if chain["run"][0].startswith("{dir}") else [chain["run"][0]])]
        missing = next((tool for tool in tools if which(tool, path) is None), None)
        if missing is not None:
            hint = f"; {POLYGLOT_HINT}" if language in POLYGLOT else ""
            raise ProcessError("invalid_request", f"{language} is not available in this sandbox: its template has "
                                                  f"no {missing}{hint}")
        if chain.get("env"):
            env = {**chain["env"], **(env or {})}
        env = {**(env or {}), **cell_env}
        workdir = tempfile.mkdtemp(prefix="corral-code-", dir="/tmp")  # we run as the sandbox user
        try:
            for file, text in {chain["source"]: code, **chain.get("files", {})}.items():
                with open(os.path.join(workdir, file), "w", encoding="utf-8", errors="surrogateescape") as f:
                    f.write(text)
            ch.event(event="started", session=name, language=language, pid=0)
            started = time.monotonic()
            deadline = None if timeout is None else started + timeout
            compiled = self._command(ch, {"cmd": [a.replace("{dir}", workdir) for a in chain["compile"]],
                                          "cwd": workdir, "env": env}, deadline, None, relay=False)
            done = _compile_outcome(compiled, compiler, language)
            if done is None and chain.get("built") and not os.path.exists(os.path.join(workdir, chain["built"])):
                done = _not_built(compiled.output)
            if done is None:
                cwd = "/workspace" if os.path.isdir("/workspace") else workdir
                ran = self._command(ch, {"cmd": [a.replace("{dir}", workdir) for a in chain["run"]], "cwd": cwd,
                                         "env": env}, deadline, data, relay=True)
                done = _run_outcome(ran)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        done["duration"] = round(time.monotonic() - started, 6)
        ch.send_json(protocol.EVENT, done)

    def _command(self, ch: Channel, spec: dict[str, Any], deadline: float | None, stdin: bytes | None, *,
                 relay: bool) -> Ran:
        """Run one command to its end (or the deadline), relaying its output or keeping it (merged)."""
        if deadline is not None and deadline - time.monotonic() <= 0:
            return Ran(None, True, False, b"")
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        proc = self.table.spawn({**spec, "timeout": left, "stdin": stdin is not None,
                                 "max_output": PROGRAM_KEPT})
        with self.table.lock:  # not a command of the processes API
            self.table.processes.pop(proc.id, None)
        kept = bytearray()

        def sink(stream: str, chunk: bytes) -> None:
            if relay:
                _relay(ch, protocol.STDOUT if stream == "stdout" else protocol.STDERR, chunk)
            else:
                kept.extend(chunk)

        proc.follow.append(sink)
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc, stdin), daemon=True).start()

        def host_input() -> bool:  # the host sends nothing more; EOF means it left: end the program
            try:
                ch.recv()
                return True
            except (Closed, protocol.ProtocolError, OSError):
                proc.kill_tree()
                return False

        self.table.pump_here(proc, ch.sock.fileno(), host_input)
        return Ran(proc.status, proc.timed_out, proc.killed, bytes(kept))


class Ran:
    def __init__(self, status: int | None, timed_out: bool, killed: bool, output: bytes) -> None:
        self.status, self.timed_out, self.killed, self.output = status, timed_out, killed, output


def _feed(proc: Process, data: bytes) -> None:
    try:
        proc.write_stdin(data)
    except (ProcessError, OSError):
        pass
    proc.close_stdin()


def _timeout_error(what: str) -> dict[str, Any]:
    return {"name": "TimeoutError", "value": f"the {what} ran past the call's timeout and was killed",
            "traceback": ""}


def _compile_outcome(ran: Ran, compiler: str, language: str) -> dict[str, Any] | None:
    """None when the program was built; else the call's `done` event (nothing runs)."""
    if ran.timed_out:
        return {"event": "done", "error": _timeout_error("compiler"), "timed_out": True, "session_restarted": False,
                "killed": True}
    code, sig = decode_status(ran.status)
    if code == 0:
        return None
    text = ran.output.decode(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    # gcc, javac: "file:line: error: ..."; rustc: "error[E0425]: ..."; tsc: "main.ts(1,7): error TS2322: ...";
    # go prints "# command-line-arguments" and then "./main.go:3:2: undefined: x".
    first = next((line for line in lines if " error: " in line or " error TS" in line or line.startswith("error")),
                 None)
    first = first or next((line for line in lines if not line.startswith("#")), "")
    if language == "java" and "is public, should be declared in a file named" in first:
        first += " (the program's public class must be named Main)"
    how = f"signal {sig}" if sig is not None else f"exit status {code}"
    return {"event": "done", "error": {"name": "CompileError", "value": first or f"{compiler} failed ({how})",
                                       "traceback": text},
            "timed_out": False, "session_restarted": False}


def _not_built(output: bytes) -> dict[str, Any]:
    """The compiler succeeded without building what runs: for Java, a program without a class Main."""
    value = "no class Main: the program's public class (the one with main) must be named Main"
    return {"event": "done", "error": {"name": "CompileError", "value": value,
                                       "traceback": (output.decode(errors="replace") + "\n" + value).lstrip()},
            "timed_out": False, "session_restarted": False}


def _run_outcome(ran: Ran) -> dict[str, Any]:
    code, sig = decode_status(ran.status)
    done: dict[str, Any] = {"event": "done", "error": None, "timed_out": ran.timed_out, "session_restarted": False,
                            "signal": sig, "exit_code": code, "killed": ran.killed or ran.timed_out}
    if ran.timed_out:
        done["error"] = _timeout_error("program")
    elif sig is not None:
        name = _signal_name(sig)
        done["error"] = {"name": "Signal", "value": name,
                         "traceback": f"the program was killed by signal {sig} ({name})"}
    elif code:
        done["error"] = {"name": "ExitStatus", "value": str(code),
                         "traceback": f"the program exited with status {code}"}
    return done


def _signal_name(sig: int) -> str:
    import signal

    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _relay(ch: Channel, kind: int, payload: bytes) -> None:
    try:
        ch.send(kind, payload)
    except Closed:
        pass  # the host left: the run loop sees it (`_host_left`) and interrupts the cell


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


# -- what requests carry ----------------------------------------------------------------------------------


def _language(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ProcessError("invalid_request", "language must be a string")
    return languages.normalize(value)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise ProcessError("invalid_request", f"{what} must be a name of 1 to 128 characters, without '/'")
    return value


def _cwd(value: Any) -> str:
    """A new context's working directory: absolute, and a directory now (whether it may be entered shows when a
    cell runs there)."""
    if value is None:
        return DEFAULT_CWD
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise ProcessError("invalid_request", "cwd must be an absolute path")
    if not os.path.isdir(value):
        raise ProcessError("invalid_request", f"working directory {value!r} does not exist in the sandbox")
    return os.path.normpath(value)


def _options(req: dict[str, Any]) -> dict[str, Any]:
    return {"show_saved_images": bool(req.get("show_saved_images"))}


def _cell_env(value: Any) -> dict[str, str]:
    """Environment variables for one cell: names are identifiers (every language sets them, bash included)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProcessError("invalid_request", "a cell's env must be an object of names to strings")
    for name, item in value.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ProcessError("invalid_request", f"environment variable name {name!r} is not valid: letters, "
                                                  "digits and '_', not starting with a digit")
        if not isinstance(item, str) or "\x00" in item:
            raise ProcessError("invalid_request", f"environment variable {name} must be a string without NUL")
    return dict(value)


def _path(env: Any) -> str:
    return str((env or {}).get("PATH") or "") or "/usr/local/bin:/usr/bin:/bin"


def _missing_tool(language: str, env: Any) -> str | None:
    tools = ("python3", *KERNEL_TOOLS[language])
    return next((tool for tool in tools if which(tool, _path(env)) is None), None)


def _check_available(language: str, env: Any) -> None:
    missing = _missing_tool(language, env)
    if missing is not None:
        hint = f"; {POLYGLOT_HINT}" if language in POLYGLOT else ""
        raise ProcessError("invalid_request", f"{language} is not available in this sandbox: its template has "
                                              f"no {missing}{hint}")


def _typescript_module(env: Any) -> str:
    """The TypeScript compiler's module directory, from its `tsc` (`<module>/bin/tsc`, linked from PATH)."""
    tsc = which("tsc", _path(env))
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
