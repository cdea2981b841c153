"""The dashboard's web application (Starlette): three pages (the runs, one run, runs side by
side), their JavaScript and CSS from the package's ``static/`` folder, and a read-only JSON API
over a :class:`~lockstep.dashboard.store.RunStore`.

Only GET (and HEAD) are served. With a ``token``, every request needs it: once in the URL
(``?token=...``, which sets a cookie and redirects to the same page without it), then by the
cookie, or as ``Authorization: Bearer <token>``. Every response forbids the page to load
anything from elsewhere (a Content-Security-Policy of ``'self'``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from lockstep.dashboard.store import RunStore, UnknownRun
from lockstep.dashboard.views import json_safe, run_detail, run_rows

__all__ = ["TOKEN_COOKIE", "create_app"]

TOKEN_COOKIE = "lockstep_dashboard_token"
STATIC = Path(str(resources.files("lockstep.dashboard") / "static"))
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def create_app(store: RunStore, token: str | None = None) -> Starlette:
    """The dashboard over ``store``; with ``token``, only for whoever has it."""

    def page(file_name: str) -> Callable[[Request], Response]:
        def serve_page(request: Request) -> Response:
            return FileResponse(STATIC / file_name, media_type="text/html")

        return serve_page

    def runs(request: Request) -> Response:
        return _json({"storage": store.storage_path, "runs": run_rows(store)})

    def run(request: Request) -> Response:
        return _json(run_detail(store, request.path_params["name"]))

    def reports(request: Request) -> Response:
        since = request.query_params.get("since", "0")
        start = int(since) if since.isdigit() else 0
        return _json(store.history(request.path_params["name"]).rows_since(start))

    def logs(request: Request) -> Response:
        return _json({"logs": store.log_tails(request.path_params["name"])})

    routes = [
        Route("/", page("runs.html")),
        Route("/runs/{name}", page("run.html")),
        Route("/compare", page("compare.html")),
        Route("/api/runs", runs),
        Route("/api/runs/{name}", _known(run)),
        Route("/api/runs/{name}/reports", _known(reports)),
        Route("/api/runs/{name}/logs", _known(logs)),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(SecurityHeaders)
    if token:
        app.add_middleware(TokenGate, token=token)
    return app


def _json(content: Any) -> Response:
    return JSONResponse(json_safe(content), headers={"cache-control": "no-store"})


def _known(endpoint: Callable[[Request], Response]) -> Callable[[Request], Response]:
    """``endpoint``, answering 404 for a run that isn't there."""

    def answer(request: Request) -> Response:
        try:
            return endpoint(request)
        except UnknownRun:
            return PlainTextResponse(f"no run {request.path_params['name']!r} in this storage path", status_code=404)

    return answer


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


class TokenGate:
    """Lets through only the requests that carry the token (see the module's docstring)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self._matches(request.query_params.get("token")):
            query = [(key, value) for key, value in request.query_params.multi_items() if key != "token"]
            target = request.url.path + (f"?{urlencode(query)}" if query else "")
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        elif self._matches(request.cookies.get(TOKEN_COOKIE)) or self._matches(_bearer(request)):
            await self.app(scope, receive, send)
            return
        else:
            response = PlainTextResponse(
                "This lockstep dashboard needs its token: open the URL that `lockstep dashboard` printed "
                "(it ends with ?token=...).",
                status_code=401,
            )
        await response(scope, receive, send)

    def _matches(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())


def _bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value if scheme.lower() == "bearer" and value else None
