"""`/ui`: the dashboard's static files (`corral.ui`), under a strict Content-Security-Policy.

A thin front: the same `index.html` for every page path (the page's script routes by the path) and the files
under `/ui/static/`. Everything the dashboard shows it fetches from `/v1` with the user's key, like any client.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..ui import INDEX, STATIC

__all__ = ["CSP", "PREFIX", "ui_app"]

PREFIX = "/ui"
# Scripts only from here (no inline script, no eval); styles inline too (xterm.js writes a <style> element, the
# eval reports carry theirs); API calls and the terminal's WebSocket only to this server; no frame loads anything
# (the eval report is a sandboxed srcdoc frame); never framed by another site.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "font-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
            (b"cache-control", b"no-cache")]
PAGES = ["/", "/sandboxes/{sandbox_id}", "/audit", "/eval", "/admin"]


class _SecurityHeaders:
    """Adds the policy headers to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in _HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _index(request: Request) -> Response:
    return FileResponse(INDEX, media_type="text/html; charset=utf-8")


def ui_app() -> ASGIApp:
    """The app to mount at `/ui` (the API app redirects `/ui` itself to `/ui/`)."""
    routes: list[BaseRoute] = [Route(page, _index, methods=["GET", "HEAD"]) for page in PAGES]
    routes.append(Mount("/static", StaticFiles(directory=STATIC)))
    return _SecurityHeaders(Starlette(routes=routes))
