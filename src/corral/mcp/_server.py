"""`mcp_server(service)`: the MCP server (the official SDK's low-level `Server`) whose tools call the service.

Every call runs as the principal its HTTP request authenticated as (`_http.py` puts it in the request's scope),
so the key's tenant and role apply to every tool exactly as on the REST API. The call's arguments are checked
against the tool's model (a refusal is audited as `request.invalid`, like a refused REST body), then the tool
runs; whatever goes wrong becomes a tool error (`_errors.py`), never a protocol error.
"""

from __future__ import annotations

from typing import Any

import mcp_types as types
import pydantic
from mcp.server import Server, ServerRequestContext

from .. import __version__
from .._exceptions import CorralError
from ..control import Principal
from ..service import ClientInfo, Service
from ._errors import argument_problems, invalid_arguments, tool_error, unexpected_error
from ._progress import Progress
from ._tools import TOOLS, Call, tool_named

__all__ = ["PRINCIPAL_SCOPE_KEY", "mcp_server"]

PRINCIPAL_SCOPE_KEY = "corral.principal"  # the ASGI scope's entry that carries the caller to the tools
INSTRUCTIONS = ("Corral runs code in isolated Linux sandboxes. Create one with create_sandbox, use its sandbox_id "
                "with run_command, run_code, write_file, read_file and list_files, and kill_sandbox it when done. "
                "Sandboxes have no network unless created with one. Before a risky step take a checkpoint; if a "
                "step destroys files, restore the checkpoint from before it (list_checkpoints, list_changes): "
                "in-place recovery is possible.")


def mcp_server(service: Service) -> Server[Any]:
    async def list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None,
                         ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool.listing() for tool in TOOLS])

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            return await _call(service, ctx, params)
        except CorralError as exc:
            return tool_error(exc)
        except Exception as exc:
            return unexpected_error(params.name, exc)

    return Server("corral", version=__version__, title="Corral sandboxes", instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


async def _call(service: Service, ctx: ServerRequestContext[Any],
                params: types.CallToolRequestParams) -> types.CallToolResult:
    principal = _principal(ctx)
    tool = tool_named(params.name)
    try:
        args = tool.args.model_validate(params.arguments or {})
    except pydantic.ValidationError as exc:
        problems = argument_problems(exc)
        target = (params.arguments or {}).get("sandbox_id")
        await service.record_invalid(principal, _client(ctx), route=f"mcp:{tool.name}",
                                     target=target if isinstance(target, str) else None, problems=problems)
        return invalid_arguments(tool.name, problems)
    return await tool.run(Call(service, principal, Progress(ctx.session.report_progress)), args)


def _principal(ctx: ServerRequestContext[Any]) -> Principal:
    scope = getattr(ctx.request, "scope", None)
    principal = scope.get(PRINCIPAL_SCOPE_KEY) if isinstance(scope, dict) else None
    if not isinstance(principal, Principal):  # only an app that skipped `_http.py`'s check gets here
        raise RuntimeError("an MCP call reached the tools without an authenticated principal")
    return principal


def _client(ctx: ServerRequestContext[Any]) -> ClientInfo:
    client = getattr(ctx.request, "client", None)
    return ClientInfo(getattr(client, "host", None), "POST", "/mcp")
