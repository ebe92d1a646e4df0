"""`AgentCalls`, the base of `AgentClient`: reaching one sandbox's agent at its endpoint, one connection per
operation (`_op`), and the mapping of foreign errors (OSError, asyncio.IncompleteReadError, protocol violations) to
`AgentError` here, at the boundary; errors the agent reports come back through `error_from_code`.

Every wait on an agent is bounded (docs/architecture.md, "Agent liveness"): an agent of protocol version 2 sends a
heartbeat on a connection silent for `Liveness.heartbeat_interval`, and a connection silent for
`Liveness.idle_timeout` fails with `AgentError` (unless Corral itself froze the sandbox: `freeze`/`thaw`). The
operations themselves are the mixins' over this base: `_agent_processes.py`, `_agent_code.py`, `_agent_files.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from .._exceptions import AgentError, CorralError
from ..agent import protocol
from ..backends import Endpoint, UnixEndpoint
from ._agent_connection import AgentConnection, AgentState, Liveness

OutputCallback = Callable[[bytes], Awaitable[None] | None]
StartCallback = Callable[[str, int], Awaitable[None] | None]  # (Corral's process id, its pid in the sandbox)
Roots = list[str] | None  # directories the file API may touch; None: anywhere the user can
_TCP_CONNECT_TIMEOUT = 10.0


class AgentCalls:
    """One sandbox's agent at its endpoint (a Unix socket on this host, or TCP to a Pod): a connection per
    operation, sending the sandbox's token (and the user the client acts as) with every request."""

    def __init__(self, endpoint: Endpoint, token: str, *, label: str = "sandbox", user: str | None = None,
                 liveness: Liveness | None = None, sandbox_id: str | None = None,
                 _state: AgentState | None = None) -> None:
        self.endpoint = endpoint
        self.token = token
        self.label = label
        self.user = user
        self.liveness = liveness or Liveness()
        self.sandbox_id = sandbox_id
        self._state = _state or AgentState()

    def freeze(self) -> None:
        """Corral is pausing the sandbox: its silence from now on is no sign of a wedged agent."""
        self._state.frozen = True

    def thaw(self) -> None:
        """The sandbox runs again: calls that waited through the pause get a whole idle timeout from now."""
        self._state.frozen = False
        self._state.thawed_at = time.monotonic()

    @property
    def _details(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id} if self.sandbox_id is not None else {}

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The reader stops taking from the socket past twice this much buffered (readexactly of a bigger frame
        # still works): one chunk keeps a download's buffered bytes near 2 MiB instead of 16 MiB of server memory.
        # (`asyncio.timeout`, not `wait_for`: before Python 3.12 that runs the connect as a task of its own, a loop
        # iteration more on every call.)
        limit = protocol.CHUNK
        async with asyncio.timeout(self._connect_timeout()):
            if isinstance(self.endpoint, UnixEndpoint):
                # Fails at once if nothing listens, but waits if a stopped agent's backlog is full.
                return await asyncio.open_unix_connection(self.endpoint.path, limit=limit)
            # A TCP connect to an address that went away may hang for minutes.
            return await asyncio.open_connection(self.endpoint.host, self.endpoint.port, limit=limit)

    def _connect_timeout(self) -> float:
        if isinstance(self.endpoint, UnixEndpoint):
            return self.liveness.idle_timeout or _TCP_CONNECT_TIMEOUT
        return _TCP_CONNECT_TIMEOUT

    def _unreachable(self, exc: OSError) -> AgentError:
        """A connection to the agent that failed: why, and what it likely means."""
        if isinstance(exc, TimeoutError):
            return AgentError(f"the agent of {self.label} did not accept a connection within "
                              f"{self._connect_timeout():g}s; the sandbox may have stopped", details=self._details)
        return AgentError(f"the agent of {self.label} is unreachable ({exc.strerror or exc}); "
                          "the sandbox may have stopped", details=self._details)

    async def _heartbeat_field(self, op: str) -> dict[str, float]:
        """What asks the agent for heartbeats, if it sends them; a ping (answered at once by any agent) learns
        that once per agent. An agent of before them is not asked, and its silences are waited out."""
        if op == "ping" or self.liveness.idle_timeout is None:
            return {}
        if self._state.heartbeats is None:
            await self.ping()
        return {"heartbeat": self.liveness.heartbeat_interval} if self._state.heartbeats else {}

    @contextlib.asynccontextmanager
    async def _op(self, op: str, **args: Any) -> AsyncIterator[AgentConnection]:
        beat = await self._heartbeat_field(op)
        try:
            reader, writer = await self._connect()
        except (TimeoutError, OSError) as exc:
            raise self._unreachable(exc) from exc
        # A ping is bounded whatever the agent's version: every agent answers it at once.
        idle = self.liveness.idle_timeout if beat or op == "ping" else None
        conn = AgentConnection(reader, writer, self.label, op=op, idle=idle, state=self._state, details=self._details)
        try:
            # No `user` field for the sandbox user: requests stay what they were, for agents of before it.
            identity = {"user": self.user} if self.user is not None else {}
            await conn.send_json(protocol.REQUEST, {"op": op, "token": self.token, **identity, **beat, **args})
            yield conn
        except CorralError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:  # EOF, or a reset: its end went away
            raise AgentError(f"the agent of {self.label} closed the connection during {op!r}; "
                             "the sandbox may have been killed or run out of memory") from exc
        except (OSError, protocol.ProtocolError) as exc:
            raise AgentError(f"talking to the agent of {self.label} failed during {op!r}: {exc}") from exc
        finally:
            await conn.close()

    async def _simple(self, op: str, **args: Any) -> dict[str, Any]:
        async with self._op(op, **args) as conn:
            return await conn.event()

    # -- health ------------------------------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        ev = await self._simple("ping")
        self._state.heartbeats = int(ev.get("version") or 1) >= 2  # version 2 brought heartbeats
        return ev

    # -- a bare socket (a port's raw pipe) ------------------------------------------------------------

    async def _connect_socket(self) -> socket.socket:
        """A bare non-blocking socket to the agent: a tunnel must not leave bytes of its pipe in a reader's
        buffer, so nothing is read past the one event."""
        loop = asyncio.get_running_loop()
        try:
            if isinstance(self.endpoint, UnixEndpoint):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                address: Any = self.endpoint.path
            else:
                infos = await loop.getaddrinfo(self.endpoint.host, self.endpoint.port, type=socket.SOCK_STREAM)
                family, kind, proto, _, address = infos[0]
                sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(self._connect_timeout()):
                    await loop.sock_connect(sock, address)
            except BaseException:
                sock.close()
                raise
        except (TimeoutError, OSError) as exc:
            raise self._unreachable(exc) from exc
        return sock

    @contextlib.contextmanager
    def _mapped(self, op: str) -> Iterator[None]:
        """Foreign errors while talking to the agent, as `AgentError` (as `_op` maps them)."""
        try:
            yield
        except CorralError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise AgentError(f"the agent of {self.label} closed the connection during {op!r}; "
                             "the sandbox may have been killed or run out of memory") from exc
        except (OSError, protocol.ProtocolError) as exc:
            raise AgentError(f"talking to the agent of {self.label} failed during {op!r}: {exc}") from exc


def optional(**fields: Any) -> dict[str, Any]:
    """Request fields worth sending: older requests stay byte-for-byte what they were."""
    return {key: value for key, value in fields.items() if value is not None}


async def call_output(cb: OutputCallback, data: bytes) -> None:
    res = cb(data)
    if res is not None:
        await res
