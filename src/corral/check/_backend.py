"""What the server runs sandboxes on, as `GET /v1/info` tells it, and what that means for the checklist.

A backend that cannot give part of the isolation says so, key by key with the reason (docs/backends.md). Each key
`corral check` knows becomes an N/A part of the items it touches (`LIMITATION_ITEMS`), beside whatever else those
items still prove; a key it does not know is printed with the report. Runtimes are items 31's and 40's own: their
functions ask for a gVisor sandbox wherever the server offers runsc, and say why not where it does not.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from .._exceptions import CorralError, error_from_code
from .._sdk import AsyncSandbox
from ._context import REQUEST_TIMEOUT, CheckContext, Deployment, Target, clip, run_ok
from ._host import AGENT_TCP_LIMITATION
from ._model import ItemFailed, NotApplicable, Verdict

__all__ = ["LIMITATION_ITEMS", "fetch_deployment", "gvisor_unavailable", "item_31_gvisor", "limitation_verdicts",
           "on_gvisor", "refused_runsc", "sandbox_kernel", "unknown_limitations"]

# A backend limitation's key -> the items it leaves partly unprovable (docs/backends.md). `runtime_<name>` keys
# are not here: items 31 and 40 read the server's runtimes themselves.
LIMITATION_ITEMS: Mapping[str, tuple[int, ...]] = {
    "user_namespace": (3,),  # uid 1000 inside is uid 1000 of the host too: the host-side half of "non-root"
    "agent_socket": (1,),  # the agent's own socket is listed in the sandbox's /proc/net/unix (unreachable)
    AGENT_TCP_LIMITATION: (2,),  # the agent listens on the sandbox's address (a Pod's), token and NetworkPolicy
    "volumes": (42,),  # no volumes on that backend (Kubernetes: not yet)
    "checkpoints": (45,),  # no checkpoints on that backend (Kubernetes: not yet)
    "root": (),  # no sandbox with root there: an option the backend refuses, nothing of the isolation is missing
}
_RUNTIME_KEY = "runtime_"


def unknown_limitations(deployment: Deployment) -> list[str]:
    """The limitations no item shows: printed with the report instead, never dropped."""
    return [f"the {deployment.backend} backend: {key}: {reason}" for key, reason in
            sorted(deployment.limitations.items()) if key not in LIMITATION_ITEMS and not key.startswith(_RUNTIME_KEY)]


async def fetch_deployment(target: Target) -> Deployment:
    """The server's answer to `GET /v1/info` (with the admin's key). A server that predates the route (404) ran
    the local backend, the only one there was then."""
    async with httpx.AsyncClient(base_url=target.url.rstrip("/"), transport=target.transport,
                                 timeout=REQUEST_TIMEOUT,
                                 headers={"Authorization": f"Bearer {target.admin_key}"}) as http:
        r = await http.get("/v1/info")
    if r.status_code == 404:
        return Deployment()
    if r.status_code != 200:
        error = _error_of(r)
        raise error_from_code(error.get("code", "server_error"), f"asking the server for its backend (GET /v1/info) "
                              f"answered {r.status_code}: {error.get('message') or clip(r.text)}")
    try:
        body = r.json()
        return Deployment(backend=str(body["backend"]), runtimes=tuple(str(x) for x in body["runtimes"]),
                          limitations={str(k): str(v) for k, v in dict(body["limitations"]).items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise CorralError(f"GET /v1/info answered no backend: {clip(r.text)}") from exc


def _error_of(r: httpx.Response) -> dict[str, str]:
    try:
        error = r.json()["error"]
        return {"code": str(error["code"]), "message": str(error["message"])}
    except (ValueError, KeyError, TypeError):
        return {}


def limitation_verdicts(deployment: Deployment, items: set[int]) -> dict[int, list[Verdict]]:
    """An N/A part, with the backend's reason, for each of `items` a limitation of the deployment touches."""
    found: dict[int, list[Verdict]] = {}
    for key, reason in sorted(deployment.limitations.items()):
        for number in LIMITATION_ITEMS.get(key, ()):
            if number in items:
                found.setdefault(number, []).append(Verdict("N/A", f"the {deployment.backend} backend: {reason}"))
    return found


GVISOR_PROBE = "dmesg 2>&1 | head -1; uname -r"
_INSTALL_RUNSC = "install gVisor's runsc where the server runs (`apt-get install runsc`) and do not alias it to runc"


def gvisor_unavailable(deployment: Deployment) -> str | None:
    """Why this deployment cannot run a gVisor sandbox (its own words), or None when it offers runsc."""
    if "runsc" in deployment.runtimes:
        return None
    reason = deployment.limitations.get(f"{_RUNTIME_KEY}runsc", "it offers no runsc runtime")
    return f"gVisor on the {deployment.backend} backend: {reason}"


def refused_runsc(exc: CorralError) -> NotApplicable:
    """A create the server refused with `runtime_unavailable`: it fails closed, so gVisor is not there to prove."""
    return NotApplicable(f"gVisor: the server refuses runsc sandboxes (it fails closed): {clip(exc.message, 300)}")


async def sandbox_kernel(sb: AsyncSandbox) -> tuple[str, str]:
    """The first line of the sandbox's kernel log and its kernel release: gVisor's log names it (`on_gvisor`)."""
    r = await run_ok(sb, GVISOR_PROBE, timeout=60, what="dmesg and uname in the sandbox", cwd="/")
    lines = [*r.stdout_bytes.decode(errors="replace").splitlines(), "", ""]
    return lines[0], lines[1]


def on_gvisor(first_log_line: str) -> bool:
    return "gVisor" in first_log_line


async def item_31_gvisor(ctx: CheckContext) -> str:
    """Item 31's gVisor half (the corpus's tasks prove the runc half): where the server offers runsc, a runsc
    sandbox reports gVisor's kernel, not the host's."""
    if (missing := gvisor_unavailable(ctx.deployment)) is not None:
        raise NotApplicable(missing)
    try:
        async with ctx.sandbox(runtime="runsc") as sb:
            log, kernel = await sandbox_kernel(sb)
    except CorralError as exc:
        if exc.code != "runtime_unavailable":
            raise
        raise refused_runsc(exc) from exc
    if not on_gvisor(log):
        raise ItemFailed(f"a sandbox created with runtime=runsc does not run on gVisor: its kernel log begins "
                         f"{clip(log, 120)!r}, its kernel is {clip(kernel, 60)!r}", fix=_INSTALL_RUNSC)
    return f"a runsc sandbox runs on gVisor ({clip(log, 80)}; kernel {clip(kernel, 40)})"
