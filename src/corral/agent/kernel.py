"""A code session's own process: runs cells, one at a time, for the agent (see docs/code.md).

Started by the agent as `python3 -B -c "...; from agent.kernel import main; main()" LANGUAGE`. It reads
`REQUEST` frames (`{"code": ...}`) on its stdin and writes the agent's frames on its stdout: `STDOUT`/`STDERR`
bytes as the cell writes them, `EVENT {"event": "result", ...}` for each rich result, and one
`EVENT {"event": "done", "error": ...}` per cell. Before reading the first cell it says `EVENT {"event": "ready"}`.

The cell's own fds 1 and 2 are pipes this process reads (so subprocesses stream too, bytes exact) and its stdin
is /dev/null: the protocol fds are private duplicates the cell never sees.

For `python` the cell runs here; for `bash` and `javascript` this process drives a long-lived `bash` or `node`
child that shares those output pipes and reports each cell's end on a status pipe.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import sys
import threading

from . import charts, protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIGINT = 2
FIONREAD = 0x541B
# IPython's display formatter order; text/plain (repr) always comes too.
REPR_METHODS = (
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_e2b_chart_", "e2b/chart"),  # E2B's: a figure's data as a chart (agent/charts.py)
)
BINARY_MIMES = frozenset({"image/png", "image/jpeg"})
JSON_MIMES = frozenset({"application/json", "e2b/chart"})
FIGURE_EVENT_SLACK = 16 * 1024  # a figure's result event besides its PNG and chart: the repr, the JSON around


class Wire:
    """The frames to the agent, and the forwarding of the cell's output pipes into them."""

    def __init__(self, out_fd: int, out_r: int, err_r: int) -> None:
        self.fd = out_fd
        self.out_r, self.err_r = out_r, err_r
        self.lock = threading.Lock()  # held while a frame is written, and by the forwarder from read to frame

    def send(self, kind: int, payload: bytes) -> None:
        with self.lock:
            self._write(kind, payload)

    def _write(self, kind: int, payload: bytes) -> None:
        for i in range(0, max(len(payload), 1), protocol.CHUNK):
            view = memoryview(protocol.encode(kind, payload[i : i + protocol.CHUNK]))
            while view:
                view = view[os.write(self.fd, view) :]

    def event(self, **fields: Any) -> None:
        self.send(protocol.EVENT, json.dumps(fields, separators=(",", ":")).encode())

    def forward(self) -> None:
        import select

        kinds = {self.out_r: protocol.STDOUT, self.err_r: protocol.STDERR}
        poller = select.epoll()
        for fd in kinds:
            poller.register(fd, select.EPOLLIN)
        while True:
            for fd, _ in poller.poll():
                with self.lock:
                    data = os.read(fd, protocol.CHUNK)
                    if data:
                        self._write(kinds[fd], data)

    def drain(self) -> None:
        """Return once every byte written to the output pipes so far has gone out as a frame."""
        import fcntl
        import time

        buf = bytearray(4)
        while True:
            with self.lock:
                pending = 0
                for fd in (self.out_r, self.err_r):
                    fcntl.ioctl(fd, FIONREAD, buf)
                    pending += int.from_bytes(buf, sys.byteorder)
                if not pending:
                    return
            time.sleep(0.0005)


def read_request(fd: int) -> dict[str, Any] | None:
    header = _read_exact(fd, protocol.HEADER.size)
    if header is None:
        return None
    kind, length = protocol.parse_header(header)
    payload = _read_exact(fd, length) if length else b""
    if kind != protocol.REQUEST or payload is None:
        return None
    return protocol.decode_json(payload)


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = os.read(fd, n - len(buf))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _setup_fds() -> tuple[int, int, Wire]:
    """Keep the protocol fds private; give the cell /dev/null and the output pipes as fds 0, 1 and 2."""
    proto_in, proto_out = os.dup(0), os.dup(1)  # os.dup's copies are close-on-exec: children never see them
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    return proto_in, proto_out, Wire(proto_out, out_r, err_r)


def main() -> None:
    language = sys.argv[1] if len(sys.argv) > 1 else "python"
    # The `agent` package must not shadow a user's own module of that name.
    for name in [n for n in sys.modules if n == "agent" or n.startswith("agent.")]:
        del sys.modules[name]
    if sys.path and sys.path[0] == os.path.dirname(os.path.dirname(os.path.abspath(__file__))):
        del sys.path[0]
    proto_in, _, wire = _setup_fds()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a pipe: streamed line by line
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    threading.Thread(target=wire.forward, daemon=True).start()
    runner = PythonRunner(wire) if language == "python" else ChildRunner(wire, language)
    _ignore_sigint()
    wire.event(event="ready")
    while (req := read_request(proto_in)) is not None:
        error = runner.run(str(req.get("code", "")))
        _ignore_sigint()  # an interrupt that comes after the cell must not break the protocol
        _flush()
        wire.drain()
        wire.event(event="done", error=error)


def _ignore_sigint() -> None:
    import signal

    signal.signal(SIGINT, signal.SIG_IGN)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# -- python ----------------------------------------------------------------------------------------------


class PythonRunner:
    def __init__(self, wire: Wire) -> None:
        import types

        self.wire = wire
        self.count = 0
        module = types.ModuleType("__main__")  # pickling user classes needs them in a real __main__
        sys.modules["__main__"] = module
        self.ns = module.__dict__
        self.ns["__builtins__"] = builtins
        builtins.display = self.display  # type: ignore[attr-defined]
        builtins.__corral_shell__ = _shell  # type: ignore[attr-defined]
        sys.argv = [""]
        sys.dont_write_bytecode = False
        os.environ.setdefault("MPLBACKEND", "Agg")
        import warnings

        # plt.show() under Agg would warn on every call; figures come back after the cell anyway.
        warnings.filterwarnings("ignore", message=".*non-interactive.*cannot be shown")

    def display(self, *objs: object) -> None:
        for obj in objs:
            self.emit(obj, main=False)

    def emit(self, obj: object, *, main: bool) -> None:
        _flush()
        self.wire.drain()  # what was printed before the result comes before it
        self.wire.event(event="result", is_main_result=main, data=format_object(obj))

    def run(self, code: str) -> dict[str, str] | None:
        import signal

        self.count += 1
        filename = f"<cell-{self.count}>"
        try:
            signal.signal(SIGINT, signal.default_int_handler)
            value = self._execute(transform_magics(code), filename)
            signal.signal(SIGINT, signal.SIG_IGN)
            if value is not None:
                self.ns["_"] = value
                self.emit(value, main=True)
            error = None
        except BaseException as exc:  # the session outlives any cell, SystemExit and KeyboardInterrupt included
            signal.signal(SIGINT, signal.SIG_IGN)
            error = describe_error(exc)
        self._flush_figures()
        return error

    def _execute(self, code: str, filename: str) -> object:
        import linecache

        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks show lines
        tree = ast.parse(code, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            del tree.body[-1]
        # Running the user's code is this process's whole purpose.
        exec(compile(tree, filename, "exec"), self.ns)  # noqa: S102
        return eval(compile(last, filename, "eval"), self.ns) if last is not None else None  # noqa: S307

    def _flush_figures(self) -> None:
        # Only if the cell used pyplot: importing matplotlib ourselves would cost every session ~1 s.
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        try:
            for num in plt.get_fignums():
                fig = plt.figure(num)
                self.emit(_PNG(fig), main=False)
            plt.close("all")
        except Exception as exc:
            self.wire.send(protocol.STDERR, f"corral: could not render a figure: {exc!r}\n".encode())


class _PNG:
    """A matplotlib figure as a rich result: its PNG, its chart (read after the PNG drew it) and a text stand-in."""

    def __init__(self, fig: Any) -> None:
        self.fig = fig
        self.png_size = 0

    def _repr_png_(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.fig.savefig(buf, format="png")
        self.png_size = buf.tell()
        return buf.getvalue()

    def _repr_e2b_chart_(self) -> str | None:
        # The result event must stay one frame (the agent reads it whole): the chart gets what the PNG leaves.
        room = protocol.CHUNK - (self.png_size + 2) // 3 * 4 - FIGURE_EVENT_SLACK
        return charts.chart_json(self.fig, room)

    def __repr__(self) -> str:
        return repr(self.fig)


def transform_magics(code: str) -> str:
    """`!cmd` lines run in a shell and `%pip ...` runs pip (like IPython, line by line)."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith("!"):
            lines[i] = f"{indent}__corral_shell__({stripped[1:]!r})"
        elif stripped.startswith("%pip ") or stripped == "%pip":
            lines[i] = f"{indent}__corral_shell__({'python3 -m pip ' + stripped[4:].strip()!r})"
    return "\n".join(lines)


def _shell(cmd: str) -> None:
    import subprocess

    _flush()
    subprocess.run(cmd, shell=True)  # noqa: S602  # `!cmd` is the user asking for a shell
    _add_user_site()


def _add_user_site() -> None:
    """Make what `%pip install` (or `!pip install --user`) just put in ~/.local importable in this session.

    Python adds the user site-packages to sys.path at start only if the directory exists then; in a fresh
    sandbox it does not, so a package installed by one cell was not importable by the next (found by the eval
    corpus). IPython has the same gap; we close it.
    """
    import importlib
    import site

    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user_site) and user_site not in sys.path:
        site.addsitedir(user_site)
    importlib.invalidate_caches()


def format_object(obj: object) -> dict[str, str]:
    data: dict[str, str] = {}
    if not isinstance(obj, type):  # a class's _repr_*_ are unbound functions, not its representation
        for method, mime in REPR_METHODS:
            value = _call_repr(obj, method)
            if value is not None:
                data[mime] = _encode(mime, value)
    try:
        data["text/plain"] = repr(obj)
    except Exception as exc:
        data["text/plain"] = f"<repr failed: {type(exc).__name__}: {exc}>"
    return data


def _call_repr(obj: object, method: str) -> object:
    fn = getattr(obj, method, None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except Exception:
        return None  # a broken formatter loses that format, not the result
    if isinstance(value, tuple) and len(value) == 2:  # (data, metadata), as IPython allows
        value = value[0]
    return value


def _encode(mime: str, value: object) -> str:
    if mime in BINARY_MIMES:
        import base64

        return base64.b64encode(value).decode() if isinstance(value, bytes) else str(value)
    if mime in JSON_MIMES and not isinstance(value, str):
        return str(json.dumps(value))
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def describe_error(exc: BaseException) -> dict[str, str]:
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # our own frames, not the cell's
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {"name": type(exc).__name__, "value": str(exc), "traceback": text}


# -- bash and javascript -------------------------------------------------------------------------------

# Cells arrive NUL-terminated on bash's stdin; each one's exit status goes to the status pipe.
BASH_LOOP = ('trap : INT; while IFS= read -r -d "" __corral_cell; do eval "$__corral_cell" </dev/null; '
             'printf "%d\\n" $? >&{fd}; done')
# Inline, not a file: the agent directory the host mounts carries only Python (and its spawn shim).
NODE_DRIVER = r"""
// The javascript session's driver, run by agent/kernel.py as `node -e DRIVER STATUS_FD`.
// Cells arrive as JSON lines on stdin; each one's outcome goes to STATUS_FD as one JSON line: {"text"} for the
// last expression's value (util.inspect, as Node's REPL prints it) and/or {"error": {name, value, traceback}}.
// One persistent vm context keeps the state (var, let, const, functions) from cell to cell.
'use strict';
const fs = require('fs');
const readline = require('readline');
const util = require('util');
const vm = require('vm');

const statusFd = Number(process.argv[1]);
const sandbox = {
  console, require, process, Buffer, URL, TextEncoder, TextDecoder, setTimeout, clearTimeout, setInterval,
  clearInterval, setImmediate, clearImmediate, queueMicrotask, structuredClone, module: { exports: {} },
};
sandbox.global = sandbox;
const context = vm.createContext(sandbox);
let count = 0;

// Between cells an interrupt must not end the session; during one, breakOnSigint turns it into an error.
process.on('SIGINT', () => {});

function reply(obj) {
  fs.writeSync(statusFd, JSON.stringify(obj) + '\n');
}

function describe(err) {
  if (err instanceof Error || (err && typeof err === 'object' && 'stack' in err)) {
    // The cell's own frames only: cut where the vm module and this driver begin.
    const lines = String(err.stack).split('\n');
    const end = lines.findIndex((l) => l.includes('node:vm') || l.includes('[eval]'));
    const stack = (end < 0 ? lines : lines.slice(0, end)).join('\n');
    return { name: String(err.name || 'Error'), value: String(err.message || ''), traceback: stack };
  }
  return { name: 'Error', value: util.inspect(err), traceback: 'Uncaught ' + util.inspect(err) };
}

async function run(code) {
  count += 1;
  try {
    let value = vm.runInContext(code, context, { filename: `<cell-${count}>`, breakOnSigint: true });
    if (value && typeof value.then === 'function') value = await value;
    return value === undefined ? {} : { text: util.inspect(value) };
  } catch (err) {
    return { error: describe(err) };
  }
}

const rl = readline.createInterface({ input: process.stdin });
const queue = [];
let busy = false;
rl.on('line', (line) => {
  queue.push(JSON.parse(line).code);
  if (!busy) drain();
});
rl.on('close', () => process.exit(0));

async function drain() {
  busy = true;
  while (queue.length) reply(await run(queue.shift()));
  busy = false;
}
"""


class ChildRunner:
    """Drives a long-lived bash or node: cells in on its stdin, one status line per cell on a pipe."""

    def __init__(self, wire: Wire, language: str) -> None:
        import subprocess

        self.wire = wire
        self.language = language
        status_r, status_w = os.pipe()
        if language == "bash":
            argv = ["bash", "--noprofile", "--norc", "-c", BASH_LOOP.format(fd=status_w)]
        else:
            argv = ["node", "-e", NODE_DRIVER, str(status_w)]
        # Its stdout and stderr are ours: the pipes the forwarder reads.
        self.child = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=(status_w,))
        os.close(status_w)
        self.status = os.fdopen(status_r, "rb")

    def run(self, code: str) -> dict[str, str] | None:
        assert self.child.stdin is not None
        payload = code.replace("\x00", "") + "\x00" if self.language == "bash" else (
            json.dumps({"code": code}) + "\n")
        try:
            self.child.stdin.write(payload.encode())
            self.child.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.status.readline()
        if not line:
            # The shell exited (`exit 3` in a cell, `process.exit(3)`): so does the session, with its status,
            # which the agent reports ("the session's process ended (exit status 3)").
            status = self.child.wait()
            raise SystemExit(status if status >= 0 else 128 - status)
        if self.language == "bash":
            code_ = int(line or b"0")
            return None if code_ == 0 else {"name": "ExitStatus", "value": str(code_),
                                           "traceback": f"the cell exited with status {code_}"}
        reply = json.loads(line)
        if "text" in reply:
            self.wire.event(event="result", is_main_result=True, data={"text/plain": reply["text"]})
        err = reply.get("error")
        return err if isinstance(err, dict) else None
