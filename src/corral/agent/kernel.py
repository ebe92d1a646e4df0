"""A code session's own process: runs cells, one at a time, for the agent (see docs/code.md).

Started by the agent as `python3 -B -c "...; from agent.kernel import main; main()" LANGUAGE [OPTIONS]` in the
session's working directory, OPTIONS being JSON (`show_saved_images`; `typescript`, the TypeScript compiler's module
directory). It reads `REQUEST` frames (`{"code": ..., "env": {...}}`, `env` being set for that cell only) on its
stdin and writes the agent's frames on its stdout: `STDOUT`/`STDERR` bytes as the cell writes them,
`EVENT {"event": "result", ...}` for each rich result, and one `EVENT {"event": "done", "error": ...}` per cell.
Before reading the first cell it says `EVENT {"event": "ready"}`.

The cell's own fds 1 and 2 are pipes this process reads (so subprocesses stream too, bytes exact) and its stdin
is /dev/null: the protocol fds are private duplicates the cell never sees.

For `python` the cell runs here; for the other languages this process drives a long-lived child (bash, node,
Rscript, java: `agent/drivers.py`) that shares those output pipes and answers each cell on a pipe of its own.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import sys
import threading

from . import charts, drivers, notebook, protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

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
    ("_repr_pdf_", "application/pdf"),
    ("_repr_javascript_", "application/javascript"),
    ("_repr_e2b_chart_", "e2b/chart"),  # E2B's: a figure's data as a chart (agent/charts.py)
)
BINARY_MIMES = frozenset({"image/png", "image/jpeg", "application/pdf"})
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
        # Output goes in frames of a chunk; an event is read whole, so it is one frame (up to MAX_FRAME).
        step = (len(payload) or 1) if kind in protocol.JSON_KINDS else protocol.CHUNK
        for i in range(0, max(len(payload), 1), step):
            view = memoryview(protocol.encode(kind, payload[i : i + step]))
            while view:
                view = view[os.write(self.fd, view) :]

    def event(self, **fields: Any) -> None:
        payload = json.dumps(fields, separators=(",", ":")).encode()
        if len(payload) > protocol.MAX_FRAME and isinstance(fields.get("data"), dict):
            payload = self._fitted(fields)
        self.send(protocol.EVENT, payload)

    def _fitted(self, fields: dict[str, Any]) -> bytes:
        """A result too big for one frame: its largest formats are left out (text/plain stays, cut if it must)
        until it fits, and the cell's stderr says which, so nothing is lost silently."""
        data = dict(fields["data"])
        dropped = []
        while True:
            payload = json.dumps({**fields, "data": data}, separators=(",", ":")).encode()
            if len(payload) <= protocol.MAX_FRAME:
                break
            others = [m for m in data if m != "text/plain"]
            if others:
                mime = max(others, key=lambda m: len(str(data[m])))
                dropped.append(f"{mime} ({len(str(data.pop(mime)))} bytes)")
            else:
                text = str(data.get("text/plain", ""))
                data["text/plain"] = text[: max(0, len(text) - (len(payload) - protocol.MAX_FRAME) - 64)]
                dropped.append("the end of text/plain")
        note = (f"corral: a result was too large for one message ({protocol.MAX_FRAME} bytes); left out: "
                f"{', '.join(dropped)}\n")
        self.send(protocol.STDERR, note.encode())
        return payload

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
    options: dict[str, Any] = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    # The `agent` package must not shadow a user's own module of that name.
    for name in [n for n in sys.modules if n == "agent" or n.startswith("agent.")]:
        del sys.modules[name]
    if sys.path and sys.path[0] == os.path.dirname(os.path.dirname(os.path.abspath(__file__))):
        del sys.path[0]
    proto_in, _, wire = _setup_fds()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a pipe: streamed line by line
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    threading.Thread(target=wire.forward, daemon=True).start()
    runner = PythonRunner(wire, options) if language == "python" else ChildRunner(wire, language, options)
    _ignore_sigint()
    wire.event(event="ready")
    while (req := read_request(proto_in)) is not None:
        env = req.get("env") or {}
        error = runner.run(str(req.get("code", "")), {str(k): str(v) for k, v in env.items()})
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
    def __init__(self, wire: Wire, options: dict[str, Any]) -> None:
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
        notebook.install(self.display, self._flush_figures,
                         show_saved_images=bool(options.get("show_saved_images")))

    def display(self, *objs: object, raw: bool = False, **_: Any) -> None:
        """IPython's `display`: each object as a result; with `raw=True`, each is a mime bundle already."""
        for obj in objs:
            if raw and isinstance(obj, dict):
                _flush()
                self.wire.drain()
                data = {str(mime): json.dumps(value) if isinstance(value, dict | list) else _encode(str(mime), value)
                        for mime, value in obj.items()}
                self.wire.event(event="result", is_main_result=False, data=data)
            else:
                self.emit(obj, main=False)

    def emit(self, obj: object, *, main: bool) -> None:
        _flush()
        self.wire.drain()  # what was printed before the result comes before it
        self.wire.event(event="result", is_main_result=main, data={**format_object(obj), **data_mimes(obj)})

    def run(self, code: str, env: dict[str, str]) -> dict[str, str] | None:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return self._run(code)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def _run(self, code: str) -> dict[str, str] | None:
        import signal

        self.count += 1
        filename = f"<cell-{self.count}>"
        try:
            signal.signal(SIGINT, signal.default_int_handler)
            value = self._execute(transform_magics(leading_indent(code)), filename)
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


def leading_indent(code: str) -> str:
    """A cell indented as a whole (a triple-quoted string in the caller's code) loses that indent, as in IPython.

    Its first non-blank line's indent goes from every line that starts with it; blank lines stay, so that line
    numbers in tracebacks are the cell's own."""
    lines = code.split("\n")
    first = next((line for line in lines if line.strip()), "")
    indent = first[: len(first) - len(first.lstrip(" \t"))]
    if not indent:
        return code
    return "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines)


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


def data_mimes(obj: object) -> dict[str, str]:
    """Mime types besides IPython's: a pandas DataFrame's columns as `e2b/data` (JSON `{column: [values]}`, E2B's
    structured data; timestamps in ISO 8601, NaN as null)."""
    pandas = sys.modules.get("pandas")  # a DataFrame exists only if the cell imported pandas
    if pandas is None or not isinstance(obj, pandas.DataFrame):
        return {}
    try:
        columns = obj.to_dict(orient="list")
        return {"e2b/data": json.dumps({str(k): [_plain(v) for v in values] for k, values in columns.items()})}
    except Exception:  # an exotic frame loses this format, not the result
        return {}


def _plain(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


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
    if isinstance(exc, SyntaxError) and not isinstance(exc.__cause__, BaseException):
        tb = None  # the cell did not run: the frames are the parser's (ast.parse), the cell's line is in exc
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {"name": type(exc).__name__, "value": str(exc), "traceback": text}


# -- bash, javascript, typescript, r and java ------------------------------------------------------------


class ChildRunner:
    """Drives a long-lived bash, node, Rscript or java (agent/drivers.py): cells in on one pipe, answers out on
    another; the child's stdout and stderr are ours, the pipes the forwarder reads."""

    def __init__(self, wire: Wire, language: str, options: dict[str, Any]) -> None:
        import shutil
        import subprocess

        self.wire = wire
        self.language = language
        cells_r, cells_w = os.pipe()
        status_r, status_w = os.pipe()
        workdir = None
        try:
            argv, workdir = _driver_argv(language, cells_r, status_w, options)
            self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(cells_r, status_w))
        finally:
            os.close(cells_r)
            os.close(status_w)
        self.cells = cells_w
        self.status = os.fdopen(status_r, "rb")
        try:
            if language != "bash":
                self._ready()
        finally:
            if workdir is not None:  # the driver has read its source by now
                shutil.rmtree(workdir, ignore_errors=True)

    def run(self, code: str, env: dict[str, str]) -> dict[str, str] | None:
        if self.language == "bash":
            setup, restore = _bash_env(env)
            self._send("\x00".join([setup, code.replace("\x00", ""), restore]).encode() + b"\x00")
            line = self.status.readline()
            if not line:
                self._exited()
            status = int(line or b"0")
            return None if status == 0 else {"name": "ExitStatus", "value": str(status),
                                              "traceback": f"the cell exited with status {status}"}
        parts = [code, *(item for pair in env.items() for item in pair)]
        frame = bytearray(f"{len(parts)}\n".encode())
        for part in parts:
            data = part.encode(errors="surrogateescape")
            frame += f"{len(data)}\n".encode() + data
        self._send(bytes(frame))
        return self._answer()

    def _send(self, data: bytes) -> None:
        try:
            _write_all(self.cells, data)
        except BrokenPipeError:
            pass  # it exited: the status pipe says so

    def _answer(self) -> dict[str, str] | None:
        error: dict[str, str] = {}
        while (message := self._message()) is not None:
            tag, payload = message
            if tag in ("out", "err"):
                self.wire.send(protocol.STDOUT if tag == "out" else protocol.STDERR, payload)
            elif tag in ("result", "display"):
                self.wire.drain()  # what the child printed before comes before the result
                self.wire.event(event="result", is_main_result=tag == "result",
                                data={"text/plain": payload.decode(errors="replace")})
            elif tag in ("ename", "evalue", "etrace"):
                error[{"ename": "name", "evalue": "value", "etrace": "traceback"}[tag]] = payload.decode(
                    errors="replace")
            elif tag == "done":
                return {"name": "Error", "value": "", "traceback": "", **error} if error else None
        self._exited()

    def _ready(self) -> None:
        message = self._message()
        if message is None or message[0] != "ready":
            self.wire.drain()  # its last words (on our stderr) reach the agent first
            self._exited()

    def _message(self) -> tuple[str, bytes] | None:
        head = self.status.readline()
        if not head:
            return None
        tag, _, size = head.decode().partition(" ")
        return tag, self.status.read(int(size))

    def _exited(self) -> NoReturn:
        # The child exited (`exit 3` in a bash cell, `process.exit(3)`, `quit(status = 3)`): so does the session,
        # with its status, which the agent reports ("the session's process ended (exit status 3)").
        status = self.child.wait()
        raise SystemExit(status if status >= 0 else 128 - status)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _driver_argv(language: str, cells: int, status: int, options: dict[str, Any]) -> tuple[list[str], str | None]:
    """The child's command line, and the temporary directory holding its driver's source (if written)."""
    if language == "bash":
        return ["bash", "--noprofile", "--norc", "-c", drivers.BASH_LOOP.format(cells=cells, status=status)], None
    if language in ("javascript", "typescript"):
        typescript = [str(options.get("typescript") or "")] if language == "typescript" else []
        return ["node", "--expose-internals", "-e", drivers.NODE_DRIVER, str(cells), str(status), *typescript], None
    import tempfile

    workdir = tempfile.mkdtemp(prefix="corral-kernel-")  # private (0700): the driver's source, until it started
    if language == "r":
        source = os.path.join(workdir, "driver.R")
        argv = ["Rscript", source, str(cells), str(status)]
        text = drivers.R_DRIVER
    else:
        source = os.path.join(workdir, "CorralJShell.java")
        # Serial GC: fewer threads (the sandbox's pids limit) and less memory, for a REPL's small heaps.
        argv = ["java", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", source, str(cells), str(status)]
        text = drivers.JAVA_DRIVER
    with open(source, "w", encoding="utf-8") as f:
        f.write(text)
    return argv, workdir


def _bash_env(env: dict[str, str]) -> tuple[str, str]:
    """Shell code that sets a cell's environment variables, and code that puts back what they were."""
    import shlex

    setup, restore = [], []
    for name, value in env.items():  # names are identifiers: the agent checked them
        setup.append(f'if [ -n "${{{name}+x}}" ]; then __corral_saved_{name}="${name}"; __corral_had_{name}=1; '
                     f'else __corral_had_{name}=; fi; export {name}={shlex.quote(value)}')
        restore.append(f'if [ -n "$__corral_had_{name}" ]; then export {name}="$__corral_saved_{name}"; '
                       f'else unset {name}; fi; unset __corral_saved_{name} __corral_had_{name}')
    return "\n".join(setup), "\n".join(restore)
