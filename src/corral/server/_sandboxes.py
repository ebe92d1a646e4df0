"""Sandbox lifecycle routes: create, list, get, kill, timeout, network, pause, resume, fork, snapshot, metrics
(thin: one service call each)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from ..control import SandboxRecord
from ..service import CreateSandbox, ForkSandbox, SandboxMetric, file_roots
from ._auth import CurrentPrincipal
from ._context import query_param, query_prefixed, service
from ._routing import AuditedRoute
from ._snapshots import SnapshotRequest, snapshot_json

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

_MAX_TIMEOUT = 7 * 24 * 3600


class NetworkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    network: str | list[str]


class PauseRequest(BaseModel):
    """`memory`: frozen in place (the default); false: paused to disk. `to_disk` with `memory`: refused (CRIU)."""

    model_config = ConfigDict(extra="forbid")

    memory: bool = True
    to_disk: bool = False


class TimeoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout: Annotated[float, Field(gt=0, le=_MAX_TIMEOUT)]


def _iso(time: datetime) -> str:
    return time.astimezone(UTC).isoformat()


def sandbox_json(record: SandboxRecord) -> dict[str, Any]:
    spec = record.spec
    return {
        "id": record.id,
        "state": record.state.value,
        "template": record.template,
        "runtime": spec.runtime.value,
        "limits": spec.limits.model_dump(mode="json"),
        "created_at": _iso(record.created_at),
        "expires_at": _iso(record.expires_at),
        "metadata": record.metadata,
        "file_roots": file_roots(record),
        "network": spec.network if isinstance(spec.network, str) else list(spec.network),
        "paused_to_disk": record.paused_to_disk,
        "ttl_left": record.ttl_left,  # paused to disk: the seconds it gets when it resumes (its clock stands still)
        "on_timeout": spec.on_timeout,
        "auto_resume": spec.auto_resume,  # paused, a request that reaches it resumes it (docs/lifecycle.md)
        "volumes": dict(spec.volumes),
        "public_ports": spec.public_ports,
        "root": spec.root,
        "checkpoints": spec.checkpoints,  # "auto": one before each change to files (docs/lifecycle.md)
        "checkpoint_keep": spec.checkpoint_keep,
        "replica": record.owner,  # the replica whose backend runs it (docs/replicas.md)
        "reason": record.reason,  # why it is lost or failed, when its replica stopped answering
    }


def metric_json(metric: SandboxMetric) -> dict[str, Any]:
    return {"timestamp": _iso(metric.timestamp), "cpus": metric.cpus, "cpu_used_pct": metric.cpu_used_pct,
            "memory_used": metric.memory_used, "memory_total": metric.memory_total,
            "memory_cache": metric.memory_cache, "disk_used": metric.disk_used, "disk_total": metric.disk_total}


def _query_time(request: Request, name: str) -> datetime | None:
    """A time in the query: unix seconds, or ISO 8601 (naive: UTC). Malformed is a 400, audited like any invalid
    field (`request.invalid`)."""
    raw = query_param(request, name)
    if raw is None:
        return None
    try:
        return _parse_time(raw)
    except (ValueError, OverflowError, OSError):
        problem = {"loc": ("query", name), "type": "value_error",
                   "msg": f"{raw[:64]!r} is neither unix seconds nor an ISO 8601 time"}
        raise RequestValidationError([problem]) from None


def _parse_time(raw: str) -> datetime:
    try:
        seconds = float(raw)
    except ValueError:
        moment = datetime.fromisoformat(raw)
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return datetime.fromtimestamp(seconds, UTC)  # nan, inf and out-of-range seconds raise


@router.post("", status_code=201)
async def create_sandbox(body: CreateSandbox, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return sandbox_json(await service(request).sandboxes.create(principal, body))


@router.get("")
async def list_sandboxes(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    records = await service(request).sandboxes.list(principal, query_prefixed(request, "metadata."))
    return {"sandboxes": [sandbox_json(r) for r in records]}


@router.get("/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return sandbox_json(await service(request).sandboxes.get(principal, sandbox_id))


@router.delete("/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).sandboxes.kill(principal, sandbox_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, body: TimeoutRequest, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    return sandbox_json(await service(request).sandboxes.set_timeout(principal, sandbox_id, body.timeout))


@router.put("/{sandbox_id}/network")
async def set_network(sandbox_id: str, body: NetworkRequest, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    """Change a live sandbox's egress policy: new connections follow it at once; open ones keep going."""
    return sandbox_json(await service(request).sandboxes.set_network(principal, sandbox_id, body.network))


@router.post("/{sandbox_id}/pause")
async def pause(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                body: PauseRequest | None = None) -> dict[str, Any]:
    how = body or PauseRequest()
    return sandbox_json(await service(request).sandboxes.pause(principal, sandbox_id, memory=how.memory,
                                                               to_disk=how.to_disk))


@router.post("/{sandbox_id}/resume")
async def resume(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    return sandbox_json(await service(request).sandboxes.resume(principal, sandbox_id))


@router.post("/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, request: Request, principal: CurrentPrincipal,
               body: ForkSandbox | None = None) -> dict[str, Any]:
    """The child's sandbox object; with `count`, `{"sandboxes": [...]}` (all of them started, or none)."""
    asked = body or ForkSandbox()
    children = await service(request).sandboxes.fork(principal, sandbox_id, asked)
    if asked.count is None:
        return sandbox_json(children[0])
    return {"sandboxes": [sandbox_json(r) for r in children]}


@router.post("/{sandbox_id}/snapshots", status_code=201)
async def snapshot(sandbox_id: str, request: Request, principal: CurrentPrincipal,
                   body: SnapshotRequest | None = None) -> dict[str, Any]:
    name = body.name if body is not None else None
    return snapshot_json(await service(request).snapshots.create(principal, sandbox_id, name))


@router.get("/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    """The sandbox's resource samples from `start` to `end` (both optional and included), oldest first."""
    start, end = _query_time(request, "start"), _query_time(request, "end")
    samples = await service(request).sandboxes.metrics(principal, sandbox_id, start, end)
    return {"metrics": [metric_json(m) for m in samples]}
