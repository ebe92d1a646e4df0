"""What every tool is made of: `Tool` (its name, its description for the model, its arguments' model and its one
function) and `Call` (who calls it, and where its progress goes). A leaf of the MCP package, so that the tool
modules (`_tools.py`, `_checkpoints.py`) build on it without importing each other."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import mcp_types as types
from pydantic import BaseModel

from ..control import Principal
from ..service import Service
from ._progress import Progress

__all__ = ["CHANGES", "DESTROYS", "READ_ONLY", "RUNS", "Call", "Tool"]

Args = TypeVar("Args", bound=BaseModel)

READ_ONLY = types.ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGES = types.ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTROYS = types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                                 open_world_hint=False)
RUNS = types.ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=True)


@dataclass(frozen=True)
class Call:
    """One tool call: who makes it (the principal of its API key) and where its progress goes."""

    service: Service
    principal: Principal
    progress: Progress


@dataclass(frozen=True)
class Tool(Generic[Args]):
    name: str
    description: str
    args: type[Args]
    run: Callable[[Call, Args], Awaitable[types.CallToolResult]]
    annotations: types.ToolAnnotations

    def listing(self) -> types.Tool:
        return types.Tool(name=self.name, description=self.description, input_schema=self.args.model_json_schema(),
                          annotations=self.annotations)
