"""`create_app(engine, store)`: the REST front end over one `Service`, its routes and error handlers.

The lifespan starts and stops the service (store, egress proxy, engine, reconciler); sandboxes keep running for
the next server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from ..control import ControlStore
from ..engine import Engine
from ..service import Service, StartupHook
from . import _admin, _code, _egress, _exec, _files, _info, _killswitch, _processes, _pty, _sandboxes
from ._errors import install_error_handlers

__all__ = ["create_app"]


def create_app(engine: Engine, store: ControlStore, *, on_startup: StartupHook | None = None) -> FastAPI:
    """The API app over `engine` and `store`; the lifespan starts and stops both (through the service)."""
    service = Service(engine, store, on_startup=on_startup)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service:
            yield

    app = FastAPI(title="Corral", version="1", lifespan=lifespan)
    app.state.corral = service
    install_error_handlers(app)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    for module in (_sandboxes, _egress, _exec, _code, _files, _admin, _killswitch, _processes, _pty, _info):
        app.include_router(module.router)
    return app
