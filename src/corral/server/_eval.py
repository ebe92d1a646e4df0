"""`GET /v1/eval/runs` and `GET /v1/eval/runs/{name}/report.html`: the evaluation runs the server keeps
(admin, auditor); see `corral.service.EvalReports`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from ._auth import CurrentPrincipal
from ._context import service
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/eval", route_class=AuditedRoute)

# The report is self-contained (inline CSS and SVG, no script) and its strings come from sandboxes: whatever it
# holds, a browser opening it runs nothing and loads nothing.
REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; sandbox"


@router.get("/runs")
async def runs(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    found = await service(request).eval.list(principal)
    return {"runs": [{"name": r.name, "html": r.html, "error": r.error, **r.summary} for r in found]}


@router.get("/runs/{name}/report.html")
async def report(request: Request, name: str, principal: CurrentPrincipal) -> Response:
    body = await service(request).eval.html(principal, name)
    return Response(body, media_type="text/html; charset=utf-8",
                    headers={"Content-Security-Policy": REPORT_CSP, "X-Content-Type-Options": "nosniff"})
