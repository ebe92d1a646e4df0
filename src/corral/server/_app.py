"""`create_app(engine, store)`: the FastAPI application, its routes, error handlers and lifespan.

The lifespan starts the store and the engine, runs the reaper (every second it destroys sandboxes past their
timeout), and on shutdown stops both; sandboxes keep running for the next server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from .._exceptions import CorralError, NotFoundError, SandboxTimeoutError
from ..control import AuditEvent, ControlStore
from ..egress import PackageMirror
from ..engine import Engine
from . import _admin, _code, _egress, _exec, _files, _killswitch, _processes, _pty, _sandboxes
from ._context import Services
from ._egress import wire_egress
from ._errors import install_error_handlers

logger = logging.getLogger("corral.server")

REAP_INTERVAL = 1.0
StartupHook = Callable[[ControlStore], Awaitable[None]]


async def reap_expired(engine: Engine, store: ControlStore) -> list[str]:
    """Destroy every sandbox past its timeout; returns their ids."""
    reaped: list[str] = []
    for record in await store.expired_sandboxes():
        try:
            with contextlib.suppress(NotFoundError, SandboxTimeoutError):
                await engine.destroy(record.id)
            await store.mark_destroyed(record.id)
        except CorralError:
            logger.exception("sandbox.reap_failed", extra={"sandbox": record.id})
            continue
        await store.audit.append(AuditEvent(action="sandbox.expire", target=record.id, tenant_id=record.tenant_id,
                                            outcome={"status": "destroyed", "reason": "timeout"}))
        reaped.append(record.id)
    return reaped


async def _reaper(engine: Engine, store: ControlStore) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL)
        try:
            await reap_expired(engine, store)
        except Exception:
            logger.exception("reaper pass failed")


def create_app(engine: Engine, store: ControlStore, *, on_startup: StartupHook | None = None) -> FastAPI:
    """The API app over `engine` and `store`; the lifespan starts and stops both."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        proxy = engine.egress
        try:
            if on_startup is not None:
                await on_startup(store)
            if proxy is not None:  # before the engine: reattached sandboxes get their proxy socket back
                wire_egress(engine, store)
                await proxy.start()
            await engine.start()
            reaper = asyncio.create_task(_reaper(engine, store))
            try:
                yield
            finally:
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper
                await engine.close()
        finally:
            if proxy is not None:
                await proxy.close()
                if isinstance(proxy.mirror, PackageMirror):  # its upstream connections
                    await proxy.mirror.close()
            await store.close()

    app = FastAPI(title="Corral", version="1", lifespan=lifespan)
    app.state.corral = Services(engine=engine, store=store)
    install_error_handlers(app)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    for module in (_sandboxes, _egress, _exec, _code, _files, _admin, _killswitch, _processes, _pty):
        app.include_router(module.router)
    return app
