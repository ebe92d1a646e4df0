"""E2B's error bodies: `{"code": <HTTP status>, "message": "..."}` on the control plane and envd's REST routes.

The status comes from the one table every front end uses (`corral.service.status_for`): a Corral error means
the same thing whichever API answered it. E2B's SDKs branch on the status alone (401 authentication, 404 not
found, 409 conflict, 429 rate limit with `Retry-After`), and show the message.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from .._exceptions import CorralError
from ..service import RETRY_AFTER_DETAIL, status_for

__all__ = ["corral_error", "e2b_error", "unexpected_error"]

logger = logging.getLogger("corral.e2b")


def e2b_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def corral_error(exc: CorralError) -> JSONResponse:
    headers: dict[str, str] = {}
    retry = exc.details.get(RETRY_AFTER_DETAIL)
    if isinstance(retry, int | float) and retry > 0:
        headers["Retry-After"] = str(int(retry))
    return e2b_error(status_for(exc.code), exc.message, headers)


def unexpected_error(exc: BaseException) -> JSONResponse:
    logger.error("E2B API request failed", exc_info=exc)
    return e2b_error(500, "internal error; see the server log")
