"""`run_check`: the whole checklist against a deployment, in throwaway tenants that are always cleaned up.

Setup asks the server what it runs on (`GET /v1/info`: the backend, its runtimes, what it cannot give), then makes
two tenants, `corral-check-<hex>` (where everything runs) and `corral-check-<hex>-b` (the other tenant of item 32),
with developer, auditor and operator keys (item 40 makes a third, `corral-check-<hex>-runsc`, torn down with them);
when the server runs on this machine the runner's loopback server is started and the tenant may reach it. One
sandbox is started and killed before any probe (a backend that makes an image of the template on its first sandbox,
as Docker does, takes a minute there). Then the in-sandbox tasks run (N at a time) alongside the light item
functions; the resource-abuse tasks follow, and the heavy functions (a fork bomb beside another sandbox, gigabytes
of output, a swap race) run alone at the end. What the backend cannot give is N/A with its reason on the items it
touches. Teardown, whatever happened: disable the tenants (their keys stop working, nothing new starts), kill their
sandboxes, revoke their keys. It never touches another tenant.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import httpx

from .._exceptions import CorralError
from .._sdk import AsyncAdmin, AsyncSandbox
from ..eval._loopback import LoopbackServer
from ..eval._result import TaskResult
from ..eval._task import Task
from ._backend import fetch_deployment, limitation_verdicts, unknown_limitations
from ._catalog import ITEMS
from ._context import REQUEST_TIMEOUT, SANDBOX_TTL, CheckContext, Target
from ._model import CheckReport, Verdict, combine
from ._probes import PROBES, Probe, run_probe
from ._tasks import checklist_tasks, run_checklist_tasks, task_fixes, task_verdicts

__all__ = ["CheckOptions", "Progress", "provision", "run_check"]

ROLES = (("developer", "developer"), ("auditor", "auditor"), ("operator", "operator"))
HEAVY_CATEGORY = "resource_abuse"  # tasks that push a limit: they run after the others
FIRST_SANDBOX_TIMEOUT = 1800.0  # seconds: the template's first sandbox may import gigabytes (Docker)


class Progress(Protocol):
    """Told how many probes there are, then about each one as it ends."""

    def start(self, total: int) -> None: ...

    def advance(self, label: str, status: str) -> None: ...


@dataclass(frozen=True)
class CheckOptions:
    concurrency: int = 8  # in-sandbox tasks at once
    items: frozenset[int] | None = None  # only these items (default: every one)


async def run_check(target: Target, options: CheckOptions | None = None, *, progress: Progress | None = None,
                    tasks: Sequence[Task] | None = None) -> CheckReport:
    """Run the checklist against `target` and report every item. `tasks` replaces the corpus's checklist tasks."""
    options = options or CheckOptions()
    wanted = sorted(options.items if options.items is not None else ITEMS)
    chosen = [t for t in (checklist_tasks() if tasks is None else tasks) if set(t.checklist) & set(wanted)]
    probes = [p for p in PROBES if p.number in wanted]
    report = CheckReport(url=target.url, started=datetime.now(UTC).isoformat(timespec="seconds"))
    started = time.monotonic()
    verdicts: dict[int, list[Verdict]] = defaultdict(list)
    if progress is not None:
        progress.start(len(chosen) + len(probes))
    with ExitStack() as stack:
        server = None
        if target.on_this_machine and (any("loopback_server" in t.needs() for t in chosen) or
                                       any(p.loopback for p in probes)):
            server = stack.enter_context(LoopbackServer())
        async with provision(target, loopback=server.address if server else None, problems=report.cleanup_problems,
                             echoes=server.echoes if server else ()) as ctx:
            deployment = ctx.deployment
            report.tenant, report.backend = ctx.tenant, deployment.backend
            await _first_sandbox(ctx)
            await _run_all(ctx, chosen, probes, options, verdicts, progress)
    for number, found in limitation_verdicts(deployment, set(wanted)).items():
        verdicts[number].extend(found)
    report.notes = unknown_limitations(deployment)
    fixes = task_fixes()
    report.items = [combine(n, verdicts.get(n, []), fixes) for n in wanted]
    report.seconds = time.monotonic() - started
    return report


async def _first_sandbox(ctx: CheckContext) -> None:
    """Start and kill one sandbox of the template before any probe's clock runs. A failure is left to the
    probes, which report it item by item."""
    with suppress(CorralError, httpx.HTTPError):
        sb = await AsyncSandbox.create(ctx.target.template, api_key=ctx.keys["developer"], base_url=ctx.url,
                                       transport=ctx.target.transport, timeout=SANDBOX_TTL,
                                       metadata={"corral-check": ctx.tenant}, request_timeout=FIRST_SANDBOX_TIMEOUT)
        await sb.kill()


async def _run_all(ctx: CheckContext, tasks: Sequence[Task], probes: Sequence[Probe], options: CheckOptions,
                   verdicts: dict[int, list[Verdict]], progress: Progress | None) -> None:
    """Three phases: the light tasks beside the light functions, then the resource-abuse tasks, then the heavy
    functions one at a time, so that fork bombs and busy loops never skew another probe's timing."""

    def task_done(result: TaskResult) -> None:
        if progress is not None:
            progress.advance(f"task {result.id}", result.status.upper())

    async def probe(p: Probe) -> None:
        found = await run_probe(p, ctx)
        verdicts[p.number].append(found)
        if progress is not None:
            progress.advance(f"item {p.number}", found.status)

    async def task_part(chosen: Sequence[Task]) -> None:
        if chosen:
            run = await run_checklist_tasks(ctx, chosen, concurrency=options.concurrency, progress=task_done)
            for number, found in task_verdicts(run.results).items():
                verdicts[number].extend(found)

    async def light_part() -> None:
        for p in probes:
            if not p.heavy:
                await probe(p)

    abuse = [t for t in tasks if t.category == HEAVY_CATEGORY]
    async with asyncio.TaskGroup() as group:  # one part failing cancels the other before teardown
        group.create_task(task_part([t for t in tasks if t.category != HEAVY_CATEGORY]))
        group.create_task(light_part())
    await task_part(abuse)
    for p in probes:
        if p.heavy:
            await probe(p)


@asynccontextmanager
async def provision(target: Target, *, loopback: str | None = None, problems: list[str] | None = None,
                    echoes: Sequence[tuple[str, dict[str, str]]] = ()) -> AsyncIterator[CheckContext]:
    """Throwaway tenants and keys for a check; on leaving, whatever happened, they are disabled, their sandboxes
    killed and their keys revoked. What could not be cleaned up is appended to `problems`."""
    problems = problems if problems is not None else []
    suffix = secrets.token_hex(4)
    tenant, other = f"corral-check-{suffix}", f"corral-check-{suffix}-b"
    created: list[str] = []
    ctx: CheckContext | None = None
    deployment = await fetch_deployment(target)
    async with AsyncAdmin(api_key=target.admin_key, base_url=target.url, transport=target.transport,
                          request_timeout=REQUEST_TIMEOUT) as admin:
        try:
            for name in (tenant, other):
                await admin.tenants.create(name)
                created.append(name)
            keys, key_ids = {"admin": target.admin_key}, {}
            for (who, role), name in [*((r, tenant) for r in ROLES), (("other", "developer"), other)]:
                new = await admin.keys.create(name, role, name=f"corral check ({who})")
                keys[who], key_ids[who] = new.key, new.id
            if loopback is not None:
                # The runner's loopback server: an exact private ip:port for this tenant (docs/egress.md).
                await admin.tenants.set_egress(tenant, private=[loopback])
            ctx = CheckContext(target, tenant, other, keys, key_ids, loopback=loopback, deployment=deployment,
                               echoes=echoes)
            yield ctx
        finally:
            for name in [*created, *(ctx.extra_tenants if ctx is not None else ())]:
                await _teardown(admin, name, problems)


async def _teardown(admin: AsyncAdmin, tenant: str, problems: list[str]) -> None:
    """Disable first (nothing new can start), then kill what runs, then revoke: each step tried regardless."""
    steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("disabling", lambda: admin.tenants.update(tenant, disabled=True)),
        ("killing the sandboxes of", lambda: _kill(admin, tenant)),
        ("revoking the keys of", lambda: _revoke_keys(admin, tenant)),
    ]
    for what, step in steps:
        try:
            await step()
        except (CorralError, httpx.HTTPError) as exc:
            problems.append(f"{what} tenant {tenant}: {exc}")


async def _kill(admin: AsyncAdmin, tenant: str) -> None:
    result = await admin.kill_all(tenant=tenant)
    if result.failed:
        raise CorralError(f"could not stop {', '.join(f'{k} ({v})' for k, v in result.failed.items())}")


async def _revoke_keys(admin: AsyncAdmin, tenant: str) -> None:
    for key in await admin.keys.list(tenant):
        if not key.revoked:
            await admin.keys.revoke(key.id)
