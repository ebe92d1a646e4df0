"""The fake agent's code sessions (`code_*` ops of `corral/agent/code.py`), for tests of the layers above.

Python cells run in this (the test) process, each on a thread of its own, in a namespace kept per context: the
last expression is the main result (`text/plain` its repr, as the real kernel formats it), `print` goes to the
cell's stdout (stderr with `file=sys.stderr`), `display(...)` gives further results, and an exception is the
cell's error (name, value, traceback). Bash cells run in `tests/fake_shell.py`'s toy shell, which keeps its
variables and directory from cell to cell; a nonzero status is the real kernel's `ExitStatus` error. A cell's
timeout (or `code_interrupt`) raises KeyboardInterrupt in its thread; a cell that does not stop within the grace
ends its session (`SessionKilled`, `session_restarted`), as the real agent kills it.

What the fake does not do: other languages (refused as a template without their tool is), `os.environ` changes per
cell, output written to `sys.stdout` directly (only `print`), and isolation: a cell is the test's own code.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import ctypes
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from corral.agent import languages, protocol
from corral.agent.code import KILL_GRACE
from corral.agent.code_requests import DEFAULT_CWD, checked_cell_env, checked_name, language_of
from corral.agent.kernel import describe_error, format_object

from .fake_shell import Io, Shell

if TYPE_CHECKING:
    from .fake_agent import FakeAgent
    from .fake_wire import Conn

__all__ = ["FakeCode"]

FAKE_LANGUAGES = ("python", "bash")  # what the fake's "template" has


def _failure(code: str, message: str) -> Exception:
    """The fake agent's error answer (imported late: fake_agent imports this module)."""
    from .fake_agent import AgentFailure

    return AgentFailure(code, message)


@dataclass
class _Session:
    pid: int
    shell: Shell | None  # bash
    ns: dict[str, Any] = field(default_factory=dict)  # python
    started_at: float = field(default_factory=time.time)
    count: int = 0
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    thread: threading.Thread | None = None  # the python cell running now
    dead: bool = False


@dataclass
class _Context:
    name: str
    language: str
    cwd: str
    session: _Session | None = None

    def info(self) -> dict[str, Any]:
        s = self.session if self.session is not None and not self.session.dead else None
        return {"name": self.name, "language": self.language, "cwd": self.cwd, "pid": s.pid if s else 0,
                "started_at": s.started_at if s else 0, "busy": s.busy.locked() if s else False,
                "execution_count": s.count if s else 0}


class FakeCode:
    """One sandbox's code contexts, in creation order."""

    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent
        self.contexts: dict[str, _Context] = {}
        self._pids = itertools.count(5000)

    # -- ops ---------------------------------------------------------------------------------------------

    async def op_run(self, conn: Conn, req: dict[str, Any]) -> None:
        code = req.get("code")
        if not isinstance(code, str):
            raise _failure("invalid_request", "code must be a string")
        timeout = req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise _failure("invalid_request", "timeout must be a positive number of seconds")
        cell_env = checked_cell_env(req.get("cell_env"))
        context = self._context_to_run(req, language_of(req.get("language")))
        session = self._session(context)
        async with session.busy:
            session.count += 1
            conn.event(event="started", session=context.name, language=context.language, pid=session.pid,
                       execution_count=session.count)
            started = time.monotonic()
            if context.language == "bash":
                done = await self._bash_cell(conn, session, code, cell_env, timeout)
            else:
                done = await self._python_cell(conn, context, session, code, timeout)
        done["duration"] = round(time.monotonic() - started, 6)
        done["execution_count"] = session.count
        conn.event(**done)

    async def op_interrupt(self, conn: Conn, req: dict[str, Any]) -> None:
        session = self._named(req).session
        if session is not None and session.thread is not None:
            _raise_in(session.thread, KeyboardInterrupt)
        conn.event(event="done")

    async def op_restart(self, conn: Conn, req: dict[str, Any]) -> None:
        context = self._named(req)
        if context.session is not None and not context.session.dead:
            self._end(context.session)
            context.session = self._start(context)
        conn.event(event="done")

    async def op_close(self, conn: Conn, req: dict[str, Any]) -> None:
        context = self._named(req)
        self.contexts.pop(context.name, None)
        if context.session is not None:
            self._end(context.session)
        conn.event(event="done")

    async def op_list(self, conn: Conn, req: dict[str, Any]) -> None:
        running = [c for c in self.contexts.values() if c.session is not None and not c.session.dead]
        conn.event(event="done", sessions=[c.info() for c in running])

    async def op_context_create(self, conn: Conn, req: dict[str, Any]) -> None:
        language = language_of(req.get("language")) or "python"
        if language not in languages.SESSION_LANGUAGES:
            raise _failure("invalid_request", f"no code contexts for {language!r}; contexts run "
                                              f"{', '.join(languages.SESSION_LANGUAGES)}")
        _check_available(language)
        name = req.get("context")
        context = _Context(checked_name(str(uuid.uuid4()) if name is None else name, "context"), language,
                           self._cwd(req.get("cwd")))
        if context.name in self.contexts:
            raise _failure("conflict", f"a code context {context.name!r} exists already")
        self.contexts[context.name] = context
        conn.event(event="done", context=context.info())

    async def op_contexts(self, conn: Conn, req: dict[str, Any]) -> None:
        defaults = [self._registered(languages.default_context(lang), lang, req) for lang in languages.LISTED_DEFAULTS
                    if lang in FAKE_LANGUAGES or languages.default_context(lang) in self.contexts]
        others = [c for c in self.contexts.values() if c not in defaults]
        conn.event(event="done", contexts=[c.info() for c in [*defaults, *others]])

    # -- contexts and sessions ------------------------------------------------------------------------------

    def _cwd(self, value: Any) -> str:
        if value is None:
            return DEFAULT_CWD
        if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
            raise _failure("invalid_request", "cwd must be an absolute path")
        if not self.agent.fs.host(value).is_dir():
            raise _failure("invalid_request", f"working directory {value!r} does not exist in the sandbox")
        return value

    def _named(self, req: dict[str, Any]) -> _Context:
        name = str(req.get("session") or "default")
        context = self.contexts.get(name)
        if context is None:
            raise _failure("not_found", f"no code session {name!r} in this sandbox")
        return context

    def _registered(self, name: str, language: str, req: dict[str, Any]) -> _Context:
        if name not in self.contexts:
            self.contexts[name] = _Context(name, language, self._cwd(req.get("cwd")))
        return self.contexts[name]

    def _context_to_run(self, req: dict[str, Any], language: str | None) -> _Context:
        if req.get("context") is not None:
            name = checked_name(req["context"], "context")
            context = self.contexts.get(name)
            if context is None:
                default = languages.DEFAULT_CONTEXTS.get(name)
                if default is None:
                    raise _failure("not_found", f"no code context {name!r} in this sandbox")
                _check_available(default)
                context = self._registered(name, default, req)
        else:
            language = language or "python"
            if language not in languages.SESSION_LANGUAGES:
                raise _failure("invalid_request", f"unknown language {language!r} (the fake agent runs "
                                                  f"{', '.join(FAKE_LANGUAGES)})")
            name = checked_name(req.get("session") or languages.default_context(language), "session")
            if name not in self.contexts:
                _check_available(language)
            context = self._registered(name, language, req)
        if language is not None and context.language != language:
            raise _failure("conflict", f"code session {context.name!r} runs {context.language}, not "
                                       f"{language}; use another session name")
        return context

    def _session(self, context: _Context) -> _Session:
        if context.session is None or context.session.dead:
            context.session = self._start(context)
        return context.session

    def _start(self, context: _Context) -> _Session:
        shell = None
        if context.language == "bash":
            shell = Shell(self.agent.fs, dict(self.agent.base_env), context.cwd)
        session = _Session(next(self._pids), shell)
        session.ns.update(__name__="__main__", __builtins__=builtins)
        return session

    @staticmethod
    def _end(session: _Session) -> None:
        session.dead = True
        if session.thread is not None:
            _raise_in(session.thread, SystemExit)

    # -- cells -------------------------------------------------------------------------------------------------

    async def _bash_cell(self, conn: Conn, session: _Session, code: str, env: dict[str, str],
                         timeout: float | None) -> dict[str, Any]:
        assert session.shell is not None

        async def out(b: bytes) -> None:
            conn.send(protocol.STDOUT, b)

        async def err(b: bytes) -> None:
            conn.send(protocol.STDERR, b)

        async def no_input() -> bytes:
            return b""

        saved = dict(session.shell.env)
        session.shell.env.update(env)
        try:
            async with asyncio.timeout(timeout):
                status = await session.shell.run_script(code, Io(no_input, out, err))
        except TimeoutError:
            return {"event": "done", "error": {"name": "KeyboardInterrupt", "value": "", "traceback": ""},
                    "timed_out": True, "session_restarted": False}
        finally:
            for name in env:
                if name in saved:
                    session.shell.env[name] = saved[name]
                else:
                    session.shell.env.pop(name, None)
        error = None if status == 0 else {"name": "ExitStatus", "value": str(status),
                                          "traceback": f"the cell exited with status {status}"}
        return {"event": "done", "error": error, "timed_out": False, "session_restarted": False}

    async def _python_cell(self, conn: Conn, context: _Context, session: _Session, code: str,
                           timeout: float | None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        session.ns["__builtins__"] = _cell_builtins(put)
        session.thread = threading.Thread(target=_run_python, args=(code, session.ns, put), daemon=True,
                                          name=f"fake-cell-{context.name}")
        session.thread.start()
        timed_out, deadline = False, None if timeout is None else loop.time() + timeout
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    kind, value = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if timed_out:  # past the grace too: the real agent kills the session
                        self._end(session)
                        context.session = None
                        return {"event": "done", "error": {
                            "name": "SessionKilled", "value": "the cell did not stop within 2 s of the interrupt, "
                            "so the session was killed; its state is lost", "traceback": ""},
                            "timed_out": True, "session_restarted": True, "killed": True, "signal": 9,
                            "exit_code": None}
                    timed_out, deadline = True, loop.time() + KILL_GRACE
                    _raise_in(session.thread, KeyboardInterrupt)
                    continue
                if kind == "done":
                    return {"event": "done", "error": value, "timed_out": timed_out, "session_restarted": False}
                if kind == "result":
                    main, data = value
                    conn.event(event="result", is_main_result=main, data=data)
                else:
                    conn.send(protocol.STDOUT if kind == "stdout" else protocol.STDERR, value)
                await conn.drain()
        finally:
            session.thread = None


def _check_available(language: str) -> None:
    if language not in FAKE_LANGUAGES:
        raise _failure("invalid_request", f"{language} is not available in this sandbox: the fake agent runs "
                                          f"{' and '.join(FAKE_LANGUAGES)} only")


def _cell_builtins(put: Callable[[str, Any], None]) -> dict[str, Any]:
    """The builtins a python cell sees: `print` and `display` into the cell's streams and results."""

    def cell_print(*args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
                   flush: bool = False) -> None:
        if file is not None and file is not sys.stdout and file is not sys.stderr:
            builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
            return
        text = (" " if sep is None else sep).join(str(a) for a in args) + ("\n" if end is None else end)
        put("stderr" if file is sys.stderr else "stdout", text.encode())

    def display(*objs: object, **_: Any) -> None:
        for obj in objs:
            put("result", (False, format_object(obj)))

    return {**vars(builtins), "print": cell_print, "display": display}


def _run_python(code: str, ns: dict[str, Any], put: Callable[[str, Any], None]) -> None:
    try:
        tree = ast.parse(code, "<cell>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            del tree.body[-1]
        exec(compile(tree, "<cell>", "exec"), ns)  # the test's own code: the fake runs it
        value = eval(compile(last, "<cell>", "eval"), ns) if last is not None else None
        if value is not None:
            ns["_"] = value
            put("result", (True, format_object(value)))
        error = None
    except BaseException as exc:  # the session outlives every cell, as the real kernel's does
        error = describe_error(exc)
    put("done", error)


def _raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise `exc` in `thread` at its next bytecode (a cell blocked in C sees it when the call returns)."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
