"""The whole server (`create_app`: /v1, E2B's API, /mcp) over a given engine, on a real loopback socket in the test's
event loop, with tenants a and b and their keys: what a front-end test needs of `corral serve`, on the fake engine
(the fast tier) or a real one, without a server process of its own.

`live_front` serves in the test's own loop: its clients must be asynchronous, or separate processes (`corral mcp`).
`threaded_front` serves a fake engine from a thread with a loop of its own, for synchronous clients (the CLI in
typer's runner, the synchronous SDKs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from corral.control import ControlStore, Role
from corral.engine import Engine
from corral.server import create_app

__all__ = ["LiveFront", "live_front", "threaded_front"]

KEYS = (("a_dev", "a", Role.DEVELOPER), ("a_aud", "a", Role.AUDITOR), ("b_dev", "b", Role.DEVELOPER))


@dataclass
class LiveFront:
    url: str
    keys: dict[str, str]  # "a_dev", "a_aud", "b_dev" -> raw key
    store: ControlStore
    home: Path  # the control store's: corral.db, audit.key
    admin_key: str


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
        await store.bootstrap_admin(None)  # as `corral serve` does on a new home: <home>/admin.key
        tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
        keys = {who: (await store.create_key(tenants[tenant], role, who)).key for who, tenant, role in KEYS}
        yield LiveFront(f"http://127.0.0.1:{sock.getsockname()[1]}", keys, store, home,
                        (home / "admin.key").read_text().strip())
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        await engine.start()


@contextlib.contextmanager
def threaded_front(home: Path) -> Iterator[LiveFront]:
    """`live_front` over a fake engine, served from a thread of its own until the block ends."""
    from .conftest import fake_started_engine

    ready: concurrent.futures.Future[LiveFront] = concurrent.futures.Future()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with fake_started_engine() as engine, live_front(engine, home) as front:
            ready.set_result(front)
            await stop.wait()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:  # what is still pending (a connection's handler) ends here, not at garbage collection
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            asyncio.set_event_loop(None)

    thread = threading.Thread(target=run, name="threaded-front", daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=60)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
