"""The one code -> HTTP status table of the API, and the handlers that turn every error into
`{"error": {"code", "message", "details"}}`.

The SDK reverses this table; `docs/api.md` documents it. Nothing a client sends may produce a 500: request
validation errors are `invalid_request` 400, and unexpected exceptions are logged and answered as
`server_error` without internals.

A request that fails validation before its route runs is still audited, as `request.invalid` (the route, the
problems, the client address), attributed to its key. FastAPI may reject a body (bad JSON) before the route's
key dependency has run, so the key is checked here in that case: a request without a valid key is a 401 and an
`auth.denied` record (aggregated per address, like every 401), never an unattributed `request.invalid` record
that an unauthenticated flood could multiply.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._exceptions import AuthenticationError, CorralError
from ..control import AuditEvent, Principal

logger = logging.getLogger("corral.server")

STATUS_BY_CODE: Mapping[str, int] = MappingProxyType({
    "invalid_request": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "conflict": 409,
    "sandbox_timeout": 410,
    "quota_exceeded": 429,
    "capacity_exceeded": 503,  # the machine is full, not the tenant's quota: another server could take it
    "disk_full": 507,
    "server_error": 500,
    "template_build_failed": 500,
    "agent_error": 502,
    "runtime_unavailable": 503,
})

# Statuses Starlette raises on its own (unknown route, wrong method, ...) back to our codes.
_CODE_BY_HTTP_STATUS: Mapping[int, str] = MappingProxyType({
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "conflict",
})

RETRY_AFTER_DETAIL = "retry_after"  # an error whose details carry this many seconds gets a Retry-After header
REQUEST_INVALID = "request.invalid"  # the audit action of a request refused by validation
_MAX_PROBLEMS = 20  # problems kept in the audit record (the response lists them all)
_MAX_TEXT = 512  # the client's own text (paths, field names) is capped in the record


def status_for(code: str) -> int:
    return STATUS_BY_CODE.get(code, 500)


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def error_response(exc: CorralError) -> JSONResponse:
    headers: dict[str, str] = {}
    retry = exc.details.get(RETRY_AFTER_DETAIL)
    if isinstance(retry, int | float) and retry > 0:
        headers["Retry-After"] = str(int(retry))
    return JSONResponse(error_body(exc.code, exc.message, exc.details), status_code=status_for(exc.code),
                        headers=headers)


async def _corral_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CorralError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    from ._auth import principal  # here: _auth imports _context, which imports this module

    problems = [_problem(e) for e in exc.errors()]
    try:
        caller = await principal(request)  # already known, unless the body was refused before the key was checked
    except AuthenticationError as auth_error:
        return error_response(auth_error)
    await _audit_invalid(request, caller, problems)
    message = "invalid request: " + "; ".join(f"{p['where']}: {p['message']}" for p in problems)
    return JSONResponse(error_body("invalid_request", message, {"errors": problems}), status_code=400)


async def _audit_invalid(request: Request, caller: Principal, problems: list[dict[str, str]]) -> None:
    from ._context import services  # see _validation_error

    route = getattr(request.scope.get("route"), "path", None)
    sandbox_id = request.path_params.get("sandbox_id")
    params = {"client": request.client.host if request.client is not None else None, "method": request.method,
              "path": request.url.path[:_MAX_TEXT], "route": route,
              "problems": [{k: v[:_MAX_TEXT] for k, v in p.items()} for p in problems[:_MAX_PROBLEMS]],
              "problem_count": len(problems)}
    target = sandbox_id[:256] if isinstance(sandbox_id, str) else None
    event = AuditEvent.by(caller, REQUEST_INVALID, target, params=params,
                          outcome={"status": 400, "error": "invalid_request"})
    await services(request).store.audit.append(event)


def _problem(error: Mapping[str, Any]) -> dict[str, str]:
    where = ".".join(str(part) for part in error.get("loc", ()))
    return {"where": where or "request", "message": str(error.get("msg", "invalid"))}


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _CODE_BY_HTTP_STATUS.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "server_error")
    status = exc.status_code if exc.status_code in _CODE_BY_HTTP_STATUS or exc.status_code >= 400 else 400
    return JSONResponse(error_body(code, str(exc.detail)), status_code=status, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed", exc_info=exc)
    return JSONResponse(error_body("server_error", "internal error; see the server log"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(CorralError, _corral_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
