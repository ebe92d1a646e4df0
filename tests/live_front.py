"""The whole server (`create_app`: /v1, E2B's API, /mcp) over a given engine, on a real loopback socket in the test's
event loop, with tenants a and b and their keys: what a front-end test needs of `corral serve`, on the fake engine
(the fast tier) or a real one, without a server process of its own.

Clients must be asynchronous (the server runs in the test's loop), or separate processes (`corral mcp`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from corral.control import ControlStore, Role
from corral.engine import Engine
from corral.server import create_app

__all__ = ["LiveFront", "live_front"]

KEYS = (("a_dev", "a", Role.DEVELOPER), ("a_aud", "a", Role.AUDITOR), ("b_dev", "b", Role.DEVELOPER))


@dataclass
class LiveFront:
    url: str
    keys: dict[str, str]  # "a_dev", "a_aud", "b_dev" -> raw key
    store: ControlStore


@contextlib.asynccontextmanager
async def live_front(engine: Engine, home: Path) -> AsyncIterator[LiveFront]:
    """Serve until the block ends; the engine is started again after (the app's lifespan closes it, and the
    engine's fixture closes it with every sandbox destroyed)."""
    store = ControlStore(home=home)
    app = create_app(engine, store)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="error"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(60):
            while not server.started:
                if task.done():
                    task.result()  # its error
                    raise RuntimeError("the server ended before it started")
                await asyncio.sleep(0.02)
        tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
        keys = {who: (await store.create_key(tenants[tenant], role, who)).key for who, tenant, role in KEYS}
        yield LiveFront(f"http://127.0.0.1:{sock.getsockname()[1]}", keys, store)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        await engine.start()
