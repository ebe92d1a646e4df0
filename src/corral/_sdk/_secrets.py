"""`Secret` and `AsyncSecret`: a tenant's stored secrets on the server (docs/secrets.md). An operator stores a value
once; sandboxes ask for it by name, and hold only a placeholder that the egress proxy replaces in requests to the
secret's hosts. No call returns a value.

```python
Secret.put("github", os.environ["GITHUB_TOKEN"], hosts=["api.github.com"])   # an operator's key
with Sandbox.create(network=["api.github.com"], secrets={"GITHUB_TOKEN": {"stored": "github"}}) as sb:
    sb.commands.run('curl -H "Authorization: Bearer $GITHUB_TOKEN" https://api.github.com/user')
Secret.list()                                                                  # names and hosts only
```
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from .._exceptions import ServerError
from ._config import DEFAULT_MAX_RETRIES, DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._transport import json_dict
from ._volumes import _arequest, _request

__all__ = ["AsyncSecret", "Secret"]


def _path(name: str) -> str:
    return "/v1/secrets/" + quote(name, safe="")


def _put_body(value: str, hosts: Sequence[str], body: bool) -> dict[str, Any]:
    if not isinstance(value, str):
        raise TypeError("a secret's value is a string")
    if isinstance(hosts, str):
        raise TypeError("hosts is a list of host names, not one string")
    return {"value": value, "hosts": builtins.list(hosts), "body": body}


def _fields(data: Any) -> dict[str, Any]:
    d = json_dict(data, "a secret")
    try:
        return {"name": str(d["name"]), "hosts": tuple(str(h) for h in d["hosts"]), "body": bool(d["body"]),
                "created_at": d.get("created_at"), "updated_at": d.get("updated_at")}
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(f"malformed response from Corral: bad secret ({type(exc).__name__}: {exc})") from exc


def _secrets(data: Any) -> builtins.list[Any]:
    items = json_dict(data, "a list of secrets").get("secrets", [])
    if not isinstance(items, builtins.list):
        raise ServerError("malformed response from Corral: 'secrets' is not a list")
    return items


@dataclass(frozen=True)
class _SecretBase:
    name: str
    hosts: tuple[str, ...]
    body: bool
    created_at: str | None
    updated_at: str | None
    _config: ConnectionConfig | None = field(default=None, repr=False, compare=False)

    def _require_config(self) -> ConnectionConfig:
        if self._config is None:
            raise ServerError("this Secret was not made by the SDK: get it with Secret.list()")
        return self._config


@dataclass(frozen=True)
class Secret(_SecretBase):
    """A stored secret's name and hosts (see the module docstring); never its value."""

    _transport: httpx.BaseTransport | None = field(default=None, repr=False, compare=False)

    @classmethod
    def put(cls, name: str, value: str, *, hosts: Sequence[str], body: bool = False, api_key: str | None = None,
            base_url: str | None = None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
            max_retries: int = DEFAULT_MAX_RETRIES, transport: httpx.BaseTransport | None = None) -> Secret:
        """Store (or replace) the tenant's secret `name` (an environment variable name), bound to `hosts`
        (`*.example.com` for subdomains); `body=True` also puts it into request bodies. Operators and admins."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = _request(config, transport, "PUT", _path(name), json=_put_body(value, hosts, body))
        return cls(**_fields(data), _config=config, _transport=transport)

    @classmethod
    def list(cls, *, api_key: str | None = None, base_url: str | None = None,
             request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
             transport: httpx.BaseTransport | None = None) -> builtins.list[Secret]:
        """The caller's tenant's stored secrets, by name."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = _request(config, transport, "GET", "/v1/secrets")
        return [cls(**_fields(s), _config=config, _transport=transport) for s in _secrets(data)]

    def delete(self) -> None:
        """Forget the stored secret; sandboxes made with it keep theirs."""
        _request(self._require_config(), self._transport, "DELETE", _path(self.name))


@dataclass(frozen=True)
class AsyncSecret(_SecretBase):
    """`Secret` with awaited methods."""

    _transport: httpx.AsyncBaseTransport | None = field(default=None, repr=False, compare=False)

    @classmethod
    async def put(cls, name: str, value: str, *, hosts: Sequence[str], body: bool = False,
                  api_key: str | None = None, base_url: str | None = None,
                  request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                  transport: httpx.AsyncBaseTransport | None = None) -> AsyncSecret:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = await _arequest(config, transport, "PUT", _path(name), json=_put_body(value, hosts, body))
        return cls(**_fields(data), _config=config, _transport=transport)

    @classmethod
    async def list(cls, *, api_key: str | None = None, base_url: str | None = None,
                   request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                   transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[AsyncSecret]:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        data = await _arequest(config, transport, "GET", "/v1/secrets")
        return [cls(**_fields(s), _config=config, _transport=transport) for s in _secrets(data)]

    async def delete(self) -> None:
        await _arequest(self._require_config(), self._transport, "DELETE", _path(self.name))
