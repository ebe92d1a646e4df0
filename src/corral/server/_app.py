"""`create_app(engine, store)`: the REST front end over one `Service`, its routes and error handlers.

The lifespan starts and stops the service (store, egress proxy, engine, reconciler); sandboxes keep running for
the next server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..control import ControlStore
from ..e2b import E2BConfig, E2BMiddleware
from ..engine import Engine
from ..mcp import MCPFront
from ..service import DEFAULT_DOMAIN, ReplicaConfig, Service, StartupHook
from . import (
    _admin,
    _checkpoints,
    _code,
    _egress,
    _eval,
    _exec,
    _files,
    _info,
    _killswitch,
    _processes,
    _prometheus,
    _pty,
    _sandboxes,
    _secrets,
    _snapshots,
    _volumes,
)
from ._body_limit import BodyLimitMiddleware
from ._errors import install_error_handlers
from ._packets import one_packet
from ._ports import PortsMiddleware
from ._replicas import Forwarder, ReplicaMiddleware
from ._request_log import RequestLogMiddleware
from ._ui import PREFIX, ui_app

__all__ = ["create_app"]


class _App(FastAPI):
    """FastAPI, with a response of known length sent as one packet (`_packets`): the `send` uvicorn hands this
    outermost app is the only one that still knows the connection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        corked = one_packet(send) if scope["type"] == "http" else None
        if corked is None:
            await super().__call__(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, corked)
        finally:
            corked.release()


def create_app(engine: Engine, store: ControlStore, *, on_startup: StartupHook | None = None,
               domain: str = DEFAULT_DOMAIN, e2b: E2BConfig | None = None,
               replica: ReplicaConfig | None = None, metrics: bool = True) -> FastAPI:
    """The API app over `engine` and `store`; the lifespan starts and stops both (through the service).
    Requests to `<port>-<sandbox id>.<domain>` hosts go to that port in the sandbox instead (docs/ports.md);
    E2B's API is served beside /v1, at the root (docs/e2b.md; `e2b`: its settings), and MCP at /mcp
    (docs/mcp.md). `replica`: this server among several on one database; requests for another replica's
    sandboxes go there (docs/replicas.md). `metrics`: count Prometheus metrics and serve them to admins at
    /metrics (docs/operations.md). Every request gets an id (`X-Request-Id`) that its log line and audit records
    carry."""
    service = Service(engine, store, on_startup=on_startup, domain=domain, replica=replica, metrics=metrics)
    forwarder = Forwarder()
    mcp = MCPFront(service)  # `/mcp`: MCP's streamable HTTP (docs/mcp.md)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with service, mcp.run():
                yield
        finally:
            await forwarder.aclose()

    app = _App(title="Corral", version="1", lifespan=lifespan)
    app.state.corral = service
    install_error_handlers(app)
    app.add_middleware(PortsMiddleware, service=service)  # before any route: port hosts never reach the API
    # Outermost: E2B's data plane names sandboxes by header (and its ports 49983/49999 by host) before any of it.
    app.add_middleware(E2BMiddleware, service=service, config=e2b or E2BConfig())
    # Around every front that parses a body whole (not the data plane): a bound before anything is buffered.
    app.add_middleware(BodyLimitMiddleware, domain=service.ports.domain)
    # Outermost of all: a request for a sandbox another replica runs goes there whole, whichever front it is for.
    app.add_middleware(ReplicaMiddleware, service=service, forwarder=forwarder)
    # Around everything: the request id is given before a request can be forwarded, and the log line measures it all.
    app.add_middleware(RequestLogMiddleware)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    app.router.routes.append(Route("/mcp", mcp))  # an ASGI app, not an endpoint: MCP's transport owns the methods
    for module in (_sandboxes, _snapshots, _checkpoints, _egress, _exec, _code, _files, _admin, _killswitch, _processes,
                   _pty, _info, _volumes, _secrets, _eval):
        app.include_router(module.router)
    if metrics:
        app.include_router(_prometheus.router)

    @app.get(PREFIX, include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=308)

    app.mount(PREFIX, ui_app())  # the dashboard (docs/dashboard.md): static files that call the API above
    return app
