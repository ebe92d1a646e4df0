"""Egress policy through the API: network at create and on a live sandbox, tenant ceilings and private pairs,
denials in exec results and in the audit trail (real runc sandboxes; the proxy itself is tested elsewhere)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from corral import AsyncSandbox
from corral.control import ControlStore, Role
from corral.egress import EgressProxy
from corral.server import create_app

from .conftest import TEMPLATE, make_engine
from .test_server_api import BASE, Api, create, error_code, run, unb64
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def test_network_is_normalised_and_shown(api: Api) -> None:
    async with api.client("a_dev") as dev:
        sb = await create(dev, network=["PyPI.org.", "*.Example.com:443", "@packages"])
        assert sb["network"] == ["*.example.com:443", "pypi.org", "@packages"]
        assert (await create(dev))["network"] == "none"
        assert (await create(dev, network="internet"))["network"] == "internet"


@pytest.mark.parametrize("network", [["a*.example.com"], ["@nope"], [""], ["host:99999"], "everything", [3]])
async def test_bad_network_is_400_and_creates_nothing(api: Api, network: object) -> None:
    async with api.client("a_dev") as dev:
        r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "network": network})
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        assert (await dev.get("/v1/sandboxes")).json()["sandboxes"] == []


async def test_the_tenant_ceiling_bounds_every_sandbox(api: Api) -> None:
    async with api.client("admin") as admin, api.client("a_dev") as dev:
        r = await admin.put("/v1/tenants/a/egress", json={"ceiling": ["*.pypi.org", "pypi.org", "@packages"]})
        assert r.status_code == 200 and r.json()["ceiling"] == ["pypi.org", "*.pypi.org", "@packages"], r.text
        for network in ("internet", ["example.org"], ["files.pythonhosted.org"]):
            r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "network": network})
            assert r.status_code == 403 and error_code(r) == "permission_denied", r.text
            assert "ceiling" in r.json()["error"]["message"]
        ok = await create(dev, network=["pypi.org", "a.pypi.org:443", "@packages"])
        # a live sandbox cannot be raised past it either
        r = await dev.put(f"/v1/sandboxes/{ok['id']}/network", json={"network": "internet"})
        assert r.status_code == 403, r.text
        r = await dev.put(f"/v1/sandboxes/{ok['id']}/network", json={"network": ["pypi.org"]})
        assert r.status_code == 200 and r.json()["network"] == ["pypi.org"]
        assert api.engine.spec(ok["id"]).network == ("pypi.org",)
        # lowering the ceiling narrows live sandboxes that now exceed it
        r = await admin.put("/v1/tenants/a/egress", json={"ceiling": "none"})
        assert r.status_code == 200 and r.json()["ceiling"] == "none"
        assert (await dev.get(f"/v1/sandboxes/{ok['id']}")).json()["network"] == "none"
        assert api.engine.spec(ok["id"]).network == "none"


async def test_operators_allow_private_pairs_only_in_their_tenant(api: Api) -> None:
    async with api.client("a_op") as op, api.client("a_dev") as dev, api.client("admin") as admin:
        sb = await create(dev, network=["10.0.0.5"])
        r = await admin.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5:5432"})
        assert r.status_code == 200, r.text
        r = await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432"]})
        assert r.status_code == 200 and r.json()["private"] == ["10.0.0.5:5432"], r.text
        assert api.engine.spec(sb["id"]).network_private == ("10.0.0.5:5432",)  # live sandboxes at once
        assert (await op.put("/v1/tenants/a/egress", json={"ceiling": "internet"})).status_code == 403
        assert (await op.put("/v1/tenants/b/egress", json={"private": []})).status_code == 404
        assert (await op.get("/v1/tenants/b/egress")).status_code == 404
        assert (await dev.get("/v1/tenants/a/egress")).status_code == 403
        r = await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5"]})  # no port: refused
        assert r.status_code == 400, r.text
        assert (await admin.get("/v1/tenants/a/egress")).json()["private"] == ["10.0.0.5:5432"]


# -- private destinations: the deployment's to grant (docs/egress.md) ------------------------------------------


async def test_an_admin_grants_lists_and_revokes_private_destinations(api: Api) -> None:
    async with api.client("admin") as admin, api.client("a_op") as op, api.client("a_dev") as dev:
        sb = await create(dev, network=["10.0.0.5"])
        r = await admin.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5:5432"})
        assert r.status_code == 200 and [g["destination"] for g in r.json()["grants"]] == ["10.0.0.5:5432"], r.text
        assert r.json()["grants"][0]["key_id"]  # who granted it
        assert (await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432"]})).status_code == 200
        assert api.engine.spec(sb["id"]).network_private == ("10.0.0.5:5432",)
        # revoking closes it for the tenant and its live sandboxes at once
        r = await admin.delete("/v1/tenants/a/egress/grants/10.0.0.5%3A5432")
        assert r.status_code == 200 and r.json()["grants"] == [], r.text
        assert (await op.get("/v1/tenants/a/egress")).json()["private"] == []
        assert api.engine.spec(sb["id"]).network_private == ()
        # an admin switching a pair on grants it by saying so; other tenants see none of it
        r = await admin.put("/v1/tenants/a/egress", json={"private": ["10.0.0.6:80"]})
        assert r.status_code == 200 and r.json()["private"] == ["10.0.0.6:80"], r.text
        assert [g["destination"] for g in (await admin.get("/v1/tenants/a/egress/grants")).json()["grants"]] \
            == ["10.0.0.6:80"]
        assert (await admin.get("/v1/tenants/b/egress/grants")).json()["grants"] == []
        actions = [e.action for e in await api.store.audit.query(action="tenant.grants.grant")]
        assert actions == ["tenant.grants.grant"]
        revoked = await api.store.audit.query(action="tenant.grants.revoke")
        assert revoked and revoked[-1].params["destination"] == "10.0.0.5:5432" and revoked[-1].outcome["revoked"]


@pytest.mark.parametrize("destination", ["127.0.0.1:7770", "0.0.0.0:7770", "[::ffff:127.0.0.1]:7770"])
async def test_the_control_plane_can_never_be_granted(api: Api, destination: str) -> None:
    """This server's own API (its replica URL, http://127.0.0.1:7770 by default): refused for the admin too."""
    async with api.client("admin") as admin:
        r = await admin.post("/v1/tenants/a/egress/grants", json={"destination": destination})
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        assert "control plane" in r.json()["error"]["message"]
        r = await admin.put("/v1/tenants/a/egress", json={"private": [destination]})
        assert r.status_code == 400 and "control plane" in r.json()["error"]["message"], r.text
        assert (await admin.get("/v1/tenants/a/egress/grants")).json()["grants"] == []
        assert (await admin.get("/v1/tenants/a/egress")).json()["private"] == []
        r = await admin.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5"})  # no port
        assert r.status_code == 400, r.text


async def test_an_operator_switches_on_only_what_was_granted(api: Api) -> None:
    async with api.client("a_op") as op, api.client("admin") as admin:
        r = await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432"]})
        assert r.status_code == 403 and error_code(r) == "permission_denied", r.text
        assert "10.0.0.5:5432" in r.json()["error"]["message"] and "not granted" in r.json()["error"]["message"]
        assert r.json()["error"]["details"]["missing_grants"] == ["10.0.0.5:5432"]
        assert (await op.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5:5432"})).status_code \
            == 403
        assert (await admin.get("/v1/tenants/a/egress/grants")).json()["grants"] == []
        await admin.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5:5432"})
        assert (await op.delete("/v1/tenants/a/egress/grants/10.0.0.5%3A5432")).status_code == 403
        r = await op.get("/v1/tenants/a/egress/grants")  # what it may switch on
        assert r.status_code == 200 and [g["destination"] for g in r.json()["grants"]] == ["10.0.0.5:5432"]
        r = await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432", "10.0.0.7:22"]})
        assert r.status_code == 403 and r.json()["error"]["details"]["missing_grants"] == ["10.0.0.7:22"], r.text
        r = await op.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432"]})
        assert r.status_code == 200 and r.json()["private"] == ["10.0.0.5:5432"], r.text
        assert (await op.get("/v1/tenants/b/egress/grants")).status_code == 404


@pytest.mark.parametrize("who", ["a_dev", "a_aud"])
async def test_developers_and_auditors_neither_grant_nor_switch_on(api: Api, who: str) -> None:
    async with api.client(who) as caller, api.client("admin") as admin:
        await admin.post("/v1/tenants/a/egress/grants", json={"destination": "10.0.0.5:5432"})
        assert (await caller.get("/v1/tenants/a/egress/grants")).status_code == 403
        assert (await caller.post("/v1/tenants/a/egress/grants",
                                  json={"destination": "10.0.0.6:80"})).status_code == 403
        assert (await caller.delete("/v1/tenants/a/egress/grants/10.0.0.5%3A5432")).status_code == 403
        assert (await caller.put("/v1/tenants/a/egress", json={"private": ["10.0.0.5:5432"]})).status_code == 403
        grants = (await admin.get("/v1/tenants/a/egress/grants")).json()["grants"]
        assert [g["destination"] for g in grants] == ["10.0.0.5:5432"]
        assert (await admin.get("/v1/tenants/a/egress")).json()["private"] == []


# -- with the proxy: denials in results and in the audit trail -----------------------------------------------------


@pytest.fixture
async def proxied(test_home: Path, tmp_path: Path) -> AsyncIterator[Api]:
    proxy = EgressProxy()
    engine = make_engine(test_home, egress=proxy)
    store = ControlStore(home=tmp_path)
    app = create_app(engine, store)
    async with app.router.lifespan_context(app):  # starts store, proxy and engine, and the audit wiring
        await store.bootstrap_admin(None)
        tenant = (await store.create_tenant("a")).id
        new = await store.create_key(tenant, Role.DEVELOPER, "dev")
        try:
            yield Api(app, store, engine, {"a_dev": new.key}, {"a_dev": new.info.id}, {"a": tenant})
        finally:
            for sb in engine.list():
                await engine.destroy(sb.id)


async def test_denials_come_back_with_the_result_and_go_on_record(proxied: Api) -> None:
    async with proxied.client("a_dev") as dev:
        sb = await create(dev, network=["example.org"])
        out = await run(dev, sb["id"], "curl -sS --max-time 20 https://pypi.org/simple/ ; true")
        denials = out["egress_denials"]
        assert [(d["host"], d["port"], d["kind"]) for d in denials] == [("pypi.org", 443, "connect")], out
        assert "example.org" in denials[0]["reason"]  # names the policy
        records = await proxied.store.audit.query(action="egress.connect")
        assert records and records[-1].target == sb["id"] and records[-1].outcome["allowed"] is False
        assert records[-1].tenant_id == proxied.tenants["a"] and records[-1].key_id == proxied.key_ids["a_dev"]
        clean = await run(dev, sb["id"], "true")
        assert clean["egress_denials"] == []


async def test_dns_records_say_the_sandbox_reported_them_even_when_forged(proxied: Api) -> None:
    """Sandbox code can write to the proxy's socket as the agent's DNS stub does: such a record is never taken
    for the proxy's own (issue 29 item 7)."""
    forge = ("curl -sS --max-time 10 --unix-socket /.corral/egress/proxy.sock "
             "'http://corral/_corral/dns?name=forged.example' -o /dev/null -w '%{http_code}'")
    async with proxied.client("a_dev") as dev:
        sb = await create(dev, network="internet")
        out = await run(dev, sb["id"], forge)
        looked_up = await run(dev, sb["id"], "python3 -c \"import socket; socket.getaddrinfo('real.example', 80)\""
                                             " ; true")
    records = await proxied.store.audit.query(action="egress.dns", sandbox=sb["id"])
    assert unb64(out["stdout_b64"]) == b"204", out  # the socket is reachable from inside: hence the marking
    assert looked_up["exit_code"] == 0
    hosts = {r.params["host"]: r.params for r in records}
    assert {"forged.example", "real.example"} <= set(hosts), hosts
    assert all(p["reported_by"] == "sandbox" for p in hosts.values())


async def test_the_sdk_shows_the_notice(proxied: Api) -> None:
    transport = httpx.ASGITransport(app=proxied.app)
    async with await AsyncSandbox.create(TEMPLATE, api_key=proxied.keys["a_dev"], base_url=BASE,
                                         transport=transport) as sb:
        r = await sb.commands.run("curl -sS --max-time 20 https://pypi.org/ ; true")
        assert r.egress_denials and r.egress_denials[0].host == "pypi.org"
        assert r.notice.startswith("corral: ") and "pypi.org" in r.notice
        assert (await sb.set_network(["pypi.org"])).network == ("pypi.org",)
