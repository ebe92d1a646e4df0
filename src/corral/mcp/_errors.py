"""The one place errors become tool results: a failing call is a tool error (`isError`) whose text names the
error, says what happened and what to do about it, so the model that called it can correct itself. Nothing a
caller sends turns into a protocol error or a crash.

```
CorralError            -> "<code>: <message>" and a fix for its code (and `{"error": {code, message, details}}`)
invalid arguments      -> "invalid_request: invalid arguments for <tool>: <field>: <problem>; ..."
anything else          -> "server_error: ..." without internals (the traceback goes to the server's log)
```
"""

from __future__ import annotations

import logging
from typing import Any

import mcp_types as types
import pydantic

from .._exceptions import CorralError, InvalidRequestError, ServerError

__all__ = ["argument_problems", "invalid_arguments", "tool_error", "unexpected_error"]

logger = logging.getLogger("corral.mcp")

# What to do next, by error code: the message says what went wrong, this says how a model gets on with its task.
_FIXES: dict[str, str] = {
    "not_found": "list_sandboxes shows the sandboxes this API key can use; list_files shows what a directory "
                 "holds; list_checkpoints shows a sandbox's checkpoints",
    "permission_denied": "use a path the sandbox user may use: under /workspace, /home/user or /tmp",
    "invalid_request": "correct the arguments as the message says and call the tool again",
    "conflict": "the sandbox is not in a state for this (paused, say); create a new one with create_sandbox",
    "quota_exceeded": "kill sandboxes you no longer need (list_sandboxes, kill_sandbox) and try again",
    "capacity_exceeded": "the server is full: wait a little, or kill sandboxes you no longer need",
    "disk_full": "the sandbox's disk is full: remove files (run_command \"rm ...\") or create a new sandbox",
    "sandbox_timeout": "the sandbox reached its timeout and is gone: create a new one (create_sandbox) with a "
                       "longer timeout",
    "unauthenticated": "the API key is missing or was revoked: configure a valid CORRAL_API_KEY",
    "replica_unavailable": "the server that runs this sandbox does not answer: try again shortly",
}
_ROLE_FIX = ("this API key's role may not do this (developers create and use sandboxes, auditors only read the "
             "audit log): configure a developer's key")
_DEFAULT_FIX = "this is Corral's failure, not the call's: try again, and tell the operator if it persists"
_OTHER_FIX = "change what the message names and call the tool again"


def tool_error(exc: CorralError) -> types.CallToolResult:
    text = f"{exc.code}: {exc.message}\nWhat to do: {_fix(exc)}."
    return _error(text, exc.to_dict())


def _fix(exc: CorralError) -> str:
    if exc.code == "permission_denied" and "role" in exc.details:  # the role's refusal, not a file's
        return _ROLE_FIX
    return _FIXES.get(exc.code, _DEFAULT_FIX if isinstance(exc, ServerError) else _OTHER_FIX)


def invalid_arguments(tool: str, problems: list[dict[str, str]]) -> types.CallToolResult:
    listed = "; ".join(f"{p['where']}: {p['message']}" for p in problems)
    exc = InvalidRequestError(f"invalid arguments for {tool}: {listed}", details={"errors": problems})
    return tool_error(exc)


def unexpected_error(tool: str, exc: BaseException) -> types.CallToolResult:
    logger.error("MCP tool %s failed", tool, exc_info=exc)  # the details stay on the server
    return tool_error(ServerError(f"{tool} failed inside Corral ({type(exc).__name__}); the server's log has "
                                  "the details"))


def argument_problems(exc: pydantic.ValidationError) -> list[dict[str, str]]:
    """Each problem with where it is ("timeout", "network.1") and what is wrong, as the REST API lists them."""
    return [{"where": ".".join(str(p) for p in e["loc"]) or "arguments", "message": e["msg"]} for e in exc.errors()]


def _error(text: str, error: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content={"error": error},
                                is_error=True)
