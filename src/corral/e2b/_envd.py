"""envd, E2B's in-sandbox daemon, as Corral serves it: `/health`, `/files` and the `process.Process` and
`filesystem.Filesystem` RPC services, for the sandbox an `E2b-Sandbox-Id` header (or a `49983-<id>` host) names.

Nothing of it runs in the sandbox: each call becomes calls on Corral's service, which reaches the sandbox through
its agent. `/health` answers 204 while the sandbox runs and its agent answers, 502 once it is killed, expired or
paused (E2B's SDKs read that as "the sandbox is gone").
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._exceptions import CorralError
from ._auth import sandbox_caller
from ._errors import corral_error, e2b_error
from ._files import download, sandbox_of, upload
from ._front import Front, front_of
from ._rpc import Rpc, rpc_endpoint

__all__ = ["ENVD_PORT", "envd_app"]

ENVD_PORT = 49983


async def health(request: Request) -> Response:
    sandbox_id = sandbox_of(request)
    if sandbox_id is None:
        return e2b_error(400, "no sandbox: send the E2b-Sandbox-Id header")
    svc = front_of(request).service
    try:
        principal = await sandbox_caller(svc, request, sandbox_id)
        alive = await svc.sandboxes.alive(principal, sandbox_id)
    except CorralError as exc:
        return corral_error(exc)
    if not alive:
        return e2b_error(502, f"sandbox {sandbox_id} is not running (killed, timed out or paused)")
    return Response(status_code=204)


def envd_app(front: Front, rpcs: Mapping[str, Rpc]) -> Starlette:
    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/files", download, methods=["GET"]),
        Route("/files", upload, methods=["POST"]),
        Route("/{service}/{method}", rpc_endpoint(rpcs, sandbox_of), methods=["POST"]),
    ])
    app.state.front = front
    return app
