"""Items 32 and 33, through the API: tenants are isolated on every published route, and roles hold.

Raw HTTP, not the SDK: the point is what the server answers to requests a client should never make.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx

from ._context import CheckContext, clip
from ._model import ItemFailed

__all__ = ["item_32_tenants_isolated", "item_33_roles_hold"]

_MIN_ROUTES = 16  # the sandbox routes of the first API slice; a server publishing fewer hides its routes


def _error_code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


def plausible_request(method: str, path: str) -> dict[str, Any]:
    """A well-formed request for a route, so that a 404 comes from the tenant check, not a bad body."""
    if path.endswith(("/exec", "/processes")):
        return {"json": {"cmd": "touch /workspace/pwned"}}
    if path.endswith("/code"):
        return {"json": {"code": "open('/workspace/pwned', 'w')"}}
    if path.endswith("/timeout"):
        return {"json": {"timeout": 60}}
    if path.endswith("/network"):
        return {"json": {"network": "internet"}}
    if path.endswith("/mkdir"):
        return {"json": {"path": "/workspace/pwned"}}
    if path.endswith("/restore"):
        return {"json": {"checkpoint": "ckpt-0000000000000000"}}
    if path.endswith("/changes"):
        return {"params": {"since": "ckpt-0000000000000000"}}
    if path.endswith("/rename"):
        return {"json": {"src": "/workspace/secret", "dst": "/workspace/pwned"}}
    if "/files" in path or "/archive" in path:
        return {"params": {"path": "/workspace/secret"}, **({"content": b"x"} if method == "PUT" else {})}
    return {}


async def _create(c: httpx.AsyncClient, ctx: CheckContext) -> str:
    r = await c.post("/v1/sandboxes", json={"template": ctx.target.template, "timeout": 300,
                                            "metadata": {"corral-check": ctx.tenant}})
    if r.status_code != 201:
        raise ItemFailed(f"creating a sandbox failed: {r.status_code} {clip(r.text)}")
    return str(r.json()["id"])


async def _exec(c: httpx.AsyncClient, sid: str, cmd: str) -> dict[str, Any]:
    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 20})
    if r.status_code != 200:
        raise ItemFailed(f"running {cmd!r} in the check's own sandbox failed: {r.status_code} {clip(r.text)}")
    out: dict[str, Any] = r.json()
    return out


def _routes(openapi: Any) -> list[tuple[str, str]]:
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    if not isinstance(paths, dict):
        raise ItemFailed("the server's /openapi.json lists no paths: the routes to probe are unknown")
    routes = [(method.upper(), template) for template, methods in paths.items() if "{sandbox_id}" in template
              for method in methods if method.lower() in ("get", "put", "post", "patch", "delete")]
    # Destructive calls last: a kill that wrongly succeeded would turn every later probe into an honest 404.
    return sorted(routes, key=lambda r: (r[0] == "DELETE", r[1] == "/v1/sandboxes/{sandbox_id}"))


async def item_32_tenants_isolated(ctx: CheckContext) -> str:
    """A key of one tenant gets 404 `not_found` for the other tenant's sandbox on every sandbox route the server
    publishes, and nothing happens to that sandbox."""
    async with ctx.http("other") as theirs, ctx.http("operator") as ours:
        spec = await ours.get("/openapi.json")
        if spec.status_code != 200:
            raise ItemFailed(f"GET /openapi.json answered {spec.status_code}: the routes to probe are unknown")
        routes = _routes(spec.json())
        sid = await _create(theirs, ctx)
        await _exec(theirs, sid, "echo s > /workspace/secret")
        leaks = []
        for method, template in routes:
            url = template.replace("{sandbox_id}", sid).replace("{process_id}", "1").replace("{pid}", "1")
            url = url.replace("{name}", "default")
            r = await ours.request(method, url, **plausible_request(method, template))
            if r.status_code != 404 or _error_code(r) != "not_found":
                leaks.append(f"{method} {template} -> {r.status_code} {clip(r.text, 120)}")
        listed = await ours.get("/v1/sandboxes")
        if listed.status_code != 200 or sid in listed.text:
            leaks.append(f"GET /v1/sandboxes -> {listed.status_code}, listing the other tenant's sandbox"
                         if sid in listed.text else f"GET /v1/sandboxes -> {listed.status_code}")
        after = await theirs.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls /workspace", "timeout": 20})
        state = (await theirs.get(f"/v1/sandboxes/{sid}")).json().get("state")
    if leaks:
        raise ItemFailed(f"another tenant's sandbox was reachable: {'; '.join(leaks)}")
    if len(routes) < _MIN_ROUTES:
        raise ItemFailed(f"the server publishes only {len(routes)} sandbox routes in /openapi.json (at least "
                         f"{_MIN_ROUTES} expected): the probe cannot cover every endpoint")
    listing = base64.b64decode(after.json().get("stdout_b64") or "") if after.status_code == 200 else None
    if listing != b"secret\n" or state != "running":
        raise ItemFailed(f"the other tenant's sandbox changed under the probe: /workspace holds {listing!r}, "
                         f"state {state!r}")
    return f"404 not_found on all {len(routes)} sandbox routes of /openapi.json and in listings"


async def item_33_roles_hold(ctx: CheckContext) -> str:
    """Auditors cannot touch sandboxes; developers cannot read the audit trail, use the kill switch or make keys;
    operators cannot make keys or read another tenant's audit; nobody can kill another tenant's sandbox."""
    async with ctx.http("developer") as dev, ctx.http("auditor") as aud, ctx.http("operator") as op, \
            ctx.http("other") as other:
        sid = await _create(dev, ctx)
        theirs = await _create(other, ctx)
        forbidden = {
            "auditor exec": await aud.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "id"}),
            "auditor create": await aud.post("/v1/sandboxes", json={"template": ctx.target.template}),
            "auditor file write": await aud.put(f"/v1/sandboxes/{sid}/files", params={"path": "x"}, content=b"x"),
            "auditor kill": await aud.delete(f"/v1/sandboxes/{sid}"),
            "developer audit query": await dev.get("/v1/audit"),
            "developer audit verify": await dev.get("/v1/audit/verify"),
            "developer audit export": await dev.get("/v1/audit/export"),
            "developer kill switch": await dev.post("/v1/kill", json={"tenant": ctx.tenant}),
            "developer key create": await dev.post("/v1/keys", json={"tenant": ctx.tenant, "role": "admin"}),
            "operator key create": await op.post("/v1/keys", json={"tenant": ctx.tenant, "role": "admin"}),
            "operator other tenant's audit": await op.get("/v1/audit", params={"tenant": ctx.other_tenant}),
            "auditor other tenant's audit": await aud.get("/v1/audit", params={"tenant": ctx.other_tenant}),
        }
        wrong = [f"{what} -> {r.status_code} {clip(r.text, 120)}" for what, r in forbidden.items()
                 if r.status_code != 403 or _error_code(r) != "permission_denied"]
        for who, client in (("developer", dev), ("operator", op)):
            r = await client.delete(f"/v1/sandboxes/{theirs}")
            if r.status_code != 404:
                wrong.append(f"{who} killing another tenant's sandbox -> {r.status_code} {clip(r.text, 120)}")
        states = {"ours": (await dev.get(f"/v1/sandboxes/{sid}")).json().get("state"),
                  "theirs": (await other.get(f"/v1/sandboxes/{theirs}")).json().get("state")}
        for victim, client in ((sid, dev), (theirs, other)):
            await client.delete(f"/v1/sandboxes/{victim}")
    if wrong:
        raise ItemFailed(f"a role could do what it must not: {'; '.join(wrong)}")
    if states != {"ours": "running", "theirs": "running"}:
        raise ItemFailed(f"a refused request still changed a sandbox: states {states}")
    return f"{len(forbidden)} forbidden calls got 403 permission_denied; kills across tenants got 404"
