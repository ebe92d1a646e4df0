"""`corral sandbox create|ls|kill|pause|resume|fork|snapshot|network|host`: sandboxes on a Corral server, through
its API (`corral exec`, `corral cp` use them); and the checkpoint commands of `_checkpoints.py`
(`checkpoint|checkpoints|restore|changes|delete-checkpoint`), registered here."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import typer
from rich.table import Table

from .._exceptions import CorralError
from .._sdk import Sandbox, SandboxInfo
from .._sdk._transport import sandbox_path
from . import _checkpoints
from ._common import (
    ApiKeyOption,
    JsonOption,
    UrlOption,
    admin,
    client,
    error_line,
    note,
    pairs,
    print_json,
    print_table,
    short_time,
)

sandbox_app = typer.Typer(help="Create, list and kill sandboxes (on the server at $CORRAL_URL).",
                          no_args_is_help=True)

def _network(value: str) -> str | list[str]:
    """`none`, `internet`, or a comma-separated allowlist: hosts, `host:port`, `*.domain`, `@packages`."""
    if value in ("none", "internet"):
        return value
    return [d.strip() for d in value.split(",") if d.strip()]


def _limits(memory: str | None, cpus: float | None, pids: int | None, disk: str | None) -> dict[str, object]:
    given = {"memory": memory, "cpus": cpus, "pids": pids, "disk": disk}
    return {k: v for k, v in given.items() if v is not None}  # the server's defaults for the rest


@sandbox_app.command("create")
def create(
    template: str = typer.Option("default", help="Template name."),
    timeout: int = typer.Option(300, help="Seconds until the sandbox is destroyed."),
    memory: str | None = typer.Option(None, help="Memory limit, e.g. 512M (default: the server's)."),
    cpus: float | None = typer.Option(None, help="CPU limit (default: the server's)."),
    pids: int | None = typer.Option(None, help="Process limit (default: the server's)."),
    disk: str | None = typer.Option(None, help="Disk quota, e.g. 1G (default: the server's)."),
    network: str = typer.Option("none", help="none, internet, or a comma-separated allowlist (hosts, host:port, "
                                "*.domain, @packages for pip/npm through the package cache)."),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable.", show_default=False),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="KEY=VALUE, repeatable.", show_default=False),
    public_ports: bool = typer.Option(False, "--public-ports", help="Let anyone reach the sandbox's ports (see "
                                      "`corral sandbox host`) without an API key."),
    volume: list[str] = typer.Option([], "--volume", "-v", help="PATH=NAME: mount the tenant's volume NAME at PATH; "
                                     "repeatable.", show_default=False),
    on_timeout: str = typer.Option("kill", "--on-timeout", help="What the end of the timeout does: kill, or pause "
                                   "(to disk: files kept, memory released; `corral sandbox resume` boots it)."),
    auto_resume: bool = typer.Option(False, "--auto-resume", help="Paused, the sandbox resumes when a command, "
                                     "file operation, code cell or port request reaches it."),
    root: bool = typer.Option(False, "--root", help="Root inside the sandbox: `corral exec --user root`, `sudo` "
                              "(root is an unprivileged host uid; not on the Docker backend)."),
    checkpoints: str | None = typer.Option(None, "--checkpoints", help="auto: take a checkpoint before each "
                                           "command, code cell and file change, to undo it with `corral sandbox "
                                           "restore` (the last 20 kept); manual: only `corral sandbox checkpoint` "
                                           "(default: the tenant's setting, else manual)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create a sandbox and print its id (it lives until its timeout or `corral sandbox kill`)."""
    sb = Sandbox.create(template, timeout=timeout, network=_network(network),
                        limits=_limits(memory, cpus, pids, disk), env=pairs(env, "--env"),
                        metadata=pairs(metadata, "--metadata"), public_ports=public_ports, on_timeout=on_timeout,
                        auto_resume=auto_resume, volumes=pairs(volume, "--volume"), root=root,
                        checkpoints=checkpoints, api_key=api_key,
                        base_url=url)
    sb.close()  # the connection only: leaving `with` (or kill()) would destroy the sandbox
    if as_json:
        print_json(dataclasses.asdict(sb.info))
    else:
        typer.echo(sb.id)


@sandbox_app.command("network")
def network(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    policy: str = typer.Argument(..., help="none, internet, or a comma-separated allowlist (see create)."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Change a live sandbox's egress policy; new connections follow it at once."""
    sb = Sandbox.connect(sandbox_id, api_key=api_key, base_url=url)
    try:
        info = sb.set_network(_network(policy))
    finally:
        sb.close()
    shown = info.network if isinstance(info.network, str) else ",".join(info.network)
    typer.echo(shown)


@sandbox_app.command("host")
def host(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    port: int = typer.Argument(..., min=1, max=65535, help="A port a server listens on inside the sandbox."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Print the host under which the server forwards HTTP and WebSockets to PORT in the sandbox
    (`<port>-<id>.<domain>:<server port>`; requests need the API key unless the sandbox has public ports)."""
    with _attached(sandbox_id, url, api_key) as sb:  # only prints a name: a paused sandbox stays paused
        typer.echo(sb.get_host(port))


@sandbox_app.command("ls")
def ls(
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="Only sandboxes with KEY=VALUE; repeatable.",
                                       show_default=False),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List the sandboxes of the key's tenant (only those whose metadata has every --metadata KEY=VALUE)."""
    found = Sandbox.list(metadata=pairs(metadata, "--metadata"), api_key=api_key, base_url=url)
    if as_json:
        print_json([dataclasses.asdict(s) for s in found])
        return
    print_table(_table(found))


def _table(sandboxes: list[SandboxInfo]) -> Table:
    table = Table("id", "state", "template", "created", "expires", "metadata")
    table.columns[0].no_wrap = True  # ids are copied from here: never wrap or cut them
    for s in sandboxes:
        meta = ", ".join(f"{k}={v}" for k, v in sorted(s.metadata.items()))
        table.add_row(s.id, s.state, s.template, short_time(s.created_at), short_time(s.expires_at), meta)
    return table


@sandbox_app.command("kill")
def kill(
    sandbox_ids: list[str] = typer.Argument(None, help="Sandbox ids.", show_default=False),
    tenant: str | None = typer.Option(None, help="Kill switch: every sandbox of this tenant (name or id)."),
    key: str | None = typer.Option(None, help="Kill switch: every sandbox created with this API key id."),
    revoke: bool = typer.Option(False, help="With --key: revoke the key too, so it cannot start new ones."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Destroy sandboxes by id, or all of a tenant's or an API key's at once (operator, admin)."""
    modes = sum(bool(x) for x in (sandbox_ids, tenant, key))
    if modes != 1:
        raise typer.BadParameter("give sandbox ids, or exactly one of --tenant or --key")
    if revoke and not key:
        raise typer.BadParameter("--revoke applies to --key")
    if sandbox_ids:
        raise typer.Exit(_kill_ids(sandbox_ids, url, api_key))
    with admin(url, api_key) as a:
        result = a.kill_all(tenant=tenant, key=key, revoke=revoke)
    if as_json:
        print_json(dataclasses.asdict(result))
    else:
        for sandbox_id in result.killed:
            typer.echo(sandbox_id)
        for sandbox_id, reason in result.failed.items():
            note(f"error: could not kill {sandbox_id}: {reason}")
    raise typer.Exit(1 if result.failed else 0)


def _kill_ids(sandbox_ids: list[str], url: str | None, api_key: str | None) -> int:
    """Kill each one even if an earlier one fails; exit 1 if any did."""
    failed = 0
    http = client(url, api_key)
    try:
        for sandbox_id in sandbox_ids:
            try:
                http.request("DELETE", sandbox_path(sandbox_id))
            except CorralError as exc:
                note(error_line(exc))
                failed += 1
    finally:
        http.close()
    return 1 if failed else 0


@contextlib.contextmanager
def _attached(sandbox_id: str, url: str | None, api_key: str | None) -> Iterator[Sandbox]:
    """The sandbox as it is (not `Sandbox.connect`, which resumes a paused one); its connection closed after."""
    http = client(url, api_key)
    try:
        sb = Sandbox(SandboxInfo.from_wire(http.request("GET", sandbox_path(sandbox_id))), http)
        yield sb
    finally:
        http.close()


def _show(info: SandboxInfo, as_json: bool) -> None:
    if as_json:
        print_json(dataclasses.asdict(info))
    else:
        typer.echo(f"{info.id} {info.state}{' (to disk)' if info.paused_to_disk else ''}")


@sandbox_app.command("pause")
def pause(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    to_disk: bool = typer.Option(False, "--to-disk", help="Release its memory and end its processes; every file "
                                 "stays (/tmp too) and its timeout stops until it resumes."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Pause a sandbox: frozen in place (memory kept), or with --to-disk, asleep on disk."""
    with _attached(sandbox_id, url, api_key) as sb:
        _show(sb.pause(memory=not to_disk), as_json)


@sandbox_app.command("resume")
def resume(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Resume a paused sandbox (one paused to disk boots again with its files)."""
    with _attached(sandbox_id, url, api_key) as sb:
        _show(sb.resume(), as_json)


@sandbox_app.command("fork")
def fork(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    timeout: int | None = typer.Option(None, help="The child's seconds to live (default: the parent's timeout)."),
    count: int | None = typer.Option(None, min=1, max=100, help="Start this many children of the same instant "
                                     "(all or none); their ids one per line."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Start a new sandbox with this one's files as they are now; print its id."""
    with _attached(sandbox_id, url, api_key) as sb:
        children = sb.fork(count=count, timeout=timeout) if count is not None else [sb.fork(timeout=timeout)]
    for child in children:
        child.close()
    if as_json:
        print_json([dataclasses.asdict(c.info) for c in children] if count is not None
                   else dataclasses.asdict(children[0].info))
    else:
        typer.echo("\n".join(c.id for c in children))


@sandbox_app.command("snapshot")
def snapshot(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    name: str | None = typer.Option(None, help="A name for it, unique among the tenant's snapshots."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Keep the sandbox's files as a snapshot (start sandboxes from it with `create --template <id>`); print its id."""
    with _attached(sandbox_id, url, api_key) as sb:
        snap = sb.snapshot(name)
    if as_json:
        print_json({k: v for k, v in dataclasses.asdict(snap).items() if not k.startswith("_")})
    else:
        typer.echo(snap.id)


for _name, _command in (("checkpoint", _checkpoints.checkpoint), ("checkpoints", _checkpoints.checkpoints),
                        ("restore", _checkpoints.restore), ("changes", _checkpoints.changes),
                        ("delete-checkpoint", _checkpoints.delete_checkpoint)):
    sandbox_app.command(_name)(_command)
