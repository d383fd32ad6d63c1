"""The web app: its pages' routes, who is asking, and the headers every answer carries.

Each page module exports `routes`; `create_app` puts them behind the identity middleware
(identity.py) and the security headers. A record that cannot be used answers 503 with one
line, as a command would end with exit 4.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from daemon.commands.context import CommandContext, RecordUnusable
from daemon.web import api, approvals, nodes, overview, runs, shadow
from daemon.web.context import WebState
from daemon.web.identity import IdentityMiddleware

# Pages carry people's names and jobs: never framed, never cached, no outside resources.
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:;"
        b" form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)


class SecurityHeaders:
    """Adds `SECURITY_HEADERS` to every answer, the 401 and the errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in SECURITY_HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


# A form or an API body is a comment and two tokens; anything bigger is refused unread, so no
# one can make the server hold a body of their choosing in memory.
MAX_BODY_BYTES = 64 * 1024


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Answers 413 to a body over MAX_BODY_BYTES: by its Content-Length before anything is
    read, and, for a chunked body, as soon as the chunks read add up to more."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > MAX_BODY_BYTES):
                await _too_large(scope, receive, send)
                return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _BodyTooLarge:
            if started:
                raise
            await _too_large(scope, receive, send)


async def _too_large(scope: Scope, receive: Receive, send: Send) -> None:
    answer = PlainTextResponse(f"a request body holds at most {MAX_BODY_BYTES} bytes\n", 413)
    await answer(scope, receive, send)


# A path prefix of plain segments: never `//host` or `javascript:`, never a quote.
_PREFIX = re.compile(r"(?:/[A-Za-z0-9._~-]+){1,16}\Z")


class ForwardedPrefix:
    """Serves the pages under the prefix a forwarder names (`X-Forwarded-Prefix`, as Open
    OnDemand's app in deploy/web/ood sends it): links and redirects start with it.

    Believed from anyone, since it only changes the links of the answer to the request that
    carried it, which a page of another site cannot set (a custom header needs CORS); a prefix
    that is not plain path segments is ignored."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-forwarded-prefix":
                    prefix = value.decode("latin-1")
                    if _PREFIX.match(prefix):
                        scope = {**scope, "root_path": prefix}
                    break
        await self.app(scope, receive, send)


def templates() -> Jinja2Templates:
    """The pages' templates, every value escaped (autoescape on whatever the file's name)."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("daemon.web", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return Jinja2Templates(env=environment)


def healthz(_request: Request) -> Response:
    return PlainTextResponse("ok\n")


async def record_unusable(request: Request, error: Exception) -> Response:
    """503 in one line: the record is missing, unreachable, locked, or at another schema."""
    message = error.format_message() if isinstance(error, RecordUnusable) else str(error)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=503)
    page = f"<!doctype html><title>Record unavailable</title><h1>503</h1><p>{html.escape(message)}"
    return HTMLResponse(page, status_code=503)


def page_routes() -> list[BaseRoute]:
    return [
        Route("/healthz", healthz),
        *overview.routes,
        *approvals.routes,
        *runs.routes,
        *nodes.routes,
        *shadow.routes,
        *api.routes,
    ]


def create_app(
    context: CommandContext,
    *,
    proxy_secret: bytes | None,
    extra_routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """The app on a command's context; `proxy_secret` is the one in `web.proxy_secret_file`;
    `extra_routes` come after the pages' (the metrics' mount)."""
    app = Starlette(
        routes=[*page_routes(), *extra_routes],
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(ForwardedPrefix),
            Middleware(BodyLimit),
            Middleware(IdentityMiddleware, web=context.settings.web, secret=proxy_secret),
        ],
        exception_handlers={RecordUnusable: record_unusable},
    )
    app.state.web = WebState(context=context, templates=templates())
    return app
