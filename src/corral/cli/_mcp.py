"""`corral mcp`: Corral's tools for one user's MCP client (Claude Desktop, Cursor, ...) over stdio.

It is a relay, not a second implementation: tool listings and calls go, one for one, to the server's `/mcp`
(`$CORRAL_URL/mcp`, the key of `$CORRAL_API_KEY` as a bearer token), and their results, errors and progress come
back as they are. So the tools exist once, in the server's `corral.mcp`, next to the service they call, and
tenancy, roles, quotas and audit are the server's; this process holds no state and no server code (the `mcp`
extra: the official SDK, and the SDK's client).

Each relayed request is its own MCP connection to the server (over pooled HTTP connections; `/mcp` is stateless,
so one costs no extra round trip once the server's protocol is known): a server that restarts, or that was down
when the client started, costs the calls made meanwhile and nothing after, and each failure is answered where it
happened, as a tool error naming the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from .. import __version__
from .._exceptions import AuthenticationError
from ._common import ApiKeyOption, UrlOption, config

__all__ = ["Upstream", "mcp_command", "relay_server"]

# Reads wait longer than any call may run (the tools' timeouts stop at an hour): the server ends calls, not us.
_TIMEOUT = httpx2.Timeout(30.0, read=2 * 3600.0)


def mcp_command(url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """Serve Corral's sandbox tools to an MCP client over stdio (a relay to the server's /mcp)."""
    settings = config(url, api_key)
    if not settings.api_key:
        raise AuthenticationError("no API key: set CORRAL_API_KEY (in the MCP client's env for this server)")
    anyio.run(serve_stdio, Upstream(f"{settings.base_url}/mcp", settings.api_key))


async def serve_stdio(upstream: Upstream) -> None:
    server = relay_server(upstream)
    async with upstream, stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


class Upstream:
    """The server's `/mcp`, called with the key: one HTTP client (its connections pooled) for the relay's life,
    one MCP connection per use. The server's discovery answer is kept from the first use, so that later ones
    skip the probe (a round trip); a server of the handshake era is probed every time."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url = url
        self._http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=_TIMEOUT)
        self._discovered: types.DiscoverResult | None = None
        self._version = "auto"

    async def __aenter__(self) -> Upstream:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._http.__aexit__(*exc_info)

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Client]:
        transport = streamable_http_client(self.url, http_client=self._http)
        async with Client(transport, mode=self._version, prior_discover=self._discovered) as client:
            if self._discovered is None and client.session.discover_result is not None:
                self._discovered, self._version = client.session.discover_result, client.protocol_version
            yield client

    def problem(self, exc: BaseException) -> str:
        """What went wrong reaching the server, and what to do about it."""
        exc = _cause(exc)
        if isinstance(exc, MCPError):  # the server's own answer: a 401 names the key
            return f"Corral at {self.url} refused the request: {exc.error.message}"
        return (f"cannot reach Corral at {self.url} ({type(exc).__name__}: {exc}): start `corral serve` there, or "
                "set CORRAL_URL to the server's address")


def relay_server(upstream: Upstream) -> Server[Any]:
    async def list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None,
                         ) -> types.ListToolsResult:
        try:
            async with upstream.connect() as client:
                return await client.list_tools()
        except Exception as exc:  # no tool to answer with an error result: the listing itself fails
            raise MCPError(types.INTERNAL_ERROR, upstream.problem(exc)) from None

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            async with upstream.connect() as client:
                return await client.call_tool(params.name, params.arguments,
                                              progress_callback=ctx.session.report_progress)
        except Exception as exc:
            return types.CallToolResult(content=[types.TextContent(text=upstream.problem(exc))], is_error=True)

    return Server("corral", version=__version__, title="Corral sandboxes (relay)", on_list_tools=list_tools,
                  on_call_tool=call_tool)


def _cause(exc: BaseException) -> BaseException:
    """The one error inside the task groups' exception groups that carried it out."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
