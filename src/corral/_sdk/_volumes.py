"""`Volume` and `AsyncVolume`: a tenant's storage on the server, with a hard size limit, that outlives sandboxes
and is mounted by name (docs/volumes.md).

```python
vol = Volume.create("data", size="1G")                          # Volume(id, name, size, created_at)
with Sandbox.create(volumes={"/mnt/data": "data"}) as sb:       # mounted read-write, owned by the sandbox user
    sb.commands.run("echo hi > /mnt/data/a.txt")
Volume.list(); Volume.get("data").used; vol.delete()            # delete: refused while a sandbox mounts it
```

Several sandboxes may mount one volume at once (they see each other's writes at once: it is one filesystem);
writing past its size fails inside with ENOSPC. Each call opens its own connection.
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

__all__ = ["AsyncVolume", "Volume"]


def _path(name: str) -> str:
    return "/v1/volumes/" + quote(name, safe="")


def _create_body(name: str, size: int | str) -> dict[str, Any]:
    if not isinstance(name, str):
        raise TypeError("a volume's name is a string")
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise TypeError("size is a byte count or a string like '1G'")
    return {"name": name, "size": size}


def _fields(data: Any) -> dict[str, Any]:
    d = json_dict(data, "a volume")
    try:
        used = d.get("used")
        return {"id": str(d["id"]), "name": str(d["name"]), "size": int(d["size"]),
                "created_at": d.get("created_at"), "used": None if used is None else int(used)}
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(f"malformed response from Corral: bad volume ({type(exc).__name__}: {exc})") from exc


def _volumes(data: Any) -> builtins.list[Any]:
    items = json_dict(data, "a list of volumes").get("volumes", [])
    if not isinstance(items, builtins.list):
        raise ServerError("malformed response from Corral: 'volumes' is not a list")
    return items


@dataclass(frozen=True)
class _VolumeBase:
    id: str
    name: str
    size: int  # bytes: the hard limit
    created_at: str | None
    used: int | None = None  # `get` only: bytes the volume's files take now
    _config: ConnectionConfig | None = field(default=None, repr=False, compare=False)

    def _require_config(self) -> ConnectionConfig:
        if self._config is None:
            raise ServerError("this Volume was not made by the SDK: get it with Volume.get()")
        return self._config


@dataclass(frozen=True)
class Volume(_VolumeBase):
    """A volume on the server (see the module docstring)."""

    _transport: httpx.BaseTransport | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, name: str, size: int | str = "1G", *, api_key: str | None = None, base_url: str | None = None,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
               transport: httpx.BaseTransport | None = None) -> Volume:
        """A new empty volume: `name` 1 to 63 lowercase letters, digits, '-' or '_' (unique in the tenant);
        `size` from 16M to 1T (`"1G"`, `"512M"` or bytes), a hard limit."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = _request(config, transport, "POST", "/v1/volumes", json=_create_body(name, size))
        return cls(**_fields(data), _config=config, _transport=transport)

    @classmethod
    def list(cls, *, api_key: str | None = None, base_url: str | None = None,
             request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
             transport: httpx.BaseTransport | None = None) -> builtins.list[Volume]:
        """The caller's tenant's volumes, by name."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = _request(config, transport, "GET", "/v1/volumes")
        return [cls(**_fields(v), _config=config, _transport=transport) for v in _volumes(data)]

    @classmethod
    def get(cls, name: str, *, api_key: str | None = None, base_url: str | None = None,
            request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
            transport: httpx.BaseTransport | None = None) -> Volume:
        """The tenant's volume of this name, with `used` filled in (`NotFoundError` if the tenant has none)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        return cls(**_fields(_request(config, transport, "GET", _path(name))), _config=config, _transport=transport)

    def delete(self) -> None:
        """Delete the volume and its files; `ConflictError` (naming them) while a sandbox mounts it."""
        _request(self._require_config(), self._transport, "DELETE", _path(self.name))


@dataclass(frozen=True)
class AsyncVolume(_VolumeBase):
    """`Volume` with awaited methods."""

    _transport: httpx.AsyncBaseTransport | None = field(default=None, repr=False, compare=False)

    @classmethod
    async def create(cls, name: str, size: int | str = "1G", *, api_key: str | None = None,
                     base_url: str | None = None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                     max_retries: int = DEFAULT_MAX_RETRIES,
                     transport: httpx.AsyncBaseTransport | None = None) -> AsyncVolume:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = await _arequest(config, transport, "POST", "/v1/volumes", json=_create_body(name, size))
        return cls(**_fields(data), _config=config, _transport=transport)

    @classmethod
    async def list(cls, *, api_key: str | None = None, base_url: str | None = None,
                   request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                   transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[AsyncVolume]:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = await _arequest(config, transport, "GET", "/v1/volumes")
        return [cls(**_fields(v), _config=config, _transport=transport) for v in _volumes(data)]

    @classmethod
    async def get(cls, name: str, *, api_key: str | None = None, base_url: str | None = None,
                  request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                  transport: httpx.AsyncBaseTransport | None = None) -> AsyncVolume:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = await _arequest(config, transport, "GET", _path(name))
        return cls(**_fields(data), _config=config, _transport=transport)

    async def delete(self) -> None:
        await _arequest(self._require_config(), self._transport, "DELETE", _path(self.name))


def _request(config: ConnectionConfig, transport: httpx.BaseTransport | None, method: str, path: str,
             **kwargs: Any) -> Any:
    client = SyncClient(config, transport)
    try:
        return client.request(method, path, **kwargs)
    finally:
        client.close()


async def _arequest(config: ConnectionConfig, transport: httpx.AsyncBaseTransport | None, method: str, path: str,
                    **kwargs: Any) -> Any:
    client = AsyncClient(config, transport)
    try:
        return await client.request(method, path, **kwargs)
    finally:
        await client.close()
