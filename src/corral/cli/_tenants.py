"""`corral tenants create|ls|update|grants|grant-private|revoke-private` (admin): the tenants of a Corral server,
their quotas and the private destinations granted to them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import typer
from rich.table import Table

from .._sdk import TenantInfo
from .._sizes import parse_size
from ._common import ApiKeyOption, JsonOption, UrlOption, admin, print_json, print_table

tenants_app = typer.Typer(help="Create, list and update tenants (admin).", no_args_is_help=True)

_UNLIMITED = ("none", "unlimited")
_LIMIT_HELP = "'none' removes the limit."
_RUNTIME_HELP = ("'runsc': every sandbox of the tenant runs on gVisor, whatever its callers ask (a create asking "
                 "for runc is upgraded); 'any': no requirement. See docs/security.md.")


def _tenant_out(tenant: TenantInfo, as_json: bool) -> None:
    if as_json:
        print_json(dataclasses.asdict(tenant))
    else:
        typer.echo(tenant.id)


@tenants_app.command("create")
def create(
    name: str = typer.Argument(..., help="1 to 128 letters, digits, '.', '_' or '-'."),
    runtime: str | None = typer.Option(None, "--runtime", help=f"The runtime it requires. {_RUNTIME_HELP}"),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create a tenant and print its id."""
    with admin(url, api_key) as a:
        _tenant_out(a.tenants.create(name, required_runtime=runtime), as_json)


@tenants_app.command("ls")
def ls(as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List tenants with their quotas."""
    with admin(url, api_key) as a:
        tenants = a.tenants.list()
    if as_json:
        print_json([dataclasses.asdict(t) for t in tenants])
        return
    table = Table("name", "id", "disabled", "runtime", "quotas")
    for t in tenants:
        quotas = ", ".join(f"{k}={v}" for k, v in sorted(t.quotas.items()) if v is not None)
        table.add_row(t.name, t.id, "yes" if t.disabled else "", t.required_runtime or "", quotas or "-")
    print_table(table)


def _limit(parse: Callable[[str], int | float]) -> Callable[[str], int | float | None]:
    def convert(value: str) -> int | float | None:
        if value.lower() in _UNLIMITED:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc

    return convert


def _size(value: str) -> int:
    return parse_size(value)


_PARSERS: dict[str, Callable[[str], int | float | None]] = {
    "max_sandboxes": _limit(int), "max_memory_bytes": _limit(_size), "max_cpus": _limit(float),
    "max_sandbox_memory_bytes": _limit(_size), "max_sandbox_cpus": _limit(float),
    "max_sandbox_disk_bytes": _limit(_size), "max_sandbox_timeout": _limit(float),
    "max_paused": _limit(int), "max_paused_seconds": _limit(float), "max_snapshots": _limit(int),
    "max_snapshot_bytes": _limit(_size),
    "max_volumes": _limit(int), "max_volume_bytes": _limit(_size),
}


@tenants_app.command("update")
def update(
    name: str = typer.Argument(..., help="Tenant name or id."),
    max_sandboxes: str | None = typer.Option(None, help=f"Concurrent sandboxes. {_LIMIT_HELP}"),
    max_memory: str | None = typer.Option(None, help=f"Total memory, e.g. 16G. {_LIMIT_HELP}"),
    max_cpus: str | None = typer.Option(None, help=f"Total CPUs. {_LIMIT_HELP}"),
    max_sandbox_memory: str | None = typer.Option(None, help=f"Memory of one sandbox. {_LIMIT_HELP}"),
    max_sandbox_cpus: str | None = typer.Option(None, help=f"CPUs of one sandbox. {_LIMIT_HELP}"),
    max_sandbox_disk: str | None = typer.Option(None, help=f"Disk of one sandbox, e.g. 10G. {_LIMIT_HELP}"),
    max_sandbox_timeout: str | None = typer.Option(None, help=f"Seconds a sandbox may live. {_LIMIT_HELP}"),
    max_paused: str | None = typer.Option(None, help=f"Sandboxes paused to disk at once. {_LIMIT_HELP}"),
    max_paused_seconds: str | None = typer.Option(
        None, help=f"Seconds a sandbox may stay paused to disk before it is destroyed (default 7 days). {_LIMIT_HELP}"),
    max_snapshots: str | None = typer.Option(None, help=f"Snapshots kept. {_LIMIT_HELP}"),
    max_snapshot_bytes: str | None = typer.Option(None, help=f"Total size of snapshots, e.g. 20G. {_LIMIT_HELP}"),
    max_volumes: str | None = typer.Option(None, help=f"Volumes kept. {_LIMIT_HELP}"),
    max_volume_bytes: str | None = typer.Option(None, help=f"Total size of volumes, e.g. 100G. {_LIMIT_HELP}"),
    disabled: bool | None = typer.Option(None, "--disable/--enable", help="A disabled tenant's keys stop working.",
                                         show_default=False),
    runtime: str | None = typer.Option(None, "--runtime", help=f"The runtime it requires. {_RUNTIME_HELP}"),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Change a tenant's quotas (those not given keep their value), disable/enable it, or set the runtime its
    sandboxes must run on."""
    given = {"max_sandboxes": max_sandboxes, "max_memory_bytes": max_memory, "max_cpus": max_cpus,
             "max_sandbox_memory_bytes": max_sandbox_memory, "max_sandbox_cpus": max_sandbox_cpus,
             "max_sandbox_disk_bytes": max_sandbox_disk, "max_sandbox_timeout": max_sandbox_timeout,
             "max_paused": max_paused, "max_paused_seconds": max_paused_seconds, "max_snapshots": max_snapshots,
             "max_snapshot_bytes": max_snapshot_bytes, "max_volumes": max_volumes,
             "max_volume_bytes": max_volume_bytes}
    quotas = {k: _PARSERS[k](v) for k, v in given.items() if v is not None}
    if not quotas and disabled is None and runtime is None:
        raise typer.BadParameter("nothing to change: give a quota option, --disable, --enable or --runtime")
    with admin(url, api_key) as a:
        _tenant_out(a.tenants.update(name, quotas=quotas or None, disabled=disabled, required_runtime=runtime),
                    as_json)


_DESTINATION_HELP = "An exact private IP address and port, e.g. 10.0.0.5:5432 (an IPv6 address in brackets)."


def _grants_out(grants: list[dict[str, object]], as_json: bool) -> None:
    if as_json:
        print_json(grants)
        return
    table = Table("destination", "granted at", "by key")
    for g in grants:
        table.add_row(str(g["destination"]), str(g["granted_at"]), str(g.get("key_id") or ""))
    print_table(table)


@tenants_app.command("grants")
def grants(
    name: str = typer.Argument(..., help="Tenant name or id."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List the private destinations granted to a tenant: what its operators may switch on (docs/egress.md)."""
    with admin(url, api_key) as a:
        _grants_out(a.tenants.grants(name), as_json)


@tenants_app.command("grant-private")
def grant_private(
    name: str = typer.Argument(..., help="Tenant name or id."),
    destination: str = typer.Argument(..., help=_DESTINATION_HELP),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Grant a tenant a private destination its operators may then switch on (admin). The control plane's own
    services (its API and metrics ports, its database, its replicas) are refused."""
    with admin(url, api_key) as a:
        _grants_out(a.tenants.grant_private(name, destination), as_json)


@tenants_app.command("revoke-private")
def revoke_private(
    name: str = typer.Argument(..., help="Tenant name or id."),
    destination: str = typer.Argument(..., help=_DESTINATION_HELP),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Take a grant back (admin): the tenant's sandboxes lose the destination at once, for new connections."""
    with admin(url, api_key) as a:
        _grants_out(a.tenants.revoke_private(name, destination), as_json)
