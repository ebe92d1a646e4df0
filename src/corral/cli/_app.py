"""The root `corral` command and its groups.

Everything but `serve`, `templates` and `bench` is a client of the API server (`CORRAL_URL`, `CORRAL_API_KEY`, or
`--url`/`--api-key`). A Corral error ends at the root group (`_ErrorBoundary`, so `main()` and typer's test
runner behave alike): one line, `error: <code>: <message>`, on stderr and exit status 1 (2 for usage errors);
never a traceback.

Each command's module is imported only when that command runs (or shows its own `--help`): `_COMMANDS` holds the
line `corral --help` shows for it. So a client command loads the SDK alone, and a command that needs an extra
which is not installed (`serve`, `eval run --local`: `corral[server]`) fails with one line that says what to
install.

Help is plain text: no command's help is read as Rich markup (`_HELP_MARKUP`), so a bracket in it
(`TEMPLATE[/root]=SIZE`) is shown as written instead of failing as a closing tag. typer hands the mode of the
`Typer` a tree is built from to every group and command below it, and every command is built from one of two
(`app`, `_Command.load`'s host), so these two carry it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from .. import __version__
from .._exceptions import CorralError
from .._logging import LOG_FORMATS, JSONFormatter, log_as_json
from ._common import error_line

# None: help text is printed as written (click's formatter), never parsed as Rich markup or Markdown.
_HELP_MARKUP = None

# The import names of what each extra installs (pyproject.toml's optional-dependencies, and what they bring;
# tests/test_client_standalone.py checks the two agree): a command that fails to import one names the extra.
_EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("fastapi", "starlette", "uvicorn", "h11", "sqlalchemy", "greenlet", "aiosqlite", "asyncpg",
                     "pydantic", "pydantic_core", "idna", "httptools", "python_multipart", "multipart", "zstandard",
                     "prometheus_client", "cryptography"),
                   "server"),
    "docker": "docker",
    **dict.fromkeys(("mcp", "mcp_types", "httpx2", "httpcore2", "sse_starlette"), "mcp"),
    **dict.fromkeys(("kubernetes_asyncio", "aiohttp"), "kubernetes"),
}


def missing_extra(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """The one line for a command that needs an extra which is not installed; None if `exc` is another problem."""
    module = (exc.name or "").partition(".")[0]
    extra = _EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    what = f"`corral {command}`" if command else "this command"
    return (f"error: {what} needs the {extra} extra (module {module!r} is not installed): "
            f"install corral[{extra}] (pip install 'corral[{extra}]')")


@dataclass(frozen=True)
class _Command:
    """A command of `corral`, from `corral.cli.<module>.<attr>` (a `typer.Typer` group or a command function)."""

    module: str
    attr: str
    help: str

    def load(self, name: str) -> Any:  # a click Command (whose class moved between typer versions)
        obj = getattr(importlib.import_module(f"{__package__}.{self.module}"), self.attr)
        # built as the root would have built it with add_typer/command (and so with the root's markup mode)
        host = typer.Typer(add_completion=False, rich_markup_mode=_HELP_MARKUP)
        if isinstance(obj, typer.Typer):
            host.add_typer(obj, name=name)
        else:
            host.command(name)(obj)
        return typer.main.get_group(host).commands[name]


_COMMANDS: dict[str, _Command] = {
    "sandbox": _Command("_sandbox", "sandbox_app", "Create, list and kill sandboxes (on the server at $CORRAL_URL)."),
    "exec": _Command("_exec", "exec_command", "Run a command in a sandbox, streaming its output here, and exit "
                                              "with its exit code."),
    "run-code": _Command("_code", "run_code_command", "Run code in a sandbox's stateful code session, like a "
                                                      "notebook cell."),
    "cp": _Command("_cp", "cp", "Copy a file or directory into a sandbox (LOCAL ID:PATH) or out of one "
                                "(ID:PATH LOCAL)."),
    "snapshot": _Command("_snapshots", "snapshot_app", "List and delete snapshots (start sandboxes from one with "
                         "`sandbox create --template <snapshot id>`)."),
    "volume": _Command("_volumes", "volume_app", "Create, list and delete volumes: storage that outlives sandboxes."),
    "secret": _Command("_secrets", "secret_app", "Store, list and delete secrets that sandboxes use without ever "
                       "holding them; reseal them under a new key."),
    "tenants": _Command("_tenants", "tenants_app", "Create, list and update tenants (admin)."),
    "keys": _Command("_keys", "keys_app", "Create, list and revoke API keys (admin)."),
    "audit": _Command("_audit", "audit_app", "Verify, export and follow the audit trail."),
    "templates": _Command("_templates", "templates_app", "Build, import, list and push sandbox templates."),
    "bench": _Command("_bench", "bench_app", "Benchmarks (medians, p95 and ratios to a baseline measured in the "
                                             "same run)."),
    "eval": _Command("_eval", "eval_app", "The evaluation corpus: run it against a sandbox service, report, "
                                          "compare."),
    "k8s": _Command("_k8s", "k8s_app", "Kubernetes: print the reference deployment, or what the backend creates "
                                       "for one sandbox, as YAML."),
    "egress-proxy": _Command("_egress_proxy", "egress_proxy_command", "Run the egress proxy for sandboxes on "
                             "other machines (Kubernetes Pods), with the servers' database and secret."),
    "mcp": _Command("_mcp", "mcp_command", "Serve Corral's sandbox tools to an MCP client over stdio (a relay to "
                                           "the server's /mcp)."),
    "check": _Command("_check", "check_command", "Prove the sandbox checklist (items 1-44) against a "
                                                 "running deployment, or a private server on --backend; exit 1 "
                                                 "if any item fails, 3 if it was skipped."),
}


class _StandIn(TyperCommand):
    """A command of `_COMMANDS` before it is loaded: its name and help line, for `corral --help`."""


class _ErrorBoundary(TyperGroup):
    """Every subcommand runs inside the root group's `invoke`: a `CorralError` becomes one line and exit 1.

    The commands of `_COMMANDS` are stand-ins until one is resolved to run; then it replaces its stand-in.
    """

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        defined = dict(self.commands)  # `serve`, `version`: defined in this module
        self.commands.clear()
        self.commands.update({name: _StandIn(name, help=command.help) for name, command in _COMMANDS.items()})
        self.commands.update(defined)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else ""
        if isinstance(self.commands.get(name), _StandIn):
            ctx.invoked_subcommand = name  # (set again by click right after) so that an import error names it
            self.commands[name] = _COMMANDS[name].load(name)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: Any) -> Any:  # a click Context (whose class moved between typer versions)
        try:
            return super().invoke(ctx)
        except CorralError as exc:
            typer.echo(error_line(exc), err=True)
            ctx.exit(1)
        except ModuleNotFoundError as exc:  # an extra is not installed: say which, not a traceback
            line = missing_extra(exc, ctx.invoked_subcommand)
            if line is None:
                raise
            typer.echo(line, err=True)
            ctx.exit(1)
        except OSError as exc:  # local files (`cp`, `audit export --out`): say which and why
            if isinstance(exc, BrokenPipeError):
                raise  # the reader of our stdout left (`| head`): click exits quietly
            where = f": {exc.filename}" if exc.filename else ""
            typer.echo(f"error: {exc.strerror or exc}{where}", err=True)
            ctx.exit(1)


app = typer.Typer(name="corral", help="Corral: isolated sandboxes for AI agents, on your own machines.",
                  cls=_ErrorBoundary, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=_HELP_MARKUP)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Structured (JSON) logs on stderr.")) -> None:
    if verbose:
        log_as_json()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(7770, help="Port to listen on."),
    db: str | None = typer.Option(None, "--db", help="Database URL (default $CORRAL_DB_URL, else SQLite in "
                                  "$CORRAL_HOME); postgresql://... lets several servers share one."),
    max_sandboxes: int | None = typer.Option(None, min=1, help="At most this many sandboxes on this machine."),
    memory_overcommit: float = typer.Option(4.0, min=0.1, help="Sandbox memory limits may add up to this many "
                                            "times physical memory."),
    backend: str = typer.Option("local", help="Where sandboxes run: local (runc/runsc OCI bundles), docker "
                                "(a local dockerd; needs corral[docker]) or kubernetes (Pods; needs "
                                "corral[kubernetes], CORRAL_K8S_*). See docs/backends.md."),
    domain: str = typer.Option("localhost", help="Sandboxes' ports are served on this port at "
                               "<port>-<sandbox id>.<domain> (a wildcard DNS name to this server). See docs/ports.md."),
    e2b_alias: list[str] = typer.Option([], "--e2b-alias", help="NAME=TEMPLATE: the template an E2B templateID "
                                        "means (repeatable; default base=default, code-interpreter-v1=polyglot "
                                        "where that template is built, else default). "
                                        "See docs/e2b.md."),
    e2b_root: bool = typer.Option(True, "--e2b-root/--no-e2b-root", help="Sandboxes made through E2B's API have "
                                  "root (user=\"root\", sudo), as E2B's do, where the backend allows it. See "
                                  "docs/security.md."),
    replica_id: str | None = typer.Option(None, "--replica-id", help="This server's id among replicas sharing "
                                          "one database (default $CORRAL_REPLICA_ID, else one kept in "
                                          "$CORRAL_HOME/replica.id). See docs/replicas.md."),
    advertise_url: str | None = typer.Option(None, "--advertise-url", help="Where the other replicas reach "
                                             "this one (default $CORRAL_ADVERTISE_URL, else http://HOST:PORT)."),
    replica_ttl: float = typer.Option(15.0, "--replica-ttl", min=0.5, help="Seconds without a heartbeat after "
                                      "which a replica counts as stopped and its sandboxes as lost."),
    cache_ttl: float = typer.Option(5.0, "--cache-ttl", min=0.0, help="Seconds API keys and sandbox records are "
                                    "served from memory: a key revoked through another replica still works here "
                                    "for at most this long (0: read the database every request)."),
    log_format: str = typer.Option("text", "--log-format", help="text (for people), or json: one JSON object "
                                   "per line, one line per request (request id, tenant, key, action, sandbox, "
                                   "outcome, status, duration). See docs/operations.md."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="Count Prometheus metrics and serve them at "
                                 "/metrics to admin keys. See docs/operations.md."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535, help="Also serve /metrics "
                                            "on this port, without authentication (for a scraper)."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Address of the --metrics-port "
                                     "listener; anyone who reaches it reads every tenant's counts."),
    upstream_ca: Path | None = typer.Option(None, "--upstream-ca", exists=True, dir_okay=False, readable=True,
                                            help="A PEM file of CA certificates the egress proxy also trusts when it "
                                            "verifies hosts that secrets are bound to (a TLS-inspecting gateway's "
                                            "CA). See docs/secrets.md."),
    pool: list[str] = typer.Option([], "--pool", help="TEMPLATE[/root][/runsc]=SIZE[:REFILL]: keep SIZE sandboxes "
                                   "of the template started ahead of demand, refilled at most REFILL a second; "
                                   "SIZE auto: the pool sizes itself (a few at rest, growing to the largest recent "
                                   "burst of creates, within capacity and a memory budget, shrinking when idle); "
                                   "SIZE 0: none (repeatable; default $CORRAL_POOLS). On the local backend the "
                                   "default template has a self-sizing pool unless one given names it. See "
                                   "docs/performance.md."),
    no_pool: bool = typer.Option(False, "--no-pool", help="No warm pool at all, not even the self-sizing one of "
                                 "the default template."),
) -> None:
    """Run the API server (state, templates and sandboxes in $CORRAL_HOME, default /var/lib/corral)."""
    from .. import _settings as settings
    from ..backends import BACKEND_NAMES
    from ..e2b import E2BConfig, interpreter_alias, parse_alias
    from ..engine import Capacity, parse_pools, pools_notice, serve_pools
    from ..server import MetricsPort
    from ..server import serve as run_server
    from ..service import ReplicaConfig
    from ..templates import TemplateStore  # FastAPI and uvicorn load only for this command

    if backend not in BACKEND_NAMES:
        raise typer.BadParameter(f"choose one of {', '.join(BACKEND_NAMES)}", param_hint="--backend")
    if log_format not in LOG_FORMATS:
        raise typer.BadParameter(f"choose one of {', '.join(LOG_FORMATS)}", param_hint="--log-format")
    if metrics_port is not None and not metrics:
        raise typer.BadParameter("--metrics-port serves the metrics that --no-metrics turns off",
                                 param_hint="--metrics-port")
    try:
        given = dict(parse_alias(text) for text in e2b_alias)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--e2b-alias") from None
    templates = TemplateStore(settings.corral_home())
    aliases, which = interpreter_alias(given, templates.exists)
    _startup_notice(which, "corral.e2b", log_format)
    capacity = Capacity(max_sandboxes=max_sandboxes, memory_overcommit=memory_overcommit)
    if no_pool and pool:
        raise typer.BadParameter("--no-pool turns off the pools that --pool configures: give one", param_hint="--pool")
    try:
        configured = [] if no_pool else parse_pools(pool or [settings.warm_pools() or ""])
    except CorralError as exc:
        raise typer.BadParameter(exc.message, param_hint="--pool") from None
    # The README's server: bursts of the default template served warm (docs/performance.md, "Warm pools").
    pools = serve_pools(configured, default=not no_pool and backend == "local" and templates.exists("default"))
    _startup_notice(pools_notice(pools), "corral.engine", log_format)
    try:
        replica = ReplicaConfig(id=replica_id or settings.replica_id(),
                                url=advertise_url or settings.advertise_url() or f"http://{host}:{port}",
                                secret=settings.replica_secret(), ttl=replica_ttl)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--replica-id") from None
    run_server(host, port, db_url=db, capacity=capacity, backend=backend, domain=domain,
               e2b=E2BConfig(aliases=aliases, root=e2b_root), replica=replica, cache_ttl=cache_ttl,
               log_format=log_format, metrics=metrics,
               metrics_port=None if metrics_port is None else MetricsPort(metrics_port, metrics_host),
               upstream_ca=upstream_ca, pools=pools)


def _startup_notice(message: str, logger: str, log_format: str) -> None:
    """Said before the server starts, in the form its other startup notices take (one JSON object a line for
    json, with the fields every other JSON line has: time, level, logger, event)."""
    if log_format == "text":
        typer.echo(message)
    else:
        typer.echo(JSONFormatter().format(logging.makeLogRecord({"name": logger, "levelno": logging.INFO,
                                                                  "levelname": "INFO", "msg": message})))


@app.command()
def version() -> None:
    """Print Corral's version."""
    typer.echo(__version__)


def _validation_problems(exc: Exception) -> str | None:
    """A pydantic ValidationError's problems in one line (None for anything else). pydantic is the server's
    (engine specs); it is not imported for this: if it was never imported, `exc` cannot be one of its errors."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(exc, pydantic.ValidationError):
        return None
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def main() -> None:
    try:
        app()
    except CorralError as exc:
        typer.echo(error_line(exc), err=True)
        sys.exit(1)
    except ValueError as exc:  # pydantic's ValidationError is one
        problems = _validation_problems(exc)
        if problems is None:
            raise
        typer.echo(f"error: invalid_request: {problems}", err=True)
        sys.exit(2)
