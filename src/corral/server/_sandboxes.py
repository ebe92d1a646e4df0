"""Sandbox lifecycle routes: create, list, get, kill, timeout, pause, resume."""

from __future__ import annotations

import secrets
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from .._exceptions import ConflictError, InvalidRequestError, NotFoundError, QuotaExceededError, SandboxTimeoutError
from ..control import Action, Principal, SandboxRecord, SandboxStatus, TenantEgress, authorize
from ..egress import EgressPolicy
from ..engine import DEFAULT_FILE_ROOTS, Limits, SandboxSpec
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services
from ._errors import RETRY_AFTER_DETAIL

router = APIRouter(prefix="/v1/sandboxes")

# Quotas on totals free up when the tenant's sandboxes end; per-sandbox maxima never do.
_TOTAL_QUOTAS = frozenset({"max_sandboxes", "max_memory_bytes", "max_cpus"})
_RETRY_AFTER_MAX = 300
_MAX_TIMEOUT = 7 * 24 * 3600


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    template: str = "default"
    runtime: str = "runc"
    timeout: float = 300
    network: str | list[str] = "none"  # docs/egress.md: "none", "internet" or a list of rules
    limits: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    file_roots: list[str] | None = None  # None: DEFAULT_FILE_ROOTS


class NetworkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    network: str | list[str]


class TimeoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout: Annotated[float, Field(gt=0, le=_MAX_TIMEOUT)]


def _iso(time: datetime) -> str:
    return time.astimezone(UTC).isoformat()


def sandbox_json(record: SandboxRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "state": record.state.value,
        "template": record.template,
        "runtime": record.spec.get("runtime"),
        "limits": record.spec.get("limits"),
        "created_at": _iso(record.created_at),
        "expires_at": _iso(record.expires_at),
        "metadata": record.metadata,
        "file_roots": file_roots(record),
        "network": record.spec.get("network", "none"),
    }


def file_roots(record: SandboxRecord) -> list[str]:
    """The directories the file API may touch in this sandbox (records from before roots were stored: defaults)."""
    roots = record.spec.get("file_roots")
    return list(roots) if isinstance(roots, list) and roots else list(DEFAULT_FILE_ROOTS)


def _spec(body: CreateRequest, svc: Services, egress: TenantEgress) -> SandboxSpec:
    network = check_network(body.network, egress)
    try:
        spec = SandboxSpec(template=body.template, runtime=body.runtime, timeout=body.timeout,  # type: ignore[arg-type]
                           limits=Limits(**body.limits), env=body.env, metadata=body.metadata,
                           file_roots=DEFAULT_FILE_ROOTS if body.file_roots is None else tuple(body.file_roots),
                           network=network if isinstance(network, str) else tuple(network),
                           network_private=tuple(egress.private))
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(f"invalid sandbox spec: {problems}") from None
    try:
        svc.engine.templates.get(spec.template)
    except NotFoundError as exc:
        raise InvalidRequestError(exc.message, details={"template": spec.template}) from None
    return spec


def check_network(network: str | list[str], egress: TenantEgress) -> str | list[str]:
    """The policy in its normal form, if it is well-formed and within the tenant's ceiling."""
    policy = EgressPolicy.parse(network, private=egress.private)  # InvalidRequestError says what is wrong
    # The tenant's private pairs belong to its ceiling by definition; PermissionDeniedError names any excess.
    policy.within(EgressPolicy.parse(egress.ceiling, private=egress.private))
    return policy.to_wire()


async def _retry_after(svc: Services, tenant_id: str) -> int:
    """Seconds until the tenant's first sandbox expires: the earliest a total quota can free up by itself."""
    live = await svc.store.list_sandboxes(tenant_id)
    if not live:
        return 1
    soonest = min(r.expires_at for r in live)
    wait = (soonest - datetime.now(UTC)).total_seconds()
    return max(1, min(_RETRY_AFTER_MAX, int(wait) + 1))


@router.post("", status_code=201)
async def create_sandbox(body: CreateRequest, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    params = body.model_dump(mode="json", exclude={"env"})
    params["env_names"] = sorted(body.env)  # values often carry secrets
    sandbox_id = f"sb-{secrets.token_hex(8)}"
    async with Audited(svc.store, principal, "sandbox.create", sandbox_id, params=params, status=201):
        spec = _spec(body, svc, await svc.store.tenant_egress(principal.tenant_id))
        try:
            record = await svc.store.reserve_sandbox(principal, spec, sandbox_id=sandbox_id)
        except QuotaExceededError as exc:
            if exc.details.get("limit") in _TOTAL_QUOTAS:
                exc.details[RETRY_AFTER_DETAIL] = await _retry_after(svc, principal.tenant_id)
            raise
        try:
            await svc.engine.create(spec, sandbox_id=record.id)
        except BaseException:
            await svc.store.mark_destroyed(record.id, failed=True)
            raise
        record = await _mark_running(svc, record.id)
    return sandbox_json(record)


async def _mark_running(svc: Services, sandbox_id: str) -> SandboxRecord:
    """Record the new sandbox as running, unless the kill switch ended it while the engine was creating it."""
    try:
        return await svc.store.mark_running(sandbox_id)
    except BaseException as exc:
        await destroy(svc, sandbox_id)  # what the engine made must not outlive its record
        if isinstance(exc, NotFoundError):
            raise ConflictError(f"sandbox {sandbox_id} was stopped (kill switch) while it was being created",
                                details={"sandbox_id": sandbox_id}) from None
        raise


def _metadata_filter(request: Request) -> dict[str, str]:
    raw = request.scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidRequestError("query string is not valid UTF-8") from None
    return {k.removeprefix("metadata."): v for k, v in pairs if k.startswith("metadata.")}


@router.get("")
async def list_sandboxes(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    wanted = _metadata_filter(request)
    async with Audited(svc.store, principal, "sandbox.list", None, params={"metadata": wanted}) as audit:
        authorize(principal, Action.SANDBOX_READ, principal.tenant_id)
        records = await svc.store.list_sandboxes(principal.tenant_id, metadata=wanted)
        audit.outcome["count"] = len(records)
    return {"sandboxes": [sandbox_json(r) for r in records]}


async def _get(svc: Services, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord:
    return await svc.store.sandbox_for(principal, sandbox_id, action)


@router.get("/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.get", sandbox_id):
        record = await _get(svc, principal, sandbox_id, Action.SANDBOX_READ)
    return sandbox_json(record)


@router.delete("/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.kill", sandbox_id, status=204):
        await _get(svc, principal, sandbox_id, Action.SANDBOX_KILL)
        await destroy(svc, sandbox_id)
    return Response(status_code=204)


async def destroy(svc: Services, sandbox_id: str) -> None:
    """Destroy in the engine (gone already is fine) and record it."""
    try:
        await svc.engine.destroy(sandbox_id)
    except (NotFoundError, SandboxTimeoutError):
        pass
    await svc.store.mark_destroyed(sandbox_id)


@router.post("/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, body: TimeoutRequest, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.timeout", sandbox_id, params={"timeout": body.timeout}):
        await _get(svc, principal, sandbox_id, Action.SANDBOX_UPDATE)
        record = await svc.store.set_sandbox_timeout(sandbox_id, body.timeout)
        svc.engine.set_timeout(sandbox_id, body.timeout)
    return sandbox_json(record)


@router.put("/{sandbox_id}/network")
async def set_network(sandbox_id: str, body: NetworkRequest, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    """Change a live sandbox's egress policy: new connections follow it at once; open ones keep going."""
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.network", sandbox_id, params={"network": body.network}):
        record = await _get(svc, principal, sandbox_id, Action.SANDBOX_UPDATE)
        egress = await svc.store.tenant_egress(record.tenant_id)
        network = check_network(body.network, egress)
        svc.engine.set_network(sandbox_id, network, private=egress.private)
        record = await svc.store.set_sandbox_network(sandbox_id, network)
    return sandbox_json(record)


@router.post("/{sandbox_id}/pause")
async def pause(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.pause", sandbox_id):
        await _get(svc, principal, sandbox_id, Action.SANDBOX_UPDATE)
        await svc.engine.pause(sandbox_id)
        record = await svc.store.set_sandbox_state(sandbox_id, SandboxStatus.PAUSED)
    return sandbox_json(record)


@router.post("/{sandbox_id}/resume")
async def resume(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "sandbox.resume", sandbox_id):
        await _get(svc, principal, sandbox_id, Action.SANDBOX_UPDATE)
        await svc.engine.resume(sandbox_id)
        record = await svc.store.set_sandbox_state(sandbox_id, SandboxStatus.RUNNING)
    return sandbox_json(record)
