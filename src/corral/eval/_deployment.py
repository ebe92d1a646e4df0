"""Where an eval runs: a tenant of its own on a Corral server, reachable loopback server included.

`corral eval run` needs a developer key of a tenant that may reach the runner's loopback server (an exact
private `ip:port` allowance, docs/egress.md). With an admin key, `eval_tenant` makes that tenant (a fresh
`corral-eval-<hex>` one), its key and its allowance, and afterwards kills the tenant's sandboxes, revokes the key
and disables the tenant. With `local_server` the runner also starts a private `corral serve` on this machine
(state in a temporary directory, templates from `$CORRAL_HOME`, on the backend asked for) and stops it afterwards.

Before the first task, `run_on_corral` starts and kills one sandbox of each template the tasks use: a backend
that makes an image of a template on its first sandbox (Docker: about a minute for the default template) would
otherwise charge that to whichever tasks come first, and report them as hanging.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import httpx

from .._exceptions import CorralError
from .._sdk import AsyncAdmin, AsyncSandbox
from .._settings import corral_home
from ._adapter import Adapter
from ._corral import CorralAdapter
from ._loopback import LoopbackServer
from ._result import RunResults, TaskResult
from ._runner import run_tasks
from ._task import CAPABILITIES, Task

__all__ = ["AdapterFactory", "EvalTenant", "eval_tenant", "local_capabilities", "local_server", "run_on_corral"]

_FIRST_SANDBOX_TIMEOUT = 1800.0  # seconds: a template's first sandbox may import gigabytes (see `_first_sandboxes`)


@dataclass(frozen=True)
class EvalTenant:
    base_url: str
    api_key: str
    tenant: str


class AdapterFactory(Protocol):
    """How `run_on_corral` makes its adapter for the tenant it runs as: `CorralAdapter` (Corral's SDK),
    `E2BAdapter` (E2B's SDK against Corral's E2B API), or a subclass of either."""

    def __call__(self, *, base_url: str, api_key: str, capabilities: frozenset[str]) -> Adapter: ...


@asynccontextmanager
async def eval_tenant(*, base_url: str | None, admin_key: str | None, loopback: str | None,
                      max_sandboxes: int | None = None) -> AsyncIterator[EvalTenant]:
    """A throwaway tenant with a developer key (and the loopback server allowed), cleaned up afterwards."""
    async with AsyncAdmin(api_key=admin_key, base_url=base_url) as admin:
        name = f"corral-eval-{secrets.token_hex(4)}"
        await admin.tenants.create(name)
        key = None
        try:
            if max_sandboxes is not None:
                await admin.tenants.update(name, quotas={"max_sandboxes": max_sandboxes})
            key = await admin.keys.create(name, "developer", name="corral eval")
            if loopback is not None:
                await admin.tenants.set_egress(name, private=[loopback])
            yield EvalTenant(admin._client.config.base_url, key.key, name)
        finally:
            # Whatever happened, leave nothing running and nothing usable behind.
            with suppress(CorralError):
                await admin.kill_all(tenant=name)
            if key is not None:
                with suppress(CorralError):
                    await admin.keys.revoke(key.id)
            with suppress(CorralError):
                await admin.tenants.update(name, disabled=True)


@contextmanager
def local_server(*, backend: str = "local", args: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """A private `corral serve --backend <backend>` on this machine (`corral.server.private_server`): yields
    (base_url, admin_key); stopped, and every sandbox it left destroyed, afterwards."""
    from ..server import private_server  # FastAPI and uvicorn load only for a local run

    with private_server(backend, args=args, prefix="corral-eval-") as server:
        yield server.url, server.admin_key


def local_capabilities() -> frozenset[str]:
    """What a Corral on this machine can do: everything, less the `polyglot` template when it is not built."""
    from ..templates import TemplateStore

    caps = set(CAPABILITIES)
    if not TemplateStore(corral_home()).exists("polyglot"):
        caps.discard("polyglot")
    return frozenset(caps)


async def run_on_corral(
    tasks: Sequence[Task],
    *,
    base_url: str | None,
    admin_key: str | None = None,
    api_key: str | None = None,
    concurrency: int = 50,
    retries: int = 0,
    capabilities: frozenset[str] = CAPABILITIES,
    out: TextIO | None = None,
    progress: Callable[[TaskResult], None] | None = None,
    header: dict[str, Any] | None = None,
    adapter_type: AdapterFactory = CorralAdapter,
    heavy_concurrency: int | None = None,
) -> RunResults:
    """Run `tasks` on the Corral at `base_url`: in a throwaway tenant when given an admin key (the loopback
    server allowed), else as `api_key`'s tenant (tasks that need the loopback server are then skipped).
    `adapter_type` makes the adapter: Corral's SDK by default, `E2BAdapter` for E2B's SDK against the same server,
    or a subclass (the tests inject faults with one)."""
    head = {"base_url": base_url, **(header or {})}
    templates = {t.setup.template for t in tasks if not t.needs() - capabilities}
    with LoopbackServer() as loopback:
        if admin_key is not None:
            async with eval_tenant(base_url=base_url, admin_key=admin_key, loopback=loopback.address) as t:
                adapter = adapter_type(base_url=t.base_url, api_key=t.api_key, capabilities=capabilities)
                await _first_sandboxes(t.base_url, t.api_key, templates)
                return await run_tasks(tasks, adapter, concurrency=concurrency, retries=retries,
                                       server=loopback.address, out=out, progress=progress,
                                       header=head | {"tenant": t.tenant}, heavy_concurrency=heavy_concurrency)
        if api_key is None:
            raise ValueError("give an admin key (a throwaway tenant is made) or a developer key")
        adapter = adapter_type(base_url=base_url or "", api_key=api_key,
                                capabilities=capabilities - {"loopback_server"})
        await _first_sandboxes(base_url, api_key, templates)
        return await run_tasks(tasks, adapter, concurrency=concurrency, retries=retries, server=None, out=out,
                               progress=progress, header=head, heavy_concurrency=heavy_concurrency)


async def _first_sandboxes(base_url: str | None, api_key: str, templates: set[str]) -> None:
    """Start and kill one sandbox of each template, before any task's budget starts (see the module's doc). A
    failure here is left for the tasks to report, each with its own error."""
    for name in sorted(templates):
        with suppress(CorralError, httpx.HTTPError):
            sb = await AsyncSandbox.create(name, api_key=api_key, base_url=base_url, timeout=300,
                                           request_timeout=_FIRST_SANDBOX_TIMEOUT)
            await sb.kill()
