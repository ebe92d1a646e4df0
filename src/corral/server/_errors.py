"""The one place errors become responses: `{"error": {"code", "message", "details"}}` with the status of
`corral.service.STATUS_BY_CODE`. It neither authenticates nor audits (the service and `_routing` do).

The SDK reverses the table; `docs/api.md` documents it. Nothing a client sends may produce a 500: request
validation errors are `invalid_request` 400, and unexpected exceptions are logged and answered as
`server_error` without internals.
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

from .._exceptions import CorralError, InvalidRequestError
from ..service import RETRY_AFTER_DETAIL, STATUS_BY_CODE, status_for

__all__ = ["RETRY_AFTER_DETAIL", "STATUS_BY_CODE", "error_body", "error_response", "install_error_handlers",
           "invalid_request", "status_for"]

logger = logging.getLogger("corral.server")

# Statuses Starlette raises on its own (unknown route, wrong method, ...) back to our codes.
_CODE_BY_HTTP_STATUS: Mapping[int, str] = MappingProxyType({
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "conflict",
})


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def error_response(exc: CorralError) -> JSONResponse:
    headers: dict[str, str] = {}
    retry = exc.details.get(RETRY_AFTER_DETAIL)
    if isinstance(retry, int | float) and retry > 0:
        headers["Retry-After"] = str(int(retry))
    return JSONResponse(error_body(exc.code, exc.message, exc.details), status_code=status_for(exc.code),
                        headers=headers)


def problems_of(exc: RequestValidationError) -> list[dict[str, str]]:
    return [_problem(e) for e in exc.errors()]


def invalid_request(problems: list[dict[str, str]]) -> InvalidRequestError:
    message = "invalid request: " + "; ".join(f"{p['where']}: {p['message']}" for p in problems)
    return InvalidRequestError(message, details={"errors": problems})


def _problem(error: Mapping[str, Any]) -> dict[str, str]:
    where = ".".join(str(part) for part in error.get("loc", ()))
    return {"where": where or "request", "message": str(error.get("msg", "invalid"))}


async def _corral_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CorralError)
    return error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    # Routes of `_routing.AuditedRoute` turn these into audited InvalidRequestErrors first; this renders the rest.
    assert isinstance(exc, RequestValidationError)
    return error_response(invalid_request(problems_of(exc)))


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
