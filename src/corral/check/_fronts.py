"""Item 43, through every front end the deployment serves besides /v1: another tenant's sandbox is not found, and
an auditor cannot run anything or open a terminal.

E2B's API (docs/e2b.md) is probed with raw HTTP, as its SDKs send it: its control plane with `X-API-KEY`, envd's
data plane and the code interpreter with the sandbox named in `E2b-Sandbox-Id`. A deployment that does not serve
it (no `/v2/sandboxes`) makes this item N/A for it. MCP and the dashboard join this item when they are served.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import httpx

from ._context import REQUEST_TIMEOUT, CheckContext, clip
from ._model import ItemFailed, NotApplicable

__all__ = ["item_43_front_ends_keep_tenancy"]

_ENVD, _INTERPRETER = "49983", "49999"


def _client(ctx: CheckContext, who: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=ctx.url, transport=ctx.target.transport, timeout=REQUEST_TIMEOUT,
                             headers={"X-API-KEY": ctx.keys[who]})


def _stream_body(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def _data_plane(sid: str, port: str, **headers: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": port, **headers}


async def _e2b_sandbox(client: httpx.AsyncClient, ctx: CheckContext) -> dict[str, Any]:
    r = await client.post("/sandboxes", json={"templateID": ctx.target.template, "timeout": 300,
                                              "metadata": {"corral-check": ctx.tenant}})
    if r.status_code == 404 and "sandboxes" in r.text.lower() and not r.headers.get("content-type", "").startswith(
            "application/json"):
        raise NotApplicable("this deployment does not serve E2B's API")
    if r.status_code != 201:
        raise ItemFailed(f"creating a sandbox through E2B's API failed: {r.status_code} {clip(r.text)}")
    created: dict[str, Any] = r.json()
    return created


async def _start(client: httpx.AsyncClient, sid: str, cmd: str, **headers: str) -> httpx.Response:
    body = _stream_body({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, "stdin": False})
    return await client.post("/process.Process/Start", content=body, headers=_data_plane(
        sid, _ENVD, **{"Content-Type": "application/connect+json", **headers}))


def _refused(r: httpx.Response, status: int) -> bool:
    """The call was refused with `status`: plainly, or (a stream) in its end-of-stream message."""
    if r.status_code == status:
        return True
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/connect+json"):
        code = {403: "permission_denied", 404: "not_found"}[status]
        return f'"code":"{code}"' in r.text.replace(" ", "")
    return False


async def item_43_front_ends_keep_tenancy(ctx: CheckContext) -> str:
    async with _client(ctx, "other") as theirs, _client(ctx, "developer") as ours, \
            _client(ctx, "auditor") as auditor:
        probe = await theirs.get("/v2/sandboxes")
        if probe.status_code == 404:
            raise NotApplicable("no front end but /v1 is served (E2B's API: not found at /v2/sandboxes)")
        other = await _e2b_sandbox(theirs, ctx)
        own = await _e2b_sandbox(ours, ctx)
        try:
            checks = await _tenancy(ours, other["sandboxID"]) + await _roles(auditor, own["sandboxID"])
            alive = await _start(theirs, other["sandboxID"], "echo alive",
                                 **{"X-Access-Token": other["envdAccessToken"]})
        finally:
            await theirs.delete(f"/sandboxes/{other['sandboxID']}")
            await ours.delete(f"/sandboxes/{own['sandboxID']}")
    wrong = [f"{what} -> {r.status_code} {clip(r.text, 120)}" for what, r, status in checks if not _refused(r, status)]
    if wrong:
        raise ItemFailed(f"E2B's API let a caller do what it must not: {'; '.join(wrong)}",
                         fix="upgrade Corral: every E2B route must authorize through the service layer as /v1 "
                             "does; report the route")
    if alive.status_code != 200 or ('"exitCode":0' not in alive.text.replace(" ", "") and "exitCode" in alive.text):
        raise ItemFailed(f"the other tenant's sandbox changed under the probe: {alive.status_code} {clip(alive.text)}")
    return (f"E2B's API: {len(checks)} calls on another tenant's sandbox (404) or by an auditor (403) were refused; "
            "MCP and the dashboard are not served by this deployment")


async def _tenancy(ours: httpx.AsyncClient, sid: str) -> list[tuple[str, httpx.Response, int]]:
    """A developer of another tenant: the sandbox does not exist, on the control plane and the data plane."""
    envd = _data_plane(sid, _ENVD)
    return [
        ("info", await ours.get(f"/sandboxes/{sid}"), 404),
        ("connect", await ours.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}), 404),
        ("timeout", await ours.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}), 404),
        ("pause", await ours.post(f"/sandboxes/{sid}/pause", json={}), 404),
        ("snapshot", await ours.post(f"/sandboxes/{sid}/snapshots", json={}), 404),
        ("fork", await ours.post(f"/sandboxes/{sid}/fork", json={}), 404),
        ("kill", await ours.delete(f"/sandboxes/{sid}"), 404),
        ("file read", await ours.get("/files", params={"path": "/etc/hostname"}, headers=envd), 404),
        ("file write", await ours.post("/files", params={"path": "/home/user/pwned"}, content=b"x",
                                       headers={**envd, "Content-Type": "application/octet-stream"}), 404),
        ("process list", await ours.post("/process.Process/List", json={},
                                         headers={**envd, "Content-Type": "application/json"}), 404),
        ("command", await _start(ours, sid, "touch /home/user/pwned"), 404),
        ("code", await ours.post("/execute", json={"code": "open('/home/user/pwned', 'w')"},
                                 headers=_data_plane(sid, _INTERPRETER)), 404),
    ]


async def _roles(auditor: httpx.AsyncClient, sid: str) -> list[tuple[str, httpx.Response, int]]:
    """An auditor of the sandbox's own tenant reads the audit trail and never runs anything: 403."""
    terminal = _stream_body({"process": {"cmd": "/bin/bash", "args": ["-i", "-l"]},
                             "pty": {"size": {"rows": 24, "cols": 80}}})
    return [
        ("auditor create", await auditor.post("/sandboxes", json={"templateID": "base"}), 403),
        ("auditor command", await _start(auditor, sid, "id"), 403),
        ("auditor terminal", await auditor.post("/process.Process/Start", content=terminal, headers=_data_plane(
            sid, _ENVD, **{"Content-Type": "application/connect+json"})), 403),
        ("auditor code", await auditor.post("/execute", json={"code": "1"}, headers=_data_plane(sid, _INTERPRETER)),
         403),
        ("auditor file write", await auditor.post("/files", params={"path": "/home/user/x"}, content=b"x", headers={
            **_data_plane(sid, _ENVD), "Content-Type": "application/octet-stream"}), 403),
    ]
