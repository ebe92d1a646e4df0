"""The root `corral` command and its groups.

Everything but `serve`, `templates` and `bench` is a client of the API server (`CORRAL_URL`, `CORRAL_API_KEY`, or
`--url`/`--api-key`). A Corral error ends at the root group (`_ErrorBoundary`, so `main()` and typer's test
runner behave alike): one line, `error: <code>: <message>`, on stderr and exit status 1 (2 for usage errors);
never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from .. import __version__
from .._exceptions import CorralError
from ._audit import audit_app
from ._bench import bench_app
from ._check import check_command
from ._code import run_code_command
from ._common import error_line
from ._cp import cp
from ._eval import eval_app
from ._exec import exec_command
from ._keys import keys_app
from ._sandbox import sandbox_app
from ._templates import templates_app
from ._tenants import tenants_app


class _ErrorBoundary(TyperGroup):
    """Every subcommand runs inside the root group's `invoke`: a `CorralError` becomes one line and exit 1."""

    def invoke(self, ctx: Any) -> Any:  # a click Context (whose class moved between typer versions)
        try:
            return super().invoke(ctx)
        except CorralError as exc:
            typer.echo(error_line(exc), err=True)
            ctx.exit(1)
        except OSError as exc:  # local files (`cp`, `audit export --out`): say which and why
            if isinstance(exc, BrokenPipeError):
                raise  # the reader of our stdout left (`| head`): click exits quietly
            where = f": {exc.filename}" if exc.filename else ""
            typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
            ctx.exit(1)


app = typer.Typer(name="corral", help="Corral: isolated sandboxes for AI agents, on your own machines.",
                  cls=_ErrorBoundary, no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(sandbox_app, name="sandbox")
app.command("exec")(exec_command)
app.command("run-code")(run_code_command)
app.command("cp")(cp)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(audit_app, name="audit")
app.add_typer(templates_app, name="templates")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")
app.command("check")(check_command)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Structured (JSON) logs on stderr.")) -> None:
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JSONFormatter())
        logging.basicConfig(level=logging.INFO, handlers=[handler])


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(7770, help="Port to listen on."),
    db: str | None = typer.Option(None, "--db", help="Database URL (default $CORRAL_DB_URL, else SQLite in "
                                  "$CORRAL_HOME); postgresql://... lets several servers share one."),
    max_sandboxes: int | None = typer.Option(None, min=1, help="At most this many sandboxes on this machine."),
    memory_overcommit: float = typer.Option(4.0, min=0.1, help="Sandbox memory limits may add up to this many "
                                            "times physical memory."),
) -> None:
    """Run the API server (state, templates and sandboxes in $CORRAL_HOME, default /var/lib/corral)."""
    from ..engine import Capacity
    from ..server import serve as run_server  # FastAPI and uvicorn load only for this command

    capacity = Capacity(max_sandboxes=max_sandboxes, memory_overcommit=memory_overcommit)
    run_server(host, port, db_url=db, capacity=capacity)


@app.command()
def version() -> None:
    """Print Corral's version."""
    typer.echo(__version__)


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event, and every `extra` field."""

    _SKIP = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self._SKIP})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def main() -> None:
    try:
        app()
    except CorralError as exc:
        typer.echo(error_line(exc), err=True)
        sys.exit(1)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        typer.echo(f"error: invalid_request: {problems}", err=True)
        sys.exit(2)
