"""`Snapshot` and `AsyncSnapshot`: a sandbox's filesystem kept on the server, which starts sandboxes like a template.

```python
snap = sb.snapshot(name="deps-installed")       # Snapshot(id, name, size, created_at)
with Sandbox.create(template=snap.id) as child:   # starts with the snapshot's files
    ...
Snapshot.list(); Snapshot.get("deps-installed"); snap.delete()
```

A snapshot outlives the sandbox it was taken of; deleting it leaves sandboxes started from it running. Each call
opens its own connection (a snapshot is often used long after the sandbox that made it was killed).
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from .._exceptions import ServerError
from ._config import DEFAULT_MAX_RETRIES, DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._transport import AsyncClient, SyncClient, json_dict

__all__ = ["AsyncSnapshot", "Snapshot"]


def _path(snapshot: str) -> str:
    return "/v1/snapshots/" + quote(snapshot, safe="")


@dataclass(frozen=True)
class _SnapshotBase:
    id: str
    name: str | None
    size: int  # bytes of files the snapshot holds (what the tenant's snapshot quota counts)
    created_at: str | None
    sandbox_id: str | None = None  # the sandbox it was taken of
    template: str | None = None  # that sandbox's template
    _config: ConnectionConfig | None = field(default=None, repr=False, compare=False)

    @classmethod
    def _parse(cls, data: Any, config: ConnectionConfig) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ServerError("malformed response from Corral: expected a snapshot object with an 'id'")
        return cls(id=data["id"], name=data.get("name"), size=int(data.get("size") or 0),
                   created_at=data.get("created_at"), sandbox_id=data.get("sandbox_id"),
                   template=data.get("template"), _config=config)

    def _require_config(self) -> ConnectionConfig:
        if self._config is None:
            raise ServerError("this Snapshot was not made by the SDK: get it with Snapshot.get()")
        return self._config


@dataclass(frozen=True)
class Snapshot(_SnapshotBase):
    """A snapshot on the server (see the module docstring)."""

    @classmethod
    def list(cls, *, api_key: str | None = None, base_url: str | None = None,
             request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
             transport: httpx.BaseTransport | None = None) -> builtins.list[Snapshot]:
        """The caller's tenant's snapshots, oldest first."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = json_dict(_request(config, transport, "GET", "/v1/snapshots"), "a list")
        return [cls._parse(s, config) for s in data.get("snapshots", [])]

    @classmethod
    def get(cls, snapshot: str, *, api_key: str | None = None, base_url: str | None = None,
            request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
            transport: httpx.BaseTransport | None = None) -> Snapshot:
        """The snapshot with this id or name (`NotFoundError` if the tenant has none)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        return cls._parse(_request(config, transport, "GET", _path(snapshot)), config)  # type: ignore[no-any-return]

    def delete(self) -> None:
        """Remove the snapshot; sandboxes started from it keep running."""
        _request(self._require_config(), None, "DELETE", _path(self.id))


@dataclass(frozen=True)
class AsyncSnapshot(_SnapshotBase):
    """`Snapshot` with awaited methods."""

    @classmethod
    async def list(cls, *, api_key: str | None = None, base_url: str | None = None,
                   request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                   transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[AsyncSnapshot]:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = json_dict(await _arequest(config, transport, "GET", "/v1/snapshots"), "a list")
        return [cls._parse(s, config) for s in data.get("snapshots", [])]

    @classmethod
    async def get(cls, snapshot: str, *, api_key: str | None = None, base_url: str | None = None,
                  request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                  transport: httpx.AsyncBaseTransport | None = None) -> AsyncSnapshot:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        return cls._parse(await _arequest(config, transport, "GET", _path(snapshot)), config)  # type: ignore[no-any-return]

    async def delete(self) -> None:
        await _arequest(self._require_config(), None, "DELETE", _path(self.id))


def _request(config: ConnectionConfig, transport: httpx.BaseTransport | None, method: str, path: str) -> Any:
    client = SyncClient(config, transport)
    try:
        return client.request(method, path)
    finally:
        client.close()


async def _arequest(config: ConnectionConfig, transport: httpx.AsyncBaseTransport | None, method: str,
                    path: str) -> Any:
    client = AsyncClient(config, transport)
    try:
        return await client.request(method, path)
    finally:
        await client.close()
