"""E2B's control plane (`E2B_API_URL`): sandboxes' lifecycle, listing, snapshots and fork, as E2B's REST API.

Each route authenticates the `X-API-KEY`, checks its body, calls one service method and renders E2B's JSON; the
service authorizes, audits and orchestrates exactly as for /v1. Sandboxes made here get E2B's defaults where
Corral's differ: every path the sandbox user can reach is open to the file API (E2B's envd allows it), the
network is "internet" unless the request or the tenant's ceiling says less (`_network`), root is there (commands
and files as `root`, and `sudo`, as in E2B's sandboxes; docs/security.md) where the backend can give it unless
the deployment says otherwise, and the template names `base` and `code-interpreter-v1` mean the deployment's
configured templates (`_config`).
"""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._exceptions import ConflictError, InvalidRequestError, NotFoundError
from ..control import Principal, SandboxQuery
from ..engine import SandboxState
from ..service import CreateSandbox, ForkSandbox
from ._auth import caller
from ._front import body_of, e2b_endpoint, front_of, server_domain
from ._models import (
    ConnectRequest,
    ForkRequest,
    NetworkConfig,
    NewSandbox,
    PauseRequest,
    RefreshRequest,
    ResumeRequest,
    SnapshotRequest,
    TimeoutRequest,
)
from ._network import egress_policy
from ._views import detail_json, listed_json, metric_json, sandbox_json, snapshot_json

__all__ = ["CONTROL_PREFIXES", "routes"]

CONTROL_PREFIXES = ("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates")
_STATES = {"running": SandboxState.RUNNING, "paused": SandboxState.PAUSED}
_MAX_PAGE = 100
_E2B_FILE_ROOTS = ["/"]  # envd serves any path the user can reach; the agent still refuses what it cannot


# -- lifecycle -------------------------------------------------------------------------------------------------


@e2b_endpoint
async def create(request: Request) -> Response:
    front = front_of(request)
    svc = front.service
    principal = await caller(svc, request)
    body = await body_of(request, NewSandbox, principal)
    record = await svc.sandboxes.create(principal, await _create_request(request, principal, body))
    return JSONResponse(_sandbox(request, record, body.template_id), status_code=201)


async def _create_request(request: Request, principal: Principal, body: NewSandbox) -> CreateSandbox:
    svc = front_of(request).service
    if body.iam:
        raise InvalidRequestError("iam tokens are not supported by Corral: sandboxes get no cloud identity")
    network = body.network or NetworkConfig.model_validate({})
    _check_network_extras(network)
    policy = egress_policy(body.allow_internet_access, network.allow_out, network.deny_out,
                           await svc.sandboxes.egress_limits(principal))
    volumes = {mount.path: mount.name for mount in body.volume_mounts or ()}
    on_timeout = "kill"
    if body.auto_pause:
        on_timeout = "pause" if body.auto_pause_memory is False else "pause_memory"
    config = front_of(request).config
    return CreateSandbox(template=config.template(body.template_id), timeout=body.timeout,
                         network=policy, env=body.env_vars or {}, metadata=body.metadata or {},
                         file_roots=_E2B_FILE_ROOTS, on_timeout=on_timeout,  # type: ignore[arg-type]
                         auto_resume=body.auto_resume is not None and body.auto_resume.enabled,
                         volumes=volumes, public_ports=bool(network.allow_public_traffic),
                         root=config.root and svc.info.root)


def _check_network_extras(network: NetworkConfig) -> None:
    if network.egress_proxy:
        raise InvalidRequestError("network.egressProxy is not supported: a Corral sandbox's traffic always leaves "
                                  "through Corral's egress proxy, which applies the tenant's policy")
    if network.rules:
        raise InvalidRequestError("network.rules (request transforms) are not supported by Corral")
    if network.mask_request_host:
        raise InvalidRequestError("network.maskRequestHost is not supported by Corral")


@e2b_endpoint
async def get_sandbox(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    record = await svc.sandboxes.get(principal, request.path_params["sandbox_id"])
    front = front_of(request)
    return JSONResponse(detail_json(record, front.config, svc.access, _domain(request)))


@e2b_endpoint
async def kill(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    await svc.sandboxes.kill(principal, request.path_params["sandbox_id"])
    return Response(status_code=204)


@e2b_endpoint
async def set_timeout(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, TimeoutRequest, principal)
    await svc.sandboxes.set_timeout(principal, request.path_params["sandbox_id"], body.timeout)
    return Response(status_code=204)


@e2b_endpoint
async def refresh(request: Request) -> Response:
    """Keep a sandbox alive at least `duration` more seconds (E2B's keep-alive; never shortens it)."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, RefreshRequest, principal, optional=True)
    await svc.sandboxes.connect(principal, request.path_params["sandbox_id"], body.duration or None,
                                resume=False)
    return Response(status_code=204)


@e2b_endpoint
async def pause(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, PauseRequest, principal, optional=True)
    sandbox_id = request.path_params["sandbox_id"]
    record = await svc.sandboxes.get(principal, sandbox_id)
    if record.state is SandboxState.PAUSED:
        raise ConflictError(f"sandbox {sandbox_id} is already paused")
    await svc.sandboxes.pause(principal, sandbox_id, memory=body.memory)
    return Response(status_code=204)


@e2b_endpoint
async def resume(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, ResumeRequest, principal, optional=True)
    sandbox_id = request.path_params["sandbox_id"]
    if (await svc.sandboxes.get(principal, sandbox_id)).state is not SandboxState.PAUSED:
        raise ConflictError(f"sandbox {sandbox_id} is not paused")
    record, _ = await svc.sandboxes.connect(principal, sandbox_id, body.timeout or None)
    return JSONResponse(_sandbox(request, record), status_code=201)


@e2b_endpoint
async def connect(request: Request) -> Response:
    """Running: 200, its end only ever moved later; paused: resumed, 201."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, ConnectRequest, principal, optional=True)
    record, resumed = await svc.sandboxes.connect(principal, request.path_params["sandbox_id"], body.timeout)
    return JSONResponse(_sandbox(request, record), status_code=201 if resumed else 200)


@e2b_endpoint
async def set_network(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, NetworkConfig, principal)
    _check_network_extras(body)
    if body.allow_public_traffic is not None:
        raise InvalidRequestError("allowPublicTraffic is fixed when a Corral sandbox is created")
    egress = await svc.sandboxes.egress_limits(principal)
    policy = egress_policy(None, body.allow_out, body.deny_out, egress) if body.allow_out or body.deny_out \
        else egress_policy(True, None, None, egress)
    await svc.sandboxes.set_network(principal, request.path_params["sandbox_id"], policy)
    return Response(status_code=204)


# -- listing ---------------------------------------------------------------------------------------------------


@e2b_endpoint
async def list_v1(request: Request) -> Response:
    """`GET /sandboxes`: the running ones, with E2B's `metadata` filter."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    query = SandboxQuery(metadata=_metadata_filter(request), states=frozenset({SandboxState.RUNNING}))
    page = await svc.sandboxes.page(principal, query)
    return JSONResponse([listed_json(r, front_of(request).config) for r in page.records])


@e2b_endpoint
async def list_v2(request: Request) -> Response:
    """`GET /v2/sandboxes`: filters, newest first (or `order=asc`), pages of `limit` with `X-Next-Token`."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    params = request.query_params
    query = SandboxQuery(metadata=_metadata_filter(request), states=_states(params.get("state")),
                         template=params.get("template") or None,
                         created_after=_time(params.get("startedAfter"), "startedAfter"),
                         newest_first=_order(params.get("order")), limit=_limit(params.get("limit")))
    page = await svc.sandboxes.page(principal, query, params.get("nextToken") or None)
    headers = {"X-Next-Token": page.next_cursor} if page.next_cursor else {}
    return JSONResponse([listed_json(r, front_of(request).config) for r in page.records], headers=headers)


def _metadata_filter(request: Request) -> dict[str, str]:
    """E2B sends the filter as one urlencoded `k=v&k2=v2` value whose keys and values are quoted once more."""
    raw = request.query_params.get("metadata")
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InvalidRequestError(f"metadata filter {raw[:200]!r} is not 'key=value&key2=value2'") from None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _states(raw: str | None) -> frozenset[SandboxState] | None:
    if not raw:
        return None
    names = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [name for name in names if name not in _STATES]
    if unknown:
        raise InvalidRequestError(f"unknown sandbox state {unknown[0]!r}: use running or paused")
    return frozenset(_STATES[name] for name in names)


def _time(raw: str | None, name: str) -> datetime | None:
    if not raw:
        return None
    try:
        at = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequestError(f"{name} {raw[:64]!r} is not an RFC 3339 time") from None
    if at.tzinfo is None:
        raise InvalidRequestError(f"{name} {raw[:64]!r} has no time zone")
    return at


def _order(raw: str | None) -> bool:
    if raw in (None, "", "desc"):
        return True
    if raw == "asc":
        return False
    raise InvalidRequestError(f"order {raw!r} is not 'asc' or 'desc'")


def _limit(raw: str | None) -> int:
    if not raw:
        return _MAX_PAGE
    if not raw.isdigit() or not 1 <= int(raw) <= _MAX_PAGE:
        raise InvalidRequestError(f"limit {raw[:20]!r} is not a number from 1 to {_MAX_PAGE}")
    return int(raw)


@e2b_endpoint
async def metrics(request: Request) -> Response:
    """Samples of the sandbox's CPU, memory and disk (every 5 s, the last hour) within `start`..`end` (unix s)."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    params = request.query_params
    found = await svc.sandboxes.metrics(principal, request.path_params["sandbox_id"],
                                        _unix(params.get("start"), "start"), _unix(params.get("end"), "end"))
    return JSONResponse([metric_json(m) for m in found])


def _unix(raw: str | None, name: str) -> datetime | None:
    if raw is None or raw == "":
        return None
    try:
        return datetime.fromtimestamp(int(raw), UTC)
    except (ValueError, OverflowError, OSError):
        raise InvalidRequestError(f"{name} {raw[:32]!r} is not a Unix time in seconds") from None


# -- snapshots, fork, templates --------------------------------------------------------------------------------


@e2b_endpoint
async def fork(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, ForkRequest, principal, optional=True)
    children = await svc.sandboxes.fork(principal, request.path_params["sandbox_id"],
                                        ForkSandbox(timeout=body.timeout, count=body.count))
    return JSONResponse([{"sandbox": _sandbox(request, child)} for child in children], status_code=201)


@e2b_endpoint
async def create_snapshot(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    body = await body_of(request, SnapshotRequest, principal, optional=True)
    snapshot = await svc.snapshots.create(principal, request.path_params["sandbox_id"], body.name)
    return JSONResponse(snapshot_json(snapshot), status_code=201)


@e2b_endpoint
async def list_snapshots(request: Request) -> Response:
    """Newest first, filtered by `sandboxID` and `name`, in pages of `limit` (`nextToken`: where one ended)."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    params = request.query_params
    sandbox_id, name = params.get("sandboxID") or None, params.get("name") or None
    found = [s for s in await svc.snapshots.list(principal)
             if (sandbox_id is None or s.sandbox_id == sandbox_id) and (name is None or s.name == name)]
    found.sort(key=lambda s: (s.created_at, s.id), reverse=True)
    after = params.get("nextToken")
    if after:
        ids = [s.id for s in found]
        if after not in ids:
            raise InvalidRequestError("nextToken is not one a previous page gave")
        found = found[ids.index(after) + 1:]
    limit = _limit(params.get("limit"))
    headers = {"X-Next-Token": found[limit - 1].id} if len(found) > limit else {}
    return JSONResponse([snapshot_json(s) for s in found[:limit]], headers=headers)


@e2b_endpoint
async def delete_template(request: Request) -> Response:
    """E2B deletes snapshots as templates; Corral's templates are the operator's, not deleted through the API."""
    svc = front_of(request).service
    principal = await caller(svc, request)
    template_id = urllib.parse.unquote(request.path_params["template_id"])
    try:
        await svc.snapshots.delete(principal, template_id)
    except NotFoundError:
        raise NotFoundError(f"no snapshot {template_id!r} (Corral's templates are deleted by the operator, with "
                            "`corral templates`)") from None
    return Response(status_code=204)


@e2b_endpoint
async def template_alias(request: Request) -> Response:
    svc = front_of(request).service
    principal = await caller(svc, request)
    alias = request.path_params["alias"]
    template = front_of(request).config.template(alias)
    if not await svc.templates.exists(principal, template):
        raise NotFoundError(f"no template {alias!r}")
    return JSONResponse({"templateID": alias, "public": True})


@e2b_endpoint
async def not_supported(request: Request) -> Response:
    raise NotFoundError(f"{request.method} {request.url.path} is not part of Corral's E2B API (docs/e2b.md lists "
                        "what is)")


def _sandbox(request: Request, record: Any, template_id: str | None = None) -> dict[str, Any]:
    front = front_of(request)
    return sandbox_json(record, front.config, front.service.access, _domain(request), template_id)


def _domain(request: Request) -> str:
    return server_domain(request, front_of(request).service.ports.domain)


def routes() -> list[Route]:
    sid = "/{sandbox_id}"
    return [
        Route("/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", create, methods=["POST"]),
        Route("/sandboxes", list_v1, methods=["GET"]),
        Route("/v2/sandboxes", list_v2, methods=["GET"]),
        Route(f"/sandboxes{sid}", get_sandbox, methods=["GET"]),
        Route(f"/sandboxes{sid}", kill, methods=["DELETE"]),
        Route(f"/sandboxes{sid}/timeout", set_timeout, methods=["POST"]),
        Route(f"/sandboxes{sid}/refreshes", refresh, methods=["POST"]),
        Route(f"/sandboxes{sid}/pause", pause, methods=["POST"]),
        Route(f"/sandboxes{sid}/resume", resume, methods=["POST"]),
        Route(f"/sandboxes{sid}/connect", connect, methods=["POST"]),
        Route(f"/v2/sandboxes{sid}/connect", connect, methods=["POST"]),
        Route(f"/sandboxes{sid}/network", set_network, methods=["PUT"]),
        Route(f"/sandboxes{sid}/metrics", metrics, methods=["GET"]),
        Route(f"/sandboxes{sid}/fork", fork, methods=["POST"]),
        Route(f"/sandboxes{sid}/snapshots", create_snapshot, methods=["POST"]),
        Route("/snapshots", list_snapshots, methods=["GET"]),
        Route("/templates/aliases/{alias}", template_alias, methods=["GET"]),
        Route("/templates/{template_id:path}", delete_template, methods=["DELETE"]),
    ]
