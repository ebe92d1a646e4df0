"""`corral serve --metrics-port`: `/metrics` on a port of its own, served by the same process and event loop.

A second uvicorn server that leaves the signals to the API's: SIGTERM stops the API server as before, and this one
with it. Its port is bound before either starts, so a port that is taken fails `corral serve` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from ..service import Service
from ._prometheus import metrics_app

__all__ = ["DEFAULT_METRICS_HOST", "MetricsPort", "serve_with_metrics_port"]

DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class MetricsPort:
    """Where `/metrics` is also served, without authentication: loopback unless the operator names another
    address, since anyone who reaches it reads every tenant's counts."""

    port: int
    host: str = DEFAULT_METRICS_HOST


class _Sidecar(uvicorn.Server):
    """A uvicorn server that installs no signal handlers: two servers' handlers would replace each other's, and
    a SIGTERM would then stop only one of them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def serve_with_metrics_port(main: uvicorn.Server, service: Service, where: MetricsPort, *,
                            json_logs: bool) -> None:
    """Run the API server `main` and the metrics port until the API server stops."""
    config = uvicorn.Config(metrics_app(service), lifespan="off", log_level="warning", access_log=False,
                            log_config=None if json_logs else LOGGING_CONFIG)
    with _bound(where) as sock:
        asyncio.run(_serve_both(main, _Sidecar(config), sock))


async def _serve_both(main: uvicorn.Server, sidecar: uvicorn.Server, sock: socket.socket) -> None:
    task = asyncio.create_task(sidecar.serve(sockets=[sock]), name="corral-metrics-port")
    try:
        await main.serve()
    finally:
        sidecar.should_exit = True
        await task


@contextlib.contextmanager
def _bound(where: MetricsPort) -> Generator[socket.socket, None, None]:
    family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((where.host, where.port))
        yield sock
