"""Item 40: a tenant that must run on gVisor gets gVisor whatever its callers ask.

A tenant of the check's own, `<check tenant>-runsc`, is made with `required_runtime: "runsc"` (an admin's call:
the check's own key) and given a developer key; a sandbox created with that key asking for `runtime="runc"` must
say `runsc`, report gVisor's kernel (item 31's detection) and be on record with `runtime_upgraded`. The tenant is
disabled, emptied and stripped of its key at the end, whatever happened. Where the deployment cannot run runsc
(`GET /v1/info`), the item is N/A with the deployment's reason, as item 31 is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from .._exceptions import CorralError, InvalidRequestError
from .._sdk import AsyncAdmin, AsyncSandbox, AuditRecord
from ._backend import gvisor_unavailable, on_gvisor, refused_runsc, sandbox_kernel
from ._context import REQUEST_TIMEOUT, SANDBOX_TTL, CheckContext, clip
from ._model import ItemFailed, NotApplicable

__all__ = ["item_40_forced_runtime_holds"]

_SUFFIX = "-runsc"
_UPGRADED = {"asked": "runc", "runtime": "runsc"}
_OLD_SERVER = "upgrade Corral: this server predates tenants' runtime policy (docs/security.md, \"Runtime policy\")"
_UPGRADE_FIX = ("upgrade Corral: the tenant's required_runtime must be applied by the service on every create, "
                "and the audit record must carry `runtime_upgraded`")


async def item_40_forced_runtime_holds(ctx: CheckContext) -> str:
    if (missing := gvisor_unavailable(ctx.deployment)) is not None:
        raise NotApplicable(f"a tenant's required runtime runsc: {missing}")
    name = ctx.tenant + _SUFFIX
    async with ctx.admin() as admin:
        try:
            try:
                tenant = await admin.tenants.create(name, required_runtime="runsc")
            except InvalidRequestError as exc:
                raise ItemFailed(f"the server refused a tenant with required_runtime 'runsc': {clip(exc.message)}",
                                 fix=_OLD_SERVER) from exc
            ctx.extra_tenants.append(name)  # torn down with the check's own tenants too, whatever happens here
            if tenant.required_runtime != "runsc":
                raise ItemFailed(f"the server did not keep the tenant's required runtime: it answered "
                                 f"required_runtime={tenant.required_runtime!r} for a tenant created with 'runsc'",
                                 fix=_OLD_SERVER)
            key = await admin.keys.create(name, "developer", name="corral check (forced runtime)")
            sid, runtime, log, kernel = await _runc_asked(ctx, key.key)
            records = await admin.audit.query(sandbox=sid, action="sandbox.create")
        finally:
            left = await _remove(admin, name)
    if left:
        raise ItemFailed("the check could not clean up after itself: " + "; ".join(left))
    return _judge(sid, runtime, log, kernel, records)


async def _runc_asked(ctx: CheckContext, key: str) -> tuple[str, str | None, str, str]:
    """A sandbox of the forced tenant asking for runc: its id, the runtime it reports and its kernel."""
    try:
        sb = await AsyncSandbox.create(ctx.target.template, api_key=key, base_url=ctx.url, runtime="runc",
                                       transport=ctx.target.transport, timeout=SANDBOX_TTL,
                                       metadata={"corral-check": ctx.tenant}, request_timeout=REQUEST_TIMEOUT)
    except CorralError as exc:
        if exc.code != "runtime_unavailable":
            raise
        raise refused_runsc(exc) from exc
    async with sb:
        log, kernel = await sandbox_kernel(sb)
        return sb.id, sb.info.runtime, log, kernel


def _judge(sid: str, runtime: str | None, log: str, kernel: str, records: list[AuditRecord]) -> str:
    if not on_gvisor(log):
        raise ItemFailed(f"a sandbox of a tenant required to run runsc, created asking for runc, does not run on "
                         f"gVisor: it says runtime {runtime!r}, its kernel log begins {clip(log, 120)!r}, its kernel "
                         f"is {clip(kernel, 60)!r}", fix=_UPGRADE_FIX)
    if runtime != "runsc":
        raise ItemFailed(f"the sandbox runs on gVisor but says runtime {runtime!r}, not 'runsc'", fix=_UPGRADE_FIX)
    upgraded = [r.outcome.get("runtime_upgraded") for r in records]
    if _UPGRADED not in upgraded:
        raise ItemFailed(f"the audit trail does not say the runtime was upgraded: {len(records)} sandbox.create "
                         f"record(s) of {sid} with runtime_upgraded {upgraded!r}", fix=_UPGRADE_FIX)
    return (f"a tenant required to run runsc asked for runc and got gVisor ({clip(log, 60)}); its sandbox says "
            f"runtime 'runsc' and the audit records runtime_upgraded {_UPGRADED}")


async def _remove(admin: AsyncAdmin, tenant: str) -> list[str]:
    """Disable the tenant, kill its sandboxes, revoke its keys: each step tried whatever the others did. What
    could not be undone fails the item (and the check's teardown tries again: `CheckContext.extra_tenants`)."""
    steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("disabling", lambda: admin.tenants.update(tenant, disabled=True)),
        ("killing the sandboxes of", lambda: admin.kill_all(tenant=tenant)),
        ("revoking the keys of", lambda: _revoke(admin, tenant)),
    ]
    problems = []
    for what, step in steps:
        try:
            await step()
        except CorralError as exc:
            if exc.code != "not_found":  # the tenant was never made: nothing to undo
                problems.append(f"{what} tenant {tenant}: {exc}")
        except httpx.HTTPError as exc:
            problems.append(f"{what} tenant {tenant}: {exc}")
    return problems


async def _revoke(admin: AsyncAdmin, tenant: str) -> None:
    for key in await admin.keys.list(tenant):
        if not key.revoked:
            await admin.keys.revoke(key.id)
