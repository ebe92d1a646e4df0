"""The root `corral` command and its groups."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import typer
from pydantic import ValidationError

from .. import __version__
from .._exceptions import CorralError
from ._bench import bench_app
from ._sandbox import sandbox_app
from ._templates import templates_app

app = typer.Typer(name="corral", help="Corral: isolated sandboxes for AI agents, on your own machines.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(templates_app, name="templates")
app.add_typer(bench_app, name="bench")


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
) -> None:
    """Run the API server (state, templates and sandboxes in $CORRAL_HOME, default /var/lib/corral)."""
    from ..server import serve as run_server  # FastAPI and uvicorn load only for this command

    run_server(host, port)


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
        typer.echo(f"error: {exc.message}", err=True)
        sys.exit(1)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        typer.echo(f"error: invalid input: {problems}", err=True)
        sys.exit(2)
