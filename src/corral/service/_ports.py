"""A sandbox's ports from outside (`sb.get_host(port)`, docs/ports.md): who may reach them, the connection to
the port through the agent, and one audit record per HTTP request or WebSocket (`sandbox.port`).

Who may: the owning tenant's keys (any role that may exec in the sandbox), the sandbox's own access tokens (a
Bearer credential that stands for the key that created it: E2B's SDKs send its traffic token), or anybody when the
sandbox was created with `public_ports=True`. Another tenant's key, or a sandbox that does not exist, is
`NotFoundError`; no key (or a refused one) on a sandbox that is not public is `AuthenticationError`, recorded as
`auth.denied` like any other 401, and said the same way whether the sandbox exists or not, so ids cannot be
probed without a key. A public sandbox's ports never look at the caller's credentials: the `Authorization`
header may be the app's own.

The front end carries the bytes (HTTP or WebSocket over `connection.socket`, a raw pipe to the port) and closes
the connection when the exchange ends, saying how; that writes the one record.

```python
connection = await service.ports.open(key, client, PortRequest("sb-...", 8000, "http", "GET", "/"))
try:
    ...                                               # relay over connection.socket
finally:
    await connection.close(200, disconnected=False)   # the status answered; `error=` for a failure
```
"""

from __future__ import annotations

import asyncio
import re
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .._exceptions import AuthenticationError, CorralError, InvalidRequestError, NotFoundError, ServerError
from ..control import Action, AuditEvent, ControlStore, Principal, parse_key, require_sandbox
from ._access import TokenPurpose
from ._auto_resume import PORT_REASON, AutoResume
from ._outcome import outcome_of

if TYPE_CHECKING:
    from ._access import SandboxAccess
    from ._callers import Callers, ClientInfo
    from ._on_sandbox import Sessions

__all__ = ["DEFAULT_DOMAIN", "PORT_ACTION", "PortConnection", "PortRequest", "Ports", "check_domain"]

DEFAULT_DOMAIN = "localhost"
PORT_ACTION = "sandbox.port"  # the audit action of a request (or WebSocket) to a sandbox's port
_MAX_TEXT = 512  # the client's own text (the path) is capped in the record
_KNOWN_MAX = 4096  # sandboxes whose owner and port policy are kept in memory
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def check_domain(domain: str) -> str:
    """The domain under which sandboxes' ports are served (`corral serve --domain`), normalised (lower case, no
    trailing dot); `InvalidRequestError` unless it is a DNS name."""
    name = domain.strip().lower().removesuffix(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        raise InvalidRequestError(f"domain {domain!r} is not a DNS name (letters, digits and '-' in dot-separated "
                                  "labels, e.g. 'localhost' or 'sandboxes.example.com')")
    return name


@dataclass(frozen=True)
class PortRequest:
    """One request (or WebSocket) a client sends to a sandbox's port: what the audit record keeps of it."""

    sandbox_id: str
    port: int
    kind: Literal["http", "websocket"]
    method: str
    path: str

    def audit_params(self) -> dict[str, Any]:
        return {"port": self.port, "kind": self.kind, "method": self.method[:_MAX_TEXT],
                "path": self.path[:_MAX_TEXT]}


@dataclass
class _Record:
    """The one audit record of a port request: written once, by whoever ends it first."""

    store: ControlStore
    tenant_id: str | None
    key_id: str | None
    role: str | None
    request: PortRequest
    client: str | None
    public: bool
    _written: bool = False

    async def write(self, outcome: dict[str, Any]) -> None:
        if self._written:
            return
        self._written = True
        params = {**self.request.audit_params(), "client": self.client, "public": self.public}
        event = AuditEvent(action=PORT_ACTION, target=self.request.sandbox_id, tenant_id=self.tenant_id,
                           key_id=self.key_id, role=self.role, params=params, outcome=outcome)
        await asyncio.shield(self.store.audit.append(event))  # a client that leaves must not lose the record


@dataclass
class PortConnection:
    """An open connection to a sandbox's port. `socket` is a connected, non-blocking raw pipe to the port;
    `forwards_authorization` tells whether the caller's `Authorization` header may go on to the sandbox (only on
    a public sandbox, and never when it carries a Corral key). Add to `outcome` while relaying."""

    socket: socket.socket
    forwards_authorization: bool
    _record: _Record
    outcome: dict[str, Any] = field(default_factory=dict)

    async def close(self, status: int, *, error: BaseException | None = None, disconnected: bool = False) -> None:
        """Close the socket and record how the exchange ended: `status` as the front end answered it, the error
        code of a failure after that, or `disconnected` if the client left first. Idempotent."""
        self.socket.close()
        outcome: dict[str, Any] = {"status": status, **self.outcome}
        if error is not None:
            outcome["error"] = error.code if isinstance(error, CorralError) else ServerError.code
        if disconnected:
            outcome["disconnected"] = True
        await self._record.write(outcome)


class Ports:
    def __init__(self, store: ControlStore, sessions: Sessions, callers: Callers, access: SandboxAccess,
                 auto_resume: AutoResume, domain: str = DEFAULT_DOMAIN) -> None:
        self._store = store
        self._auto_resume = auto_resume  # a paused `auto_resume` sandbox is woken by a request to its port
        self._sessions = sessions
        self._callers = callers  # API keys
        self._access = access  # the sandbox's own tokens
        self.domain = check_domain(domain)
        # sandbox id -> (tenant id, public ports, auto-resume), oldest first
        self._known: dict[str, tuple[str, bool, bool]] = {}

    async def open(self, key: str | None, client: ClientInfo, request: PortRequest) -> PortConnection:
        """Authorize the caller (the Bearer `key`, if any) for the sandbox's port and connect to it.

        `AuthenticationError` (401) without a valid key on a sandbox that is not public; `NotFoundError` (404)
        for another tenant's sandbox or one that does not exist; `ConflictError` (409) for a paused one;
        `AgentError` (502) naming the port when nothing listens there. A paused sandbox created with
        `auto_resume` is resumed first (`AutoResume`). Each refusal past authentication is recorded, as the
        connection is when it closes."""
        owner, public, waking = await self._owner(request.sandbox_id)
        principal = None
        if public:
            audit = _Record(self._store, owner, None, None, request, client.client, public=True)
        else:
            principal = await self._caller(key, client, request.sandbox_id)
            audit = _Record(self._store, principal.tenant_id, principal.key_id, principal.role.value, request,
                            client.client, public=False)
        try:
            if principal is not None:
                require_sandbox(principal, Action.SANDBOX_EXEC, request.sandbox_id, owner)
            if waking:
                record = await self._store.get_sandbox(request.sandbox_id)
                await self._auto_resume.awake(record, principal, PORT_REASON)
            sock = await self._sessions.get(request.sandbox_id).open_port(request.port)
        except BaseException as exc:
            if isinstance(exc, CorralError):
                exc.details.setdefault("sandbox_id", request.sandbox_id)
                exc.details.setdefault("port", request.port)
            left = isinstance(exc, asyncio.CancelledError)  # the client went while the port was being opened
            await audit.write({"disconnected": True} if left else outcome_of(exc, 0, {}))
            raise
        return PortConnection(sock, principal is None and not _is_corral_key(key), audit)

    async def _caller(self, credential: str | None, client: ClientInfo, sandbox_id: str) -> Principal:
        """An API key, or one of the sandbox's own access tokens (its ports token, as E2B's SDKs send it)."""
        if credential is not None and not _is_corral_key(credential):
            return await self._access.authenticate(sandbox_id, credential, client,
                                                   purposes=(TokenPurpose.PORTS, TokenPurpose.SANDBOX))
        return await self._callers.authenticate(credential, client)

    async def _owner(self, sandbox_id: str) -> tuple[str | None, bool, bool]:
        """The sandbox's tenant (None: no such live sandbox), whether its ports are public and whether it resumes
        on a request (`auto_resume`).

        All are fixed for a sandbox's life and ids are never reused, so what was found is kept (a sandbox that
        ended since is refused by the engine, which knows only live ones); what was not found is asked again."""
        known = self._known.get(sandbox_id)
        if known is not None:
            return known
        try:
            record = await self._store.get_sandbox(sandbox_id)
        except NotFoundError:
            return None, False, False
        if not record.live:
            return None, False, False
        if len(self._known) >= _KNOWN_MAX:
            del self._known[next(iter(self._known))]
        self._known[sandbox_id] = found = (record.tenant_id, record.spec.public_ports, record.spec.auto_resume)
        return found


def _is_corral_key(key: str | None) -> bool:
    if key is None:
        return False
    try:
        parse_key(key)
    except AuthenticationError:
        return False
    return True
