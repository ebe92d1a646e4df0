"""`AuditedRoute`: a request refused by validation is still audited, as `request.invalid`, by its caller.

FastAPI may reject a body (bad JSON) before the route's key dependency has run, so the key is checked here in
that case: a request without a valid key is a 401 and an `auth.denied` record (aggregated per address, like
every 401), never an unattributed `request.invalid` record that an unauthenticated flood could multiply.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ._auth import client_info, principal
from ._context import service
from ._errors import invalid_request, problems_of

__all__ = ["AuditedRoute"]


class AuditedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                problems = problems_of(exc)
                caller = await principal(request)  # known already, unless the body was refused before the key
                target = request.path_params.get("sandbox_id")
                await service(request).record_invalid(
                    caller, client_info(request), route=self.path,
                    target=target if isinstance(target, str) else None, problems=problems)
                raise invalid_request(problems) from None

        return route
