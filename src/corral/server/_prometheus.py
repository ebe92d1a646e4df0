"""`GET /metrics`: the service's Prometheus metrics (docs/operations.md), in Prometheus' text format.

On the API port the caller must be an admin (`Authorization: Bearer <admin key>`; 401 without a key, 403 for any
other role): the metrics count every tenant. `metrics_app` serves the same text without authentication, for a
separate port the operator chooses (`corral serve --metrics-port`), which should be reachable by the scraper only.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.applications import Starlette
from starlette.routing import Route

from .._exceptions import NotFoundError
from ..service import METRICS_CONTENT_TYPE, Service, Telemetry
from ._auth import CurrentPrincipal
from ._context import service

__all__ = ["METRICS_PATH", "metrics_app", "router"]

METRICS_PATH = "/metrics"

router = APIRouter()


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics(request: Request, principal: CurrentPrincipal) -> Response:
    body = await _telemetry(service(request)).scrape(principal)
    return Response(body, media_type=METRICS_CONTENT_TYPE)


def metrics_app(svc: Service) -> Starlette:
    """`/metrics` alone, unauthenticated: the app of the separate metrics port. The API app's lifespan starts and
    stops the service; this one has none."""
    telemetry = _telemetry(svc)

    async def scrape(request: Request) -> Response:
        return Response(await telemetry.exposition(), media_type=METRICS_CONTENT_TYPE)

    return Starlette(routes=[Route(METRICS_PATH, scrape, methods=["GET"])])


def _telemetry(svc: Service) -> Telemetry:
    if svc.telemetry is None:
        raise NotFoundError("this server counts no metrics (`corral serve --no-metrics`)")
    return svc.telemetry
