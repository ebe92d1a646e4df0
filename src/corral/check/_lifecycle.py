"""Items 41 and 42, through the API and the SDK: a sandbox's ports answer its own tenant only, and volumes belong
to their tenant and hold no more than their size.

41: a small HTTP server inside a sandbox, reached through the server's port host (`sb.get_host(port)`, the
request sent to the server's own address with that `Host` header, as docs/ports.md says where `*.<domain>` does
not resolve): the owner's key reaches it, no key is 401, another tenant's key is 404, and neither refusal carries
a byte of the app's answer.

42: a 16 MiB volume of the check's tenant: another tenant cannot see, delete or mount it (answered as for a volume
that does not exist), writing past its size inside a sandbox fails with ENOSPC, and the rest of the sandbox's disk
and (when the server's state directory is readable here) the host's image file stay within bounds.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

import httpx

from .._exceptions import ConflictError, CorralError
from .._sdk import AsyncVolume
from ._context import CheckContext, MiB, clip, readable_dir, run_ok
from ._model import ItemFailed, NotApplicable

__all__ = ["item_41_ports_are_the_tenants", "item_42_volumes_bounded"]

PORT = 8731
_SITE = "/workspace/corral-check-site"
_WAIT = (f"for i in $(seq 200); do (echo > /dev/tcp/127.0.0.1/{PORT}) 2>/dev/null && exit 0; sleep 0.05; done; "
         f"cat /tmp/corral-check-http.log; exit 1")


def _error_code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def item_41_ports_are_the_tenants(ctx: CheckContext) -> str:
    nonce = secrets.token_hex(16)
    async with ctx.sandbox() as sb:
        await sb.files.write(f"{_SITE}/page.txt", nonce)
        await sb.commands.run(f"nohup python3 -m http.server {PORT} --bind 127.0.0.1 --directory {_SITE} "
                              f">/tmp/corral-check-http.log 2>&1 &", timeout=30)
        await run_ok(sb, _WAIT, timeout=30, what=f"an HTTP server listening on port {PORT} in the sandbox")
        host = await sb.get_host(PORT)
        answers = {who: await _get(ctx, host, who) for who in ("developer", None, "other")}
    owner, anonymous, foreign = answers["developer"], answers[None], answers["other"]
    if owner.status_code != 200 or owner.text != nonce:
        raise ItemFailed(f"the sandbox's own tenant did not reach its port through {host}: {owner.status_code} "
                         f"{clip(owner.text, 200)}", fix="upgrade Corral (ports need `corral serve` with "
                         "get_host support) and let the Host header reach the server unchanged")
    wrong = [f"{what} -> {r.status_code} {clip(r.text, 120)}" for what, r, status, code in (
        ("no credentials", anonymous, 401, "unauthenticated"), ("another tenant's key", foreign, 404, "not_found"))
        if r.status_code != status or _error_code(r) != code or nonce in r.text]
    if wrong:
        raise ItemFailed(f"a sandbox's port answered callers who are not its tenant's ({host}): {'; '.join(wrong)}")
    return (f"port {PORT} through {host}: the owner's key reached the app, no credentials got 401 unauthenticated, "
            "another tenant's key 404 not_found")


async def _get(ctx: CheckContext, host: str, who: str | None) -> httpx.Response:
    headers = {"Host": host}
    if who is not None:
        headers["Authorization"] = f"Bearer {ctx.keys[who]}"
    async with httpx.AsyncClient(base_url=ctx.url, transport=ctx.target.transport, timeout=60,
                                 headers=headers) as client:
        return await client.get("/page.txt")


# -- 42 -------------------------------------------------------------------------------------------------------------

VOLUME_SIZE = 16 * MiB  # the smallest a server makes (ext4 needs a few MiB of its own)
_MOUNT = "/mnt/corral-check"
_FILL = f"dd if=/dev/zero of={_MOUNT}/fill bs=1M count={4 * VOLUME_SIZE // MiB}"
_DELETE_TRIES = 10


async def item_42_volumes_bounded(ctx: CheckContext) -> str:
    deployment = ctx.deployment
    if (reason := deployment.limitations.get("volumes")) is not None:
        raise NotApplicable(f"the {deployment.backend} backend: {reason}")  # as `limitation_verdicts` says it
    name = f"{ctx.tenant}-vol"
    vol = await AsyncVolume.create(name, VOLUME_SIZE, **_sdk(ctx, "developer"))
    try:
        refusals, refused = await _other_tenant(ctx, name)
        async with ctx.sandbox(volumes={_MOUNT: name}) as sb:
            fill = await sb.commands.run(_FILL, timeout=120)
            own = await sb.commands.run(f"rm -f {_MOUNT}/fill; echo ok > /workspace/corral-check-ok && "
                                        "cat /workspace/corral-check-ok", timeout=30)
        used = (await AsyncVolume.get(name, **_sdk(ctx, "developer"))).used
        host = _host_image(ctx, vol.id)
    finally:
        await _delete(vol)
    if refusals:
        raise ItemFailed(f"another tenant could reach the check's volume: {'; '.join(refusals)}")
    stderr = fill.stderr_bytes.decode(errors="replace")
    if fill.exit_code == 0 or "No space left on device" not in stderr:
        raise ItemFailed(f"writing {4 * VOLUME_SIZE // MiB} MiB into a {VOLUME_SIZE // MiB} MiB volume did not end "
                         f"with ENOSPC: exit {fill.exit_code}, stderr {clip(stderr)!r}")
    if own.exit_code != 0 or own.stdout != "ok\n":
        raise ItemFailed(f"after the volume filled up, the sandbox could not write its own disk: exit "
                         f"{own.exit_code}, stderr {clip(own.stderr_bytes)!r}")
    if used is None or used > VOLUME_SIZE:
        raise ItemFailed(f"the server says the volume uses {used} bytes of its {VOLUME_SIZE}")
    enospc = next(line for line in stderr.splitlines() if "No space left on device" in line)
    return (f"another tenant got 404 for the volume, did not see it listed and could not mount it ({refused}, as "
            f"for a volume that does not exist); writing past its {VOLUME_SIZE // MiB} MiB ended with ENOSPC "
            f"({clip(enospc, 80)}), the sandbox's own disk still took writes; {host}")


def _sdk(ctx: CheckContext, who: str) -> dict[str, Any]:
    return {"api_key": ctx.keys[who], "base_url": ctx.url, "transport": ctx.target.transport}


async def _other_tenant(ctx: CheckContext, name: str) -> tuple[list[str], str]:
    """What another tenant could do with the volume (empty: nothing), and how its mount was refused. A mount must
    be refused exactly as one of a volume that does not exist is, so that names do not leak across tenants."""
    wrong = []
    async with ctx.http("other") as other:
        for method in ("GET", "DELETE"):
            r = await other.request(method, f"/v1/volumes/{name}")
            if r.status_code != 404 or _error_code(r) != "not_found":
                wrong.append(f"{method} /v1/volumes/{name} -> {r.status_code} {clip(r.text, 120)}")
        listed = await other.get("/v1/volumes")
        if listed.status_code != 200 or name in listed.text:
            wrong.append(f"GET /v1/volumes -> {listed.status_code} {clip(listed.text, 120)}")
        mount, missing = [await other.post("/v1/sandboxes", json={
            "template": ctx.target.template, "timeout": 60, "volumes": {_MOUNT: volume},
            "metadata": {"corral-check": ctx.tenant}}) for volume in (name, f"{name}-none")]
        if mount.status_code == 201:
            await other.delete(f"/v1/sandboxes/{mount.json()['id']}")
            wrong.append(f"mounting it in a sandbox of another tenant -> 201 {clip(mount.text, 120)}")
        elif mount.status_code not in (400, 404) or (mount.status_code, _error_code(mount)) != (
                missing.status_code, _error_code(missing)):
            wrong.append(f"mounting it in a sandbox of another tenant -> {mount.status_code} {clip(mount.text, 120)}, "
                         f"where a volume that does not exist -> {missing.status_code} {clip(missing.text, 120)}")
    return wrong, f"{mount.status_code} {_error_code(mount)}"


def _host_image(ctx: CheckContext, volume_id: str) -> str:
    """The volume's image file on the host takes no more than the volume's size (the server's state directory is
    readable here), or why that was not looked at."""
    root = ctx.home / "volumes" if ctx.home is not None else None
    if root is None or not readable_dir(root):
        return "the host's side was not looked at (the server's state directory is not readable here)"
    image = root / volume_id / "volume.img"
    try:
        found = os.stat(image)
    except OSError as exc:
        raise ItemFailed(f"the volume's image is not where the server keeps it ({image}): {exc}") from exc
    if found.st_blocks * 512 > VOLUME_SIZE or found.st_size > VOLUME_SIZE:
        raise ItemFailed(f"the volume's image on the host ({image}) grew past its size: {found.st_blocks * 512} "
                         f"bytes on disk, {found.st_size} long, for a {VOLUME_SIZE}-byte volume")
    return f"on the host its image took {found.st_blocks * 512 // MiB} MiB of {VOLUME_SIZE // MiB}"


async def _delete(vol: AsyncVolume) -> None:
    """The check's volume goes once its sandbox is gone (a kill may take a moment to release the mount)."""
    for attempt in range(_DELETE_TRIES):
        try:
            await vol.delete()
            return
        except ConflictError:
            if attempt == _DELETE_TRIES - 1:
                raise
            await asyncio.sleep(0.5)
        except CorralError as exc:
            if exc.code == "not_found":
                return
            raise
