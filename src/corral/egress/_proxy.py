"""`EgressProxy`: the one way out of a sandbox (docs/egress.md).

Each sandbox gets its own Unix socket (bind-mounted into it; the agent bridges 127.0.0.1:3128 to it), so the
socket a connection arrives on says which sandbox, and which policy, it belongs to. Every request or tunnel is
one attempt: policy check -> resolve once -> check every address -> connect to a checked address -> relay, and
exactly one `EgressEvent` when it ends.

Sandboxes on other machines (Pods: `corral egress-proxy`, docs/kubernetes-backend.md) reach one TCP listener
instead (`listen`): there a connection says who it is with `Proxy-Authorization: Basic <sandbox id>:<credential>`,
checked per request by an `Identify` callback that also gives the policy. Their refusals are reported (awaited)
before the sandbox sees them, so the server that ran the command finds them in the shared audit trail.

The parts: `_connection.py` (one client connection and its requests), built of `_connection_base.py` (its two
ends and the way out), `_forwarding.py`, `_interception.py` (hosts a secret is bound to) and `_origin.py` (the
package mirror, DNS reports); `_proxied.py` (a served sandbox, one attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from .._exceptions import NotFoundError, ServerError
from ._addresses import AddressGuard, IPNetwork
from ._ca import CertificateAuthority, upstream_context
from ._connection import Connection, Identify
from ._events import EgressEvent, PackageMirrorProtocol
from ._http import MAX_HEAD
from ._policy import EgressPolicy
from ._proxied import Attempt, ProxiedSandbox

__all__ = ["EgressProxy", "EventCallback", "Identify"]

log = logging.getLogger("corral.egress")

EventCallback = Callable[[EgressEvent], Awaitable[None] | None]


class EgressProxy:
    """The host side of every sandbox's network access.

    **Parameters:**
    * `on_event`: called with every `EgressEvent` (sync or async); its errors are logged, never raised.
    * `mirror`: the package mirror that serves `/pypi/...` and `/npm/...` to sandboxes granted `@packages`.
    * `extra_forbidden`: more networks no sandbox may reach (CIDR strings), beyond the built-in ranges.
    * `idle_timeout`: seconds a client connection may sit without a complete request head.
    * `connect_timeout`: seconds for resolving a name and for connecting to it, each.
    * `io_timeout`: seconds any read or write may stall mid-transfer, and a tunnel may be silent both ways.
    * `ca`: the deployment's CA, to intercept TLS to the hosts a sandbox's secrets are bound to (docs/secrets.md);
      without one, such a tunnel is refused (a secret is never sent where it would stay a placeholder).
    * `upstream_tls`: how those hosts' own certificates are verified (`upstream_context`: the host's trust store
      plus `--upstream-ca`).

    A refused or failed attempt is reported with `allowed=False`; `rule` says which rule or failure decided.
    """

    def __init__(self, on_event: EventCallback | None = None, mirror: PackageMirrorProtocol | None = None,
                 extra_forbidden: Iterable[str | IPNetwork] = (), *, idle_timeout: float = 60.0,
                 connect_timeout: float = 10.0, io_timeout: float = 300.0, ca: CertificateAuthority | None = None,
                 upstream_tls: ssl.SSLContext | None = None) -> None:
        self.on_event = on_event
        self.ca = ca
        self.upstream_tls = upstream_tls or upstream_context()
        self.mirror = mirror
        self.guard = AddressGuard(extra_forbidden)
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self._sandboxes: dict[str, ProxiedSandbox] = {}
        self._callbacks: set[asyncio.Future[Any]] = set()
        self._listeners: list[asyncio.AbstractServer] = []
        self._remote_connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.guard.own()  # read the host's addresses now, so the first connection does not pay for it

    async def close(self) -> None:
        """Stop every listener and tunnel; wait (briefly) for async event callbacks still running."""
        for sandbox_id in list(self._sandboxes):
            await self.detach(sandbox_id)
        for server in self._listeners:
            server.close()
        self._listeners.clear()
        for task in self._remote_connections:
            task.cancel()
        if self._remote_connections:
            await asyncio.wait(self._remote_connections, timeout=5)
        if self._callbacks:
            await asyncio.wait(self._callbacks, timeout=5)

    async def attach(self, sandbox_id: str, socket_path: Path, policy: EgressPolicy) -> None:
        """Listen for `sandbox_id` at `socket_path` (its directory gates who can connect) under `policy`."""
        await self.detach(sandbox_id)
        socket_path = Path(socket_path)
        sandbox = ProxiedSandbox(sandbox_id, socket_path, policy)
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()  # a stale socket from before a restart

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(sandbox, reader, writer)

        try:
            sandbox.server = await asyncio.start_unix_server(serve, path=str(socket_path), limit=MAX_HEAD)
            socket_path.chmod(0o666)  # sandbox uids differ from ours; the directory is what gates access
        except OSError as exc:
            if sandbox.server is not None:
                sandbox.server.close()
            raise ServerError(f"egress proxy cannot listen on {socket_path}: {exc}") from exc
        self._sandboxes[sandbox_id] = sandbox

    async def listen(self, host: str, port: int, identify: Identify) -> list[tuple[str, int]]:
        """Serve sandboxes that reach this proxy over TCP (Pods: `corral egress-proxy`), each request as the
        sandbox its `Proxy-Authorization` names, under the policy `identify` gives; the addresses bound."""

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve_remote(identify, reader, writer)

        try:
            server = await asyncio.start_server(serve, host, port, limit=MAX_HEAD)
        except OSError as exc:
            raise ServerError(f"egress proxy cannot listen on {host}:{port}: {exc}") from exc
        self._listeners.append(server)
        return [(str(sock.getsockname()[0]), int(sock.getsockname()[1])) for sock in server.sockets]

    def set_policy(self, sandbox_id: str, policy: EgressPolicy) -> None:
        """Replace the policy; it applies to new connections and requests, open tunnels keep running."""
        self._get(sandbox_id).policy = policy

    def policy(self, sandbox_id: str) -> EgressPolicy:
        return self._get(sandbox_id).policy

    async def detach(self, sandbox_id: str) -> None:
        """Close the listener and every open connection of the sandbox, and remove its socket file."""
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        sandbox.detached = True  # a connection accepted but not yet served closes as soon as it runs
        if sandbox.server is not None:
            # Let connections asyncio accepted already get their transports (Python 3.11 leaks one whose server
            # closed first), then drain the listen queue and close the listener in the same step.
            for _ in range(3):
                await asyncio.sleep(0)
            _close_backlog(sandbox.server)
            sandbox.server.close()
        for task in sandbox.connections:
            task.cancel()
        if sandbox.connections:
            await asyncio.wait(sandbox.connections, timeout=5)
        if sandbox.path is not None:
            with contextlib.suppress(OSError):
                sandbox.path.unlink()

    def denials(self, sandbox_id: str, since: float) -> list[EgressEvent]:
        """Refused attempts at or after `since` (a `time.time()`), oldest first; the last 200 are kept."""
        sandbox = self._sandboxes.get(sandbox_id)
        return [] if sandbox is None else [e for e in sandbox.denials if e.time >= since]

    def _get(self, sandbox_id: str) -> ProxiedSandbox:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise NotFoundError(f"sandbox {sandbox_id!r} has no egress listener") from None

    async def _serve(self, sandbox: ProxiedSandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sandbox.connections.add(task)
        try:
            if not sandbox.detached:
                await Connection(self, sandbox, reader, writer).serve()
        except asyncio.CancelledError:
            # Only detach() cancels these tasks; ending normally keeps asyncio from logging the cancellation.
            pass
        except Exception:
            log.exception("egress connection of sandbox %s failed", sandbox.id)
        finally:
            sandbox.connections.discard(task)
            writer.close()

    async def _serve_remote(self, identify: Identify, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._remote_connections.add(task)
        try:
            await Connection(self, None, reader, writer, identify).serve()
        except asyncio.CancelledError:
            pass  # close() cancels these
        except Exception:
            log.exception("egress connection from %s failed", writer.get_extra_info("peername"))
        finally:
            self._remote_connections.discard(task)
            writer.close()

    def emit(self, sandbox: ProxiedSandbox | None, attempt: Attempt) -> asyncio.Future[Any] | None:
        """Report the attempt (once; with no sandbox, a 407, there is nobody to attribute it to); the callback's
        future when it is async, which `report_now` waits for."""
        if sandbox is None or attempt.reported:
            return None
        attempt.reported = True
        event = attempt.event(sandbox.id)
        if not event.allowed:
            sandbox.denials.append(event)
        if self.on_event is None:
            return None
        try:
            result = self.on_event(event)
        except Exception:
            log.exception("egress event callback failed")
            return None
        if not inspect.isawaitable(result):
            return None
        future = asyncio.ensure_future(result)
        self._callbacks.add(future)
        future.add_done_callback(self._callback_done)
        return future

    async def report_now(self, sandbox: ProxiedSandbox, attempt: Attempt) -> None:
        """Report a refusal and wait (bounded) for it to be recorded, before the sandbox is answered; a failure is
        logged by `_callback_done`, and one still running after the wait goes on recording."""
        future = self.emit(sandbox, attempt)
        if future is not None:
            await asyncio.wait({future}, timeout=self.connect_timeout)

    def _callback_done(self, future: asyncio.Future[Any]) -> None:
        self._callbacks.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("egress event callback failed", exc_info=future.exception())


def _close_backlog(server: asyncio.AbstractServer) -> None:
    """Accept and close connections still waiting in the listen queue: closing the listener does not always tell
    their clients (they would wait for an answer that never comes)."""
    for listener in getattr(server, "sockets", ()):
        with socket.socket(fileno=os.dup(listener.fileno())) as sock:
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                while True:
                    sock.accept()[0].close()
