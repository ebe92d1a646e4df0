"""Compiled languages outside a context (`c`, `cpp`; `java`, `go`, `rust`, `typescript` with the polyglot
template): no session, each call writes the code to a fresh temporary directory, compiles it there and runs the
program as a command, with the call's `stdin_b64` as its stdin; compile errors are told apart from runtime ones
(docs/code.md)."""

from __future__ import annotations

import os
import threading
import time

from . import languages, protocol
from .channel import Channel, Closed, relay
from .code_requests import POLYGLOT, POLYGLOT_HINT, language_of
from .process import Process, decode_status
from .process_requests import ProcessError
from .processes import ProcessTable
from .spawn import which

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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
PROGRAM_KEPT = 64 * 1024  # what a program's Process keeps of its output: every byte is relayed as it comes


def run_program(table: ProcessTable, ch: Channel, req: dict[str, Any], code: str, timeout: float | None,
                cell_env: dict[str, str]) -> None:
    """Compile `code` in a fresh directory and run the program: compile errors apart from runtime ones."""
    import base64
    import binascii
    import shutil
    import tempfile

    language = language_of(req.get("language")) or "python"
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
        compiled = _command(table, ch, {"cmd": [a.replace("{dir}", workdir) for a in chain["compile"]],
                                    "cwd": workdir, "env": env}, deadline, None, live=False)
        done = _compile_outcome(compiled, compiler, language)
        if done is None and chain.get("built") and not os.path.exists(os.path.join(workdir, chain["built"])):
            done = _not_built(compiled.output)
        if done is None:
            cwd = "/workspace" if os.path.isdir("/workspace") else workdir
            ran = _command(table, ch, {"cmd": [a.replace("{dir}", workdir) for a in chain["run"]], "cwd": cwd,
                                   "env": env}, deadline, data, live=True)
            done = _run_outcome(ran)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    done["duration"] = round(time.monotonic() - started, 6)
    ch.send_json(protocol.EVENT, done)


def _command(table: ProcessTable, ch: Channel, spec: dict[str, Any], deadline: float | None,
             stdin: bytes | None, *, live: bool) -> Ran:
    """Run one command to its end (or the deadline), relaying its output (`live`) or keeping it (merged)."""
    if deadline is not None and deadline - time.monotonic() <= 0:
        return Ran(None, True, False, b"")
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    proc = table.spawn({**spec, "timeout": left, "stdin": stdin is not None, "max_output": PROGRAM_KEPT})
    with table.lock:  # not a command of the processes API
        table.processes.pop(proc.id, None)
    kept = bytearray()

    def sink(stream: str, chunk: bytes) -> None:
        if live:
            relay(ch, protocol.STDOUT if stream == "stdout" else protocol.STDERR, chunk)
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

    table.pump_here(proc, ch.sock.fileno(), host_input)
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
