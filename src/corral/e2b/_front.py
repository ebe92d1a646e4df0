"""What every E2B route needs: the service and the E2B settings of this deployment, errors as E2B's bodies, and
request bodies checked (a refused body is audited like on /v1)."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import pydantic
from starlette.requests import Request
from starlette.responses import Response

from .._exceptions import CorralError, InvalidRequestError
from ..control import Principal
from ..service import Service
from ._auth import client_info
from ._config import E2BConfig
from ._errors import corral_error, unexpected_error

__all__ = ["Front", "body_of", "e2b_endpoint", "front_of", "server_domain"]

Model = TypeVar("Model", bound=pydantic.BaseModel)
Endpoint = Callable[[Request], Awaitable[Response]]
_MAX_BODY = 1024 * 1024  # a control-plane body is a few hundred bytes; this bounds what is read


@dataclass(frozen=True)
class Front:
    service: Service
    config: E2BConfig


def front_of(request: Request) -> Front:
    front: Front = request.app.state.front
    return front


def e2b_endpoint(handler: Endpoint) -> Endpoint:
    """Corral errors answered as E2B's `{"code", "message"}`; anything unexpected as a 500 without internals."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except CorralError as exc:
            return corral_error(exc)
        except Exception as exc:
            return unexpected_error(exc)

    return endpoint


async def body_of(request: Request, model: type[Model], principal: Principal, *, optional: bool = False) -> Model:
    """The request's JSON body as `model`; a refusal is `InvalidRequestError` naming every problem, audited as
    `request.invalid`. `optional`: an empty body is the model's defaults."""
    raw = await _read(request)
    try:
        data = json.loads(raw) if raw.strip() else ({} if optional else None)
        return model.model_validate(data)
    except (ValueError, RecursionError, pydantic.ValidationError) as exc:  # Recursion: nested too deep
        problems = _problems(exc)
        svc = front_of(request).service
        target = request.path_params.get("sandbox_id")
        await svc.record_invalid(principal, client_info(request), route=request.url.path,
                                 target=target if isinstance(target, str) else None, problems=problems)
        raise InvalidRequestError("invalid request: " + "; ".join(f"{p['where']}: {p['message']}" for p in problems),
                                  details={"errors": problems}) from None


async def _read(request: Request) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > _MAX_BODY:
            raise InvalidRequestError(f"request body larger than {_MAX_BODY} bytes")
    return bytes(data)


def _problems(exc: Exception) -> list[dict[str, str]]:
    if isinstance(exc, pydantic.ValidationError):
        return [{"where": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]} for e in exc.errors()]
    return [{"where": "body", "message": f"not valid JSON: {exc}"}]


def server_domain(request: Request, domain: str) -> str:
    """The `domain` E2B's SDKs build port hosts from (`<port>-<sandbox id>.<domain>`): Corral's port domain
    (`corral serve --domain`) and the port this request came in on, so `get_host` names this server."""
    host = request.headers.get("host", "")
    _, colon, port = host.rpartition(":")
    return f"{domain}:{port}" if colon and port.isdigit() and "]" not in port else domain
