"""`corral run-code ID [CODE | -]`: run a cell in a sandbox's code session, its output streamed here byte for
byte, the main result's text printed, images and HTML saved with `--save-dir`; exit 1 when the cell raised."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .._sdk import CodeInterpreter, Execution, Result
from ._common import ApiKeyOption, UrlOption, client, note
from ._exec import TIMED_OUT_EXIT, _writer

# The formats saved as files, best first: one file per result, in the first of these it has.
SAVED_FORMATS = ("png", "jpeg", "svg", "html")
_SUFFIX = {"png": "png", "jpeg": "jpg", "svg": "svg", "html": "html"}


def _code(code: str | None) -> str:
    """The cell: the argument, or stdin for `-` or none (a terminal is never waited on)."""
    if code is not None and code != "-":
        return code
    if sys.stdin is None or sys.stdin.isatty():
        raise typer.BadParameter("give the code as an argument, or pipe it in with '-'", param_hint="CODE")
    return sys.stdin.read()


def save_results(results: tuple[Result, ...], save_dir: Path) -> list[Path]:
    """Write each image or HTML result to `save_dir` as result-1.png, result-2.html, ... (numbered in the
    order the cell produced them, counting every result, so the numbers match `ex.results`)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    for number, result in enumerate(results, start=1):
        fmt = next((f for f in SAVED_FORMATS if getattr(result, f) is not None), None)
        if fmt is None:
            continue
        path = save_dir / f"result-{number}.{_SUFFIX[fmt]}"
        value = getattr(result, fmt)
        if isinstance(value, bytes):
            path.write_bytes(value)
        else:
            path.write_text(value, encoding="utf-8")
        saved.append(path)
    return saved


def _unsaved(results: tuple[Result, ...]) -> int:
    return sum(1 for r in results if any(getattr(r, f) is not None for f in SAVED_FORMATS))


def report(execution: Execution, save_dir: Path | None, timeout: float | None) -> int:
    """Print what the streamed output did not show (main result, saved files, error) and return the exit code."""
    if execution.text is not None:
        print(execution.text, flush=True)
    if save_dir is not None:
        for path in save_results(execution.results, save_dir):
            note(f"corral: saved {path}")
    elif count := _unsaved(execution.results):
        note(f"corral: {count} rich result(s) (images, HTML) not shown; use --save-dir to save them")
    if execution.error is not None:
        sys.stderr.write(execution.error.traceback or f"{execution.error.name}: {execution.error.value}")
        sys.stderr.write("" if execution.error.traceback.endswith("\n") else "\n")
        sys.stderr.flush()
    if execution.session_restarted:
        note("corral: the session was restarted: its state is gone")
    if execution.timed_out:
        note(f"corral: timed out after {timeout:g}s; the cell was interrupted" if timeout
             else "corral: timed out; the cell was interrupted")
        return TIMED_OUT_EXIT
    if execution.oom_killed:
        note("corral: killed: the sandbox ran out of memory")
        return 1
    return 1 if execution.error is not None else 0


def run_code_command(
    sandbox_id: str = typer.Argument(..., help="The sandbox id."),
    code: str | None = typer.Argument(None, help="The code to run; '-' or none reads it from stdin.",
                                      show_default=False),
    language: str = typer.Option("python", help="python, bash or javascript."),
    session: str | None = typer.Option(None, help="The session to run in (default: one per language); state persists "
                                                  "between calls to the same session.", show_default=False),
    timeout: float | None = typer.Option(None, help="Seconds before the cell is interrupted (exit 124)."),
    save_dir: Path | None = typer.Option(None, "--save-dir", help="Save image and HTML results here as "
                                         "result-N.png/.jpg/.svg/.html.", file_okay=False, show_default=False),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Run code in a sandbox's stateful code session, like a notebook cell.

    stdout and stderr are streamed here; then the value of the last expression is printed. Exits 1 when the
    cell raised (its traceback on stderr), 124 when it timed out.
    """
    source = _code(code)
    http = client(url, api_key)
    try:
        execution = CodeInterpreter(http, sandbox_id).run(
            source, language=language, session=session, timeout=timeout,
            on_stdout=_writer(sys.stdout.buffer), on_stderr=_writer(sys.stderr.buffer))
    finally:
        http.close()
    raise typer.Exit(report(execution, save_dir, timeout))
