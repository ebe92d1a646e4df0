"""`AgentClient`, the host side of the agent protocol: one asyncio connection per operation.

It is put together here from its parts, each a concept of its own: the connection (`_agent_connection.py`: frames,
heartbeats, the idle timeout), the calls over it (`_agent_calls.py`: connect, one request per connection, foreign
errors mapped to `AgentError`), and the operations (`_agent_processes.py`, `_agent_code.py`, `_agent_files.py`);
this module adds the raw pipe to a port (`open_port`) and `as_user`, and is where the names are imported from.

Every wait on an agent is bounded (docs/architecture.md, "Agent liveness"): an agent of protocol version 2 sends a
heartbeat on a connection silent for `Liveness.heartbeat_interval`, and a connection silent for
`Liveness.idle_timeout` fails with `AgentError` (unless Corral itself froze the sandbox: `freeze`/`thaw`).
"""

from __future__ import annotations

import asyncio
import socket

from .._exceptions import error_from_code
from ..agent import protocol
from ._agent_calls import AgentCalls, OutputCallback, Roots, StartCallback
from ._agent_code import AgentCode
from ._agent_connection import Liveness, Source, silent_agent, sock_read_frame
from ._agent_files import AgentFiles, WatchStream
from ._agent_processes import AgentProcesses, PtySession

__all__ = ["AgentCalls", "AgentClient", "Liveness", "OutputCallback", "PtySession", "Roots", "Source",
           "StartCallback", "WatchStream"]


class AgentClient(AgentProcesses, AgentCode, AgentFiles):
    """Talks to one sandbox's agent at its endpoint (a Unix socket on this host, or TCP to a Pod), sending the
    sandbox's token with every request.

    `user`: whom the agent acts as for this client's requests (commands run as, files opened as): None is the
    sandbox user; "root" only in a sandbox created with root (the agent refuses it elsewhere). `as_user` makes
    such a client. `liveness`: how long a silent agent is waited for; `sandbox_id` goes into its errors'
    details."""

    def as_user(self, user: str | None) -> AgentClient:
        """This agent, acting as `user` (None: the sandbox user)."""
        if user == self.user:
            return self
        return AgentClient(self.endpoint, self.token, label=self.label, user=user, liveness=self.liveness,
                           sandbox_id=self.sandbox_id, _state=self._state)

    # -- ports -----------------------------------------------------------------------------------

    async def open_port(self, port: int) -> socket.socket:
        """A connection to `port` inside the sandbox (127.0.0.1, else ::1), through the agent: a connected,
        non-blocking socket that is from now on a raw byte pipe to that port (a half-close is passed on as one).
        The caller owns it and closes it.

        Nothing listening there is an `AgentError` whose message names the port (`details["port"]`); a port
        outside 1..65535 is `InvalidRequestError`, from the agent (docs/ports.md)."""
        request = protocol.encode_json(protocol.REQUEST, {"op": "connect", "token": self.token, "port": port})
        sock = await self._connect_socket()
        loop = asyncio.get_running_loop()
        idle = self.liveness.idle_timeout
        try:
            with self._mapped("connect"):
                await loop.sock_sendall(sock, request)
                try:  # the agent answers a connect at once: no heartbeats, which would corrupt the pipe
                    async with asyncio.timeout(idle):
                        kind, payload = await sock_read_frame(sock)
                except TimeoutError:
                    raise silent_agent(self.label, "connect", idle or 0, self._details) from None
                if kind == protocol.ERROR:
                    err = protocol.decode_json(payload)
                    details = {**(err.get("details") or {}), "port": port}
                    raise error_from_code(str(err.get("code")), str(err.get("message")), details)
                event = protocol.decode_json(payload) if kind == protocol.EVENT else {}
                if event.get("event") != "connected":
                    raise protocol.ProtocolError(f"expected the 'connected' event, got frame kind {kind}")
        except BaseException:
            sock.close()
            raise
        return sock
