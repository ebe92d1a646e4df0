"""`corral check` items 37 and 38 (secrets at egress, docs/secrets.md) against a real server (runc), and proof that
each probe fails when its property is broken: the same server behind a transport that hands the sandbox the value
itself (as a server without secrets at egress would, were the value put in `env`)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from corral.check import CheckOptions, Target, run_check
from corral.check._secrets import NAME, item_37_secrets_never_inside, item_38_secrets_reach_only_their_hosts
from corral.eval._loopback import LoopbackServer
from corral.server import ServerProcess

from .test_check import needs_store
from .test_check import server as server  # the fixture: a real `corral serve` (runc) in a temporary home
from .test_check_items import Tampering, _probe, _rebuilt

pytestmark = [pytest.mark.runc, needs_store]


@pytest.mark.timeout(300)
def test_items_37_and_38_pass_on_a_local_deployment(server: ServerProcess) -> None:
    target = Target(url=server.url, admin_key=server.admin_key, home=server.home)
    report = asyncio.run(run_check(target, CheckOptions(items=frozenset({37, 38}))))
    status = {i.number: (i.status, i.detail) for i in report.items}
    assert status[37][0] == "PASS" and "is a placeholder" in status[37][1], status
    assert status[38][0] == "PASS" and "the bound host received the value" in status[38][1], status
    assert report.cleanup_problems == []
    assert list((server.home / "sandboxes").iterdir()) == []


def _value_in_env(request: httpx.Request, body: dict[str, Any]) -> httpx.Request | None:
    """A server that gives the sandbox the value: the secret becomes a plain variable."""
    if request.method != "POST" or not request.url.path.endswith("/v1/sandboxes") or "secrets" not in body:
        return None
    secret = body.pop("secrets")[NAME]
    body["env"] = {**body.get("env", {}), NAME: secret["value"]}
    return _rebuilt(request, body=body)


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_37_and_38_fail_when_the_sandbox_holds_the_value(server: ServerProcess) -> None:
    from .test_check_items import _live

    with LoopbackServer() as loopback:
        async with _live(server) as ctx:
            ctx.loopback, ctx.echoes = loopback.address, loopback.echoes
            async with ctx.admin() as admin:
                await admin.tenants.set_egress(ctx.tenant, private=[loopback.address])
            for fn, words in ((item_37_secrets_never_inside, "not a placeholder"),
                              (item_38_secrets_reach_only_their_hosts, "another host received")):
                found = await _probe(ctx, fn, Tampering(edit=_value_in_env))
                assert found.status == "FAIL" and words in found.detail, found
            # and untampered, against the same server, both pass
            for fn in (item_37_secrets_never_inside, item_38_secrets_reach_only_their_hosts):
                found = await _probe(ctx, fn)
                assert found.status == "PASS", found
