"""Who is calling the E2B API, from the headers E2B's SDKs send.

Control plane: `X-API-KEY: <key>` (or `Authorization: Bearer <key>`), a Corral API key. Data plane: the SDKs never
send the API key there; they send the sandbox's `X-Access-Token` (the `envdAccessToken` of the create response)
to envd, and `E2B-Traffic-Access-Token` (the `trafficAccessToken`) to the code interpreter's port. Both are
Corral sandbox access tokens (`corral.service.SandboxAccess`): a call with one runs as the key that created the
sandbox. Corral hands both tokens out for every sandbox, whether or not the client asked for `secure`, so a
sandbox's data plane is never open to whoever learns its id. A Corral API key is accepted on the data plane too.
"""

from __future__ import annotations

from starlette.requests import Request

from .._exceptions import AuthenticationError
from ..control import Principal
from ..service import ClientInfo, Service, TokenPurpose

__all__ = ["ACCESS_TOKEN_HEADER", "TRAFFIC_TOKEN_HEADER", "api_key", "caller", "client_info", "sandbox_caller"]

ACCESS_TOKEN_HEADER = "x-access-token"  # noqa: S105 - a header name, not a secret
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"  # noqa: S105 - a header name


def client_info(request: Request) -> ClientInfo:
    return ClientInfo(request.client.host if request.client else None, request.method, request.url.path)


def api_key(request: Request) -> str | None:
    """The API key of `X-API-KEY`, else of `Authorization: Bearer` (E2B's deprecated access-token form)."""
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


async def caller(svc: Service, request: Request) -> Principal:
    """The control plane's caller; `AuthenticationError` (401, recorded) without a valid key."""
    key = api_key(request)
    if key is None:
        exc = AuthenticationError("missing API key: send 'X-API-KEY: <key>' (E2B_API_KEY set to a Corral key)")
        await svc.record_denial(client_info(request), exc, None)
        raise exc
    return await svc.authenticate(key, client_info(request))


async def sandbox_caller(svc: Service, request: Request, sandbox_id: str, *, ports: bool = False) -> Principal:
    """The data plane's caller on `sandbox_id`: its access token, or (`ports`) its traffic token, or an API key."""
    token = request.headers.get(ACCESS_TOKEN_HEADER)
    purposes: tuple[TokenPurpose, ...] = (TokenPurpose.SANDBOX,)
    if not token and ports:
        token, purposes = request.headers.get(TRAFFIC_TOKEN_HEADER), (TokenPurpose.PORTS,)
    if not token and (key := api_key(request)) is not None:
        return await svc.authenticate(key, client_info(request))
    if ports:
        purposes = (TokenPurpose.SANDBOX, TokenPurpose.PORTS)
    return await svc.access.authenticate(sandbox_id, token, client_info(request), purposes=purposes)
