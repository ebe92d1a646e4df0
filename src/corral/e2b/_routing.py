"""`E2BMiddleware`: E2B's API at the root of Corral's own port, beside /v1.

Data plane first: a request with an `E2b-Sandbox-Id` header (port from `E2b-Sandbox-Port`, default envd's 49983),
or for a `<port>-<sandbox id>.<domain>` host, is for a sandbox: port 49983 is envd (served here), 49999 the code
interpreter (served here), and any other port goes on to Corral's port relay as the `<port>-<id>.<domain>` host it
means (docs/ports.md). A signed `/files` URL names its sandbox by its signature. Then the control plane: E2B's REST
paths (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates`). Everything else (/v1, port hosts) goes on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from ..service import Service
from . import _control
from ._config import E2BConfig
from ._envd import ENVD_PORT, envd_app
from ._files import SANDBOX_SCOPE_KEY
from ._filesystem import FILESYSTEM_RPCS
from ._front import Front
from ._interpreter import INTERPRETER_PORT, interpreter_app
from ._process import PROCESS_RPCS
from ._rpc import Rpc

__all__ = ["ENVD_RPCS", "E2BMiddleware"]

ENVD_RPCS: Mapping[str, Rpc] = {**PROCESS_RPCS, **FILESYSTEM_RPCS}

_LABEL = re.compile(r"([1-9][0-9]{0,4})-(sb-[a-z0-9][a-z0-9-]*)")


class E2BMiddleware:
    def __init__(self, app: ASGIApp, service: Service, config: E2BConfig | None = None,
                 rpcs: Mapping[str, Rpc] | None = None) -> None:
        self.app = app
        self.service = service
        front = Front(service, config or E2BConfig())
        self.control = Starlette(routes=_control.routes())
        self.control.state.front = front
        self.envd = envd_app(front, rpcs if rpcs is not None else ENVD_RPCS)
        self.interpreter = interpreter_app(front)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        target = self._target(scope)
        if target is not None:
            await self._data_plane(scope, receive, send, target)
        elif scope["type"] == "http" and scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
            await self.envd(scope, receive, send)
        elif scope["type"] == "http" and scope["path"].startswith(_control.CONTROL_PREFIXES):
            await self.control(scope, receive, send)
        else:
            await self.app(_with_traffic_token(scope), receive, send)

    async def _data_plane(self, scope: Scope, receive: Receive, send: Send, target: tuple[str, int]) -> None:
        sandbox_id, port = target
        if port in (ENVD_PORT, INTERPRETER_PORT) and scope["type"] == "http":
            scope = {**scope, SANDBOX_SCOPE_KEY: sandbox_id}
            await (self.envd if port == ENVD_PORT else self.interpreter)(scope, receive, send)
            return
        # Another port: Corral's port relay serves it, as the host that names it.
        host = f"{port}-{sandbox_id}.{self.service.ports.domain}".encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"host"]
        await self.app(_with_traffic_token({**scope, "headers": [(b"host", host), *headers]}), receive, send)

    def _target(self, scope: Scope) -> tuple[str, int] | None:
        """(sandbox id, port) of a data-plane request, else None."""
        sandbox_id = port = None
        for key, value in scope["headers"]:
            if key == b"e2b-sandbox-id":
                sandbox_id = value.decode("latin-1").strip()
            elif key == b"e2b-sandbox-port":
                port = value.decode("latin-1").strip()
        if sandbox_id is not None:
            number = int(port) if port and port.isdigit() and 0 < int(port) < 65536 else ENVD_PORT
            return sandbox_id[:128], number  # an id of no sandbox is refused by the credentials check
        return self._host_target(scope)

    def _host_target(self, scope: Scope) -> tuple[str, int] | None:
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        label, _, rest = host.lower().partition(".")
        match = _LABEL.fullmatch(label)
        domain = rest.rpartition(":")[0] if ":" in rest else rest
        if match is None or domain != self.service.ports.domain:
            return None
        port = int(match.group(1))
        return (match.group(2), port) if port in (ENVD_PORT, INTERPRETER_PORT) else None


def _with_traffic_token(scope: Scope) -> Scope:
    """E2B's SDKs send a sandbox's ports its traffic token in `E2B-Traffic-Access-Token`; Corral's port relay takes
    a sandbox's tokens as Bearer credentials. The app's own `Authorization` header, if any, is left alone."""
    token = next((v for k, v in scope["headers"] if k == b"e2b-traffic-access-token"), None)
    if token is None or any(k == b"authorization" for k, _ in scope["headers"]):
        return scope
    headers = [(k, v) for k, v in scope["headers"] if k != b"e2b-traffic-access-token"]
    return {**scope, "headers": [*headers, (b"authorization", b"Bearer " + token)]}
