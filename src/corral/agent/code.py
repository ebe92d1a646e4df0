"""Code sessions: named, stateful interpreters, each its own process running `agent/kernel.py` (docs/code.md).

A session is spawned like any command (sandbox user, subreaper root in its own process group), so an OOM or a
crash takes only that session. Its stdin carries cells as `REQUEST` frames; its stdout carries the agent's own
frames back, which are relayed to the host as they come. One cell runs at a time per session.

Compiled languages (`c`, `cpp`; `java`, `go`, `rust`, `typescript` with the polyglot template) have no session:
each call writes the code to a fresh temporary directory, compiles it there and runs the program (as a command,
like exec), with the call's `stdin_b64` as its stdin.

Ops: `code_run`, `code_interrupt`, `code_restart`, `code_close`, `code_list`.
"""

from __future__ import annotations

import os
import select
import threading
import time

from . import protocol
from .channel import Channel, Closed
from .processes import Process, ProcessError, ProcessTable, _close_quietly, _which, decode_status

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIGINT = 2
INTERPRETERS = {"python": "python3", "bash": "bash", "javascript": "node"}
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
POLYGLOT = ("java", "go", "rust", "typescript")  # what only the polyglot template has the toolchains of
LANGUAGES = (*INTERPRETERS, *COMPILERS)
UNKNOWN_HINT = "(Java, Go, Rust and TypeScript need the polyglot template)"
POLYGLOT_HINT = ("Java, Go, Rust and TypeScript need the `polyglot` template: build it with `corral templates build "
                 "polyglot` and create the sandbox with template 'polyglot'")
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


class Session:
    def __init__(self, name: str, language: str, proc: Process) -> None:
        self.name = name
        self.language = language
        self.proc = proc
        self.started_at = time.time()
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
            _close_quietly(self.err_fd)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "language": self.language, "pid": self.proc.pid, "started_at": self.started_at,
                "busy": self.busy.locked()}

    def send_cell(self, code: str) -> None:
        frame = protocol.encode_json(protocol.REQUEST, {"code": code})
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
                _close_quietly(fd)
        return decode_status(self.proc.status)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Sessions:
    def __init__(self, table: ProcessTable) -> None:
        self.table = table
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()

    # -- ops ---------------------------------------------------------------------------------------------

    def op_run(self, ch: Channel, req: dict[str, Any]) -> None:
        code = req.get("code")
        if not isinstance(code, str):
            raise ProcessError("invalid_request", "code must be a string")
        timeout = req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ProcessError("invalid_request", "timeout must be a positive number of seconds")
        language = req.get("language") or "python"
        if language in COMPILERS:
            self._run_program(ch, req, code, None if timeout is None else float(timeout))
            return
        if req.get("stdin_b64") is not None:
            raise ProcessError("invalid_request", f"stdin is not supported for {language} sessions; only for "
                                                  + ", ".join(COMPILERS))
        session = self._get_or_start(req)
        with session.busy:
            ch.event(event="started", session=session.name, language=session.language, pid=session.proc.pid)
            started = time.monotonic()
            done = self._run_cell(ch, session, code, None if timeout is None else float(timeout))
        done["duration"] = round(time.monotonic() - started, 6)
        ch.send_json(protocol.EVENT, done)

    def op_interrupt(self, ch: Channel, req: dict[str, Any]) -> None:
        self._named(req).interrupt()
        ch.event(event="done")

    def op_restart(self, ch: Channel, req: dict[str, Any]) -> None:
        old = self._named(req)
        self._end(old)
        self._get_or_start({**req, "language": old.language, "env": req.get("env")})
        ch.event(event="done")

    def op_close(self, ch: Channel, req: dict[str, Any]) -> None:
        self._end(self._named(req))
        ch.event(event="done")

    def op_list(self, ch: Channel, req: dict[str, Any]) -> None:
        with self.lock:
            sessions = list(self.sessions.values())
        ch.event(event="done", sessions=[s.info() for s in sessions])

    # -- sessions ------------------------------------------------------------------------------------------

    def _named(self, req: dict[str, Any]) -> Session:
        name = str(req.get("session") or "default")
        with self.lock:
            session = self.sessions.get(name)
        if session is None:
            raise ProcessError("not_found", f"no code session {name!r} in this sandbox")
        return session

    def _end(self, session: Session) -> None:
        with self.lock:
            if self.sessions.get(session.name) is session:
                del self.sessions[session.name]
        session.kill()
        if not session.busy.locked():  # a running cell's loop sees the EOF and cleans up itself
            with session.busy:
                if not session.dead:
                    _drain_to_eof(session)
                    session.reap()

    def _get_or_start(self, req: dict[str, Any]) -> Session:
        name = req.get("session") or "default"
        language = req.get("language") or "python"
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ProcessError("invalid_request", "session must be a name of 1 to 128 characters")
        if language not in INTERPRETERS:
            raise ProcessError("invalid_request", f"unknown language {language!r}; available: "
                                                  f"{', '.join(LANGUAGES)} {UNKNOWN_HINT}")
        with self.lock:
            session = self.sessions.get(name)
            if session is not None and session.dead:
                del self.sessions[name]
                session = None
            if session is None:
                session = self._start(name, language, req.get("env"))
                self.sessions[name] = session
        if session.language != language:
            raise ProcessError("conflict", f"code session {name!r} runs {session.language}, not {language}; "
                                           "use another session name")
        return session

    def _start(self, name: str, language: str, env: Any) -> Session:
        interpreter = INTERPRETERS[language]
        path = str((env or {}).get("PATH") or "") or "/usr/local/bin:/usr/bin:/bin"
        if _which(interpreter, path) is None or (language != "python" and _which("python3", path) is None):
            raise ProcessError("invalid_request", f"{language} is not available in this sandbox: its template "
                                                  f"has no {interpreter}")
        proc = self.table.spawn({"cmd": ["python3", "-B", "-c", BOOT, language], "cwd": "/workspace",
                                 "env": env, "stdin": True})
        with self.table.lock:  # not a command: the processes API must neither list nor reap it
            self.table.processes.pop(proc.id, None)
        session = Session(name, language, proc)
        try:
            _await_ready(session)
        except BaseException:
            session.kill()
            session.reap()
            raise
        return session

    def _run_cell(self, ch: Channel, session: Session, code: str, timeout: float | None) -> dict[str, Any]:
        session.kill_at = None
        timed_out = False
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            session.send_cell(code)
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    deadline, timed_out = None, True
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
        with self.lock:
            if self.sessions.get(session.name) is session:
                del self.sessions[session.name]
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

    def _run_program(self, ch: Channel, req: dict[str, Any], code: str, timeout: float | None) -> None:
        """Compile `code` in a fresh directory and run the program: compile errors apart from runtime ones."""
        import base64
        import binascii
        import shutil
        import tempfile

        language = str(req.get("language"))
        name = req.get("session") or "default"
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
        missing = next((tool for tool in tools if _which(tool, path) is None), None)
        if missing is not None:
            hint = f"; {POLYGLOT_HINT}" if language in POLYGLOT else ""
            raise ProcessError("invalid_request", f"{language} is not available in this sandbox: its template has "
                                                  f"no {missing}{hint}")
        if chain.get("env"):
            env = {**chain["env"], **(env or {})}
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
        pass  # the host left; the cell still runs to its end, as a notebook's would


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
