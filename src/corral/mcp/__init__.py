"""MCP (the Model Context Protocol) served by Corral (docs/mcp.md): an agent's MCP client gets Corral's sandboxes
as tools.

```python
front = MCPFront(service)                 # `/mcp` on `corral serve`: streamable HTTP, `Authorization: Bearer`
async with front.run():                   # in the server's lifespan
    ...                                   # requests to /mcp go to `front` (an ASGI app)
```

A thin adapter over the service layer, like the E2B front: each tool is one service call with the principal of
the request's API key, so tenancy, roles, quotas, the egress policy and the audit trail are exactly those of
/v1. `corral mcp` (stdio, for one user) is a relay to this endpoint (`corral.cli._mcp`): the tools exist once.
"""

from ._http import MAX_BODY, MCPFront
from ._tools import MAX_OUTPUT, MAX_READ, TOOLS, Tool

__all__ = ["MAX_BODY", "MAX_OUTPUT", "MAX_READ", "TOOLS", "MCPFront", "Tool"]
