"""`Admin` and `AsyncAdmin`: tenants, API keys, the audit trail and the operator kill switch (docs/api.md).

```python
with Admin() as admin:                                   # $CORRAL_URL, $CORRAL_API_KEY (an admin's key)
    admin.tenants.create("acme")
    new = admin.keys.create("acme", role="developer")    # new.key is shown this once
    admin.audit.verify(head="120:ab12...").ok            # a head exported earlier catches deleted newest records
    for record in admin.audit.follow(action="sandbox.create"): ...
    admin.kill_all(tenant="acme").killed
```

Each twin is a thin I/O loop; what they share without I/O (request parameters, response parsing, the models)
is written once at module level. Operators and auditors use the same class for what their role allows (audit,
and for operators the kill switch in their own tenant); the server decides, the SDK does not pre-check roles.
"""

from __future__ import annotations

import builtins
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, Protocol, Self
from urllib.parse import quote

import httpx

from .._exceptions import ServerError
from ._config import DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._transport import AsyncClient, SyncClient, json_dict

__all__ = [
    "Admin",
    "AsyncAdmin",
    "AsyncAudit",
    "AsyncKeys",
    "AsyncTenants",
    "Audit",
    "AuditProblem",
    "AuditRecord",
    "AuditVerification",
    "KeyInfo",
    "Keys",
    "KillResult",
    "NewKey",
    "TenantInfo",
    "Tenants",
]

Quota = int | float | None


class SupportsWriteStr(Protocol):
    def write(self, text: str, /) -> object: ...


# -- what calls return ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    """A response missing a field, or with one of the wrong type, is the server's fault: a `ServerError`."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(f"malformed response from Corral: bad {what} ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class TenantInfo:
    """A tenant; `quotas` maps each limit (`max_sandboxes`, `max_memory_bytes`, ...) to its value, None = none.
    `required_runtime` is the runtime all its sandboxes run on whatever is asked (`"runsc"`), None: any."""

    id: str
    name: str
    disabled: bool = False
    created_at: str | None = None
    quotas: dict[str, Quota] = field(default_factory=dict)
    required_runtime: str | None = None

    @classmethod
    def from_wire(cls, data: Any) -> TenantInfo:
        d = json_dict(data, "a tenant")
        with _malformed("tenant"):
            info = cls(id=str(d["id"]), name=str(d["name"]), disabled=bool(d.get("disabled")),
                       created_at=d.get("created_at"), quotas=dict(d.get("quotas") or {}),
                       required_runtime=d.get("required_runtime"))
        return info


@dataclass(frozen=True)
class KeyInfo:
    """An API key's record (the secret is never stored, so never listed)."""

    id: str
    tenant_id: str
    role: str
    tenant: str | None = None
    name: str = ""
    prefix: str = ""
    created_at: str | None = None
    revoked_at: str | None = None
    last_used_at: str | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_wire(cls, data: Any) -> KeyInfo:
        d = json_dict(data, "a key")
        with _malformed("key"):
            info = cls(id=str(d["id"]), tenant_id=str(d.get("tenant_id") or ""), role=str(d.get("role") or ""),
                       tenant=d.get("tenant"), name=str(d.get("name") or ""), prefix=str(d.get("prefix") or ""),
                       created_at=d.get("created_at"), revoked_at=d.get("revoked_at"),
                       last_used_at=d.get("last_used_at"))
        return info


@dataclass(frozen=True)
class NewKey:
    """A key just created: `key` is the only time its secret is available (kept out of `repr`)."""

    id: str
    tenant: str
    role: str
    key: str = field(repr=False)

    @classmethod
    def from_wire(cls, data: Any) -> NewKey:
        d = json_dict(data, "a new key")
        with _malformed("new key"):
            new = cls(id=str(d["id"]), tenant=str(d.get("tenant") or ""), role=str(d.get("role") or ""),
                      key=str(d["key"]))
        return new


@dataclass(frozen=True)
class AuditRecord:
    """One record of the hash-chained audit trail, as the server stores it."""

    seq: int
    time: str
    action: str
    tenant_id: str | None = None
    key_id: str | None = None
    role: str | None = None
    target: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    prev_hash: str = ""
    hash: str = ""
    request_id: str | None = None  # the HTTP request that caused it (its `X-Request-Id`), if one did

    @classmethod
    def from_wire(cls, data: Any) -> AuditRecord:
        d = json_dict(data, "an audit record")
        with _malformed("audit record"):
            record = cls(seq=int(d["seq"]), time=str(d["time"]), action=str(d["action"]),
                         tenant_id=d.get("tenant_id"), key_id=d.get("key_id"), role=d.get("role"),
                         target=d.get("target"), params=dict(d.get("params") or {}),
                         outcome=dict(d.get("outcome") or {}), prev_hash=str(d.get("prev_hash") or ""),
                         hash=str(d.get("hash") or ""), request_id=d.get("request_id"))
        return record

    def to_dict(self) -> dict[str, Any]:
        """The record as the server sent it (a request id only where it has one: the hash covers it only then)."""
        out = {"seq": self.seq, "time": self.time, "tenant_id": self.tenant_id, "key_id": self.key_id,
               "role": self.role, "action": self.action, "target": self.target, "params": self.params,
               "outcome": self.outcome, "prev_hash": self.prev_hash, "hash": self.hash}
        if self.request_id is not None:
            out["request_id"] = self.request_id
        return out


@dataclass(frozen=True)
class AuditProblem:
    """The first thing wrong with the chain: record `seq` was `kind` ("edited", "inserted", "deleted", or
    "unknown-key": signed with an audit key the verifier does not hold)."""

    seq: int
    kind: str
    message: str


@dataclass(frozen=True)
class AuditVerification:
    """`ok`, how many records were `checked`, the last good `head` (`<seq>:<hash>`) and the `problem` if any. Of
    the records checked, `unkeyed` predate audit keys (plain SHA-256) and `unchecked` were keyed but checked only
    for their links (verified without their key)."""

    ok: bool
    checked: int
    head: str
    problem: AuditProblem | None = None
    unkeyed: int = 0
    unchecked: int = 0

    @classmethod
    def from_wire(cls, data: Any) -> AuditVerification:
        d = json_dict(data, "an audit verification")
        raw = d.get("problem")
        with _malformed("audit verification"):
            problem = None
            if isinstance(raw, dict):
                problem = AuditProblem(seq=int(raw.get("seq") or 0), kind=str(raw.get("kind") or ""),
                                       message=str(raw.get("message") or ""))
            result = cls(ok=bool(d.get("ok")), checked=int(d.get("checked") or 0), head=str(d.get("head") or ""),
                         problem=problem, unkeyed=int(d.get("unkeyed") or 0), unchecked=int(d.get("unchecked") or 0))
        return result


@dataclass(frozen=True)
class KillResult:
    """What the kill switch stopped (`killed`), what the runtime failed to stop (`failed`: id -> reason), and
    whether the key was revoked."""

    killed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    revoked: bool = False

    @classmethod
    def from_wire(cls, data: Any) -> KillResult:
        d = json_dict(data, "a kill switch result")
        with _malformed("kill switch result"):
            result = cls(killed=[str(s) for s in d.get("killed") or []], failed=dict(d.get("failed") or {}),
                         revoked=bool(d.get("revoked")))
        return result


# -- request building, shared by the twins ----------------------------------------------------------------------


def _tenant_path(name_or_id: str) -> str:
    return f"/v1/tenants/{quote(name_or_id, safe='')}"


# The SDK's and CLI's word for "no required runtime" (null on the wire): None already means "leave it".
ANY_RUNTIME = "any"


def _tenant_create(name: str, required_runtime: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name}
    if required_runtime is not None and required_runtime != ANY_RUNTIME:
        body["required_runtime"] = required_runtime
    return body


def _tenant_patch(quotas: Mapping[str, Quota] | None, disabled: bool | None,
                  required_runtime: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if quotas is not None:
        body["quotas"] = dict(quotas)
    if disabled is not None:
        body["disabled"] = disabled
    if required_runtime is not None:
        body["required_runtime"] = None if required_runtime == ANY_RUNTIME else required_runtime
    return body


def _egress_body(ceiling: str | Sequence[str] | None, private: Sequence[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if ceiling is not None:
        body["ceiling"] = ceiling if isinstance(ceiling, str) else list(ceiling)
    if private is not None:
        body["private"] = list(private)
    return body


def _grants_path(name_or_id: str, destination: str | None = None) -> str:
    path = _tenant_path(name_or_id) + "/egress/grants"
    return path if destination is None else f"{path}/{quote(destination, safe='')}"


def _grants(data: Any) -> builtins.list[dict[str, Any]]:
    with _malformed("grants"):
        return [dict(g) for g in json_dict(data, "grants")["grants"]]


def _filters(tenant: str | None, sandbox: str | None, action: str | None, since: datetime | str | None,
             until: datetime | str | None, key: str | None = None) -> dict[str, str]:
    """Query parameters of the audit calls; only the filters given (a datetime should be aware)."""
    raw = {"tenant": tenant, "sandbox": sandbox, "action": action, "since": since, "until": until, "key": key}
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in raw.items() if v is not None}


def _kill_body(tenant: str | None, key: str | None, revoke: bool) -> dict[str, Any]:
    if (tenant is None) == (key is None):
        raise ValueError("kill_all takes exactly one of tenant= or key=")
    body: dict[str, Any] = {"tenant": tenant} if tenant is not None else {"key": key}
    if revoke:
        body["revoke"] = True
    return body


def _records(data: Any) -> list[AuditRecord]:
    return [AuditRecord.from_wire(r) for r in json_dict(data, "audit records").get("records", [])]


def _head(data: Any) -> str:
    d = json_dict(data, "the audit head")
    with _malformed("audit head"):
        head = f"{int(d['seq'])}:{d['hash']}"
    return head


def _follow_line(line: str) -> AuditRecord | None:
    """A record from one NDJSON line of a follow stream; None for the empty keep-alive lines."""
    if not line.strip():
        return None
    try:
        return AuditRecord.from_wire(json.loads(line))
    except ValueError as exc:
        raise ServerError("malformed response from Corral: an audit stream line is not JSON") from exc


def _stream_timeout(config: ConnectionConfig) -> httpx.Timeout:
    """A follow stream is silent between records (keep-alives come every 15 s): never time out a read."""
    return httpx.Timeout(config.request_timeout, read=None)


# -- sync -------------------------------------------------------------------------------------------------------


class Tenants:
    """`admin.tenants`: create, list and update tenants (admin)."""

    def __init__(self, client: SyncClient) -> None:
        self._client = client

    def create(self, name: str, *, required_runtime: str | None = None) -> TenantInfo:
        """A new tenant; `required_runtime="runsc"` runs all its sandboxes on gVisor whatever they ask for."""
        body = _tenant_create(name, required_runtime)
        return TenantInfo.from_wire(self._client.request("POST", "/v1/tenants", json=body))

    def list(self) -> builtins.list[TenantInfo]:
        data = json_dict(self._client.request("GET", "/v1/tenants"), "tenants")
        return [TenantInfo.from_wire(t) for t in data.get("tenants", [])]

    def update(self, name_or_id: str, *, quotas: Mapping[str, Quota] | None = None,
               disabled: bool | None = None, required_runtime: str | None = None) -> TenantInfo:
        """Change some quotas (a limit left out keeps its value, None removes it) and/or disable the tenant.
        `required_runtime`: `"runsc"` runs all its sandboxes on gVisor whatever they ask for, `"any"` drops the
        requirement, None leaves it as it is."""
        body = _tenant_patch(quotas, disabled, required_runtime)
        return TenantInfo.from_wire(self._client.request("PATCH", _tenant_path(name_or_id), json=body))

    def set_egress(self, name_or_id: str, *, ceiling: str | Sequence[str] | None = None,
                   private: Sequence[str] | None = None) -> dict[str, Any]:
        """The tenant's egress ceiling (admin) and/or exact private `ip:port` pairs (docs/egress.md)."""
        body = _egress_body(ceiling, private)
        return json_dict(self._client.request("PUT", _tenant_path(name_or_id) + "/egress", json=body), "egress")

    def grants(self, name_or_id: str) -> builtins.list[dict[str, Any]]:
        """The private destinations granted to the tenant (`destination`, `granted_at`, `key_id`; docs/egress.md):
        what its operators may switch on with `private`."""
        return _grants(self._client.request("GET", _grants_path(name_or_id)))

    def grant_private(self, name_or_id: str, destination: str) -> builtins.list[dict[str, Any]]:
        """Grant the tenant a private `ip:port` (admin); never one of the control plane's own services."""
        body = {"destination": destination}
        return _grants(self._client.request("POST", _grants_path(name_or_id), json=body))

    def revoke_private(self, name_or_id: str, destination: str) -> builtins.list[dict[str, Any]]:
        """Take a grant back (admin): the tenant's sandboxes lose the destination at once."""
        return _grants(self._client.request("DELETE", _grants_path(name_or_id, destination)))


class Keys:
    """`admin.keys`: create, list and revoke API keys (admin)."""

    def __init__(self, client: SyncClient) -> None:
        self._client = client

    def create(self, tenant: str, role: str = "developer", *, name: str = "") -> NewKey:
        body = {"tenant": tenant, "role": role, "name": name}
        return NewKey.from_wire(self._client.request("POST", "/v1/keys", json=body))

    def list(self, tenant: str | None = None) -> builtins.list[KeyInfo]:
        params = {"tenant": tenant} if tenant else {}
        data = json_dict(self._client.request("GET", "/v1/keys", params=params), "keys")
        return [KeyInfo.from_wire(k) for k in data.get("keys", [])]

    def revoke(self, key_id: str) -> None:
        self._client.request("DELETE", f"/v1/keys/{quote(key_id, safe='')}")


class Audit:
    """`admin.audit`: query, verify, export and follow the audit trail (auditor, operator, admin)."""

    def __init__(self, client: SyncClient) -> None:
        self._client = client

    def query(self, *, tenant: str | None = None, sandbox: str | None = None, action: str | None = None,
              since: datetime | str | None = None, until: datetime | str | None = None,
              limit: int = 1000, key: str | None = None,
              order: Literal["asc", "desc"] = "asc") -> builtins.list[AuditRecord]:
        """The first `limit` matching records, oldest first (`order="desc"`: the last `limit`, newest first);
        `key` a key id (the records made with it)."""
        params = {**_filters(tenant, sandbox, action, since, until, key), "limit": str(limit), "order": order}
        return _records(self._client.request("GET", "/v1/audit", params=params))

    def verify(self, head: str | None = None) -> AuditVerification:
        """Walk the whole chain; `head` (`<seq>:<hash>`, exported earlier) also catches deleted newest records."""
        params = {"head": head} if head else {}
        return AuditVerification.from_wire(self._client.request("GET", "/v1/audit/verify", params=params))

    def head(self) -> str:
        """The newest record as `<seq>:<hash>`: keep it somewhere the database's owner cannot write."""
        return _head(self._client.request("GET", "/v1/audit/head"))

    def export(self, out: SupportsWriteStr, *, tenant: str | None = None, sandbox: str | None = None,
               action: str | None = None, since: datetime | str | None = None,
               until: datetime | str | None = None, key: str | None = None) -> int:
        """Write matching records to `out` as JSONL, exactly as the server sent them; return how many."""
        count = 0
        params = _filters(tenant, sandbox, action, since, until, key)
        with self._client.stream("GET", "/v1/audit/export", params=params) as response:
            for line in response.iter_lines():
                if line:
                    out.write(line + "\n")
                    count += 1
        return count

    def follow(self, *, after: int | None = None, tenant: str | None = None, sandbox: str | None = None,
               action: str | None = None, key: str | None = None) -> Iterator[AuditRecord]:
        """New records as they are appended (after seq `after`, default from now), until the iterator is closed."""
        params = _filters(tenant, sandbox, action, None, None, key) | ({} if after is None else {"after": str(after)})
        timeout = _stream_timeout(self._client.config)
        with self._client.stream("GET", "/v1/audit/follow", params=params, timeout=timeout) as response:
            for line in response.iter_lines():
                if (record := _follow_line(line)) is not None:
                    yield record


class Admin:
    """Tenants, keys, the audit trail and the kill switch of a Corral server.

    **Parameters:** `api_key` (default `$CORRAL_API_KEY`), `base_url` (default `$CORRAL_URL`), `request_timeout`
    (seconds for one HTTP exchange), `transport` (an httpx transport, for tests). Close it, or use `with`.
    """

    def __init__(self, *, api_key: str | None = None, base_url: str | None = None,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                 transport: httpx.BaseTransport | None = None) -> None:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        self._client = SyncClient(config, transport)
        self.tenants = Tenants(self._client)
        self.keys = Keys(self._client)
        self.audit = Audit(self._client)

    def kill_all(self, *, tenant: str | None = None, key: str | None = None, revoke: bool = False) -> KillResult:
        """The kill switch: destroy every sandbox of `tenant` (name or id) or of API key `key` (an id), and with
        `revoke` revoke that key first. Operators act in their own tenant, admins anywhere."""
        body = _kill_body(tenant, key, revoke)
        return KillResult.from_wire(self._client.request("POST", "/v1/kill", json=body))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# -- async ------------------------------------------------------------------------------------------------------


class AsyncTenants:
    """`admin.tenants` of an `AsyncAdmin`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, name: str, *, required_runtime: str | None = None) -> TenantInfo:
        body = _tenant_create(name, required_runtime)
        return TenantInfo.from_wire(await self._client.request("POST", "/v1/tenants", json=body))

    async def list(self) -> builtins.list[TenantInfo]:
        data = json_dict(await self._client.request("GET", "/v1/tenants"), "tenants")
        return [TenantInfo.from_wire(t) for t in data.get("tenants", [])]

    async def update(self, name_or_id: str, *, quotas: Mapping[str, Quota] | None = None,
                     disabled: bool | None = None, required_runtime: str | None = None) -> TenantInfo:
        body = _tenant_patch(quotas, disabled, required_runtime)
        return TenantInfo.from_wire(await self._client.request("PATCH", _tenant_path(name_or_id), json=body))

    async def set_egress(self, name_or_id: str, *, ceiling: str | Sequence[str] | None = None,
                         private: Sequence[str] | None = None) -> dict[str, Any]:
        body = _egress_body(ceiling, private)
        data = await self._client.request("PUT", _tenant_path(name_or_id) + "/egress", json=body)
        return json_dict(data, "egress")

    async def grants(self, name_or_id: str) -> builtins.list[dict[str, Any]]:
        return _grants(await self._client.request("GET", _grants_path(name_or_id)))

    async def grant_private(self, name_or_id: str, destination: str) -> builtins.list[dict[str, Any]]:
        body = {"destination": destination}
        return _grants(await self._client.request("POST", _grants_path(name_or_id), json=body))

    async def revoke_private(self, name_or_id: str, destination: str) -> builtins.list[dict[str, Any]]:
        return _grants(await self._client.request("DELETE", _grants_path(name_or_id, destination)))


class AsyncKeys:
    """`admin.keys` of an `AsyncAdmin`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, tenant: str, role: str = "developer", *, name: str = "") -> NewKey:
        body = {"tenant": tenant, "role": role, "name": name}
        return NewKey.from_wire(await self._client.request("POST", "/v1/keys", json=body))

    async def list(self, tenant: str | None = None) -> builtins.list[KeyInfo]:
        params = {"tenant": tenant} if tenant else {}
        data = json_dict(await self._client.request("GET", "/v1/keys", params=params), "keys")
        return [KeyInfo.from_wire(k) for k in data.get("keys", [])]

    async def revoke(self, key_id: str) -> None:
        await self._client.request("DELETE", f"/v1/keys/{quote(key_id, safe='')}")


class AsyncAudit:
    """`admin.audit` of an `AsyncAdmin`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def query(self, *, tenant: str | None = None, sandbox: str | None = None, action: str | None = None,
                    since: datetime | str | None = None, until: datetime | str | None = None,
                    limit: int = 1000, key: str | None = None,
                    order: Literal["asc", "desc"] = "asc") -> builtins.list[AuditRecord]:
        params = {**_filters(tenant, sandbox, action, since, until, key), "limit": str(limit), "order": order}
        return _records(await self._client.request("GET", "/v1/audit", params=params))

    async def verify(self, head: str | None = None) -> AuditVerification:
        params = {"head": head} if head else {}
        return AuditVerification.from_wire(await self._client.request("GET", "/v1/audit/verify", params=params))

    async def head(self) -> str:
        return _head(await self._client.request("GET", "/v1/audit/head"))

    async def export(self, out: SupportsWriteStr, *, tenant: str | None = None, sandbox: str | None = None,
                     action: str | None = None, since: datetime | str | None = None,
                     until: datetime | str | None = None, key: str | None = None) -> int:
        count = 0
        params = _filters(tenant, sandbox, action, since, until, key)
        async with self._client.stream("GET", "/v1/audit/export", params=params) as response:
            async for line in response.aiter_lines():
                if line:
                    out.write(line + "\n")
                    count += 1
        return count

    async def follow(self, *, after: int | None = None, tenant: str | None = None, sandbox: str | None = None,
                     action: str | None = None, key: str | None = None) -> AsyncIterator[AuditRecord]:
        params = _filters(tenant, sandbox, action, None, None, key) | ({} if after is None else {"after": str(after)})
        timeout = _stream_timeout(self._client.config)
        async with self._client.stream("GET", "/v1/audit/follow", params=params, timeout=timeout) as response:
            async for line in response.aiter_lines():
                if (record := _follow_line(line)) is not None:
                    yield record


class AsyncAdmin:
    """`Admin`, awaited: `async with AsyncAdmin() as admin: await admin.tenants.create("acme")`."""

    def __init__(self, *, api_key: str | None = None, base_url: str | None = None,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        self._client = AsyncClient(config, transport)
        self.tenants = AsyncTenants(self._client)
        self.keys = AsyncKeys(self._client)
        self.audit = AsyncAudit(self._client)

    async def kill_all(self, *, tenant: str | None = None, key: str | None = None,
                       revoke: bool = False) -> KillResult:
        body = _kill_body(tenant, key, revoke)
        return KillResult.from_wire(await self._client.request("POST", "/v1/kill", json=body))

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
