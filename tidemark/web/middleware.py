"""The app's pure ASGI middlewares, outermost first: SecurityHeaders, Failures, BodyLimit,
SlashRedirect (app.py adds them).

Each is hand-written because Starlette's nearest built-in does something else:
- Starlette's ``ServerErrorMiddleware`` (where a handler for ``Exception`` goes) sits outside
  every user middleware, so its 500 would lack the security headers, and it re-raises after
  answering; a failure after the first byte must break the transfer instead (Failures).
- Starlette's ``RequestBodyLimitMiddleware`` counts bytes as a handler reads them: a body too
  large would be found only after authentication and the CSRF check began reading it, a
  trickled body could hold the connection for ever, and a GET could carry one (BodyLimit).
- The router's own ``redirect_slashes`` builds an absolute URL from the Host header
  (SlashRedirect).
Nothing here compresses (GZip) or checks the Host (TrustedHost): Airflow's API server in front
decides both, as it does for its own routes.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import RedirectResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidemark.core.db import one_line
from tidemark.core.dsn import mask
from tidemark.web import auth as web_auth
from tidemark.web.auth import NotAuthenticated
from tidemark.web.context import Web, rel
from tidemark.web.errors import not_authenticated

MAX_BODY = 2 * 1024 * 1024  # a POST's body: 100,000 ids and a note fit with room to spare
BODY_SECONDS = 10.0  # to receive a whole body: 2 MiB take well under a second on any link
BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})  # methods no page takes a body on
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
)
log = logging.getLogger(__name__)


class SecurityHeaders:
    """Every answer's security headers (a route may set its own CSP and caching)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def headed(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", CSP)
                headers.setdefault("Cache-Control", "no-store")
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Referrer-Policy"] = "same-origin"
            await send(message)

        await self.app(scope, receive, headed)


class TransferAborted(BaseException):
    """A response that failed after its first byte. The status (200) and part of the body are
    out, so the only honest answer left is a broken connection; a clean end would pass a cut
    export off as a whole one. A BaseException because Airflow's own middlewares (Starlette's
    BaseHTTPMiddleware) end a failed stream cleanly on an Exception; this one passes them,
    and the server then closes the connection without the final chunk."""


class Failures:
    """What a failure no exception handler took becomes: before the response starts, an error
    page or JSON (never a traceback); after it, a broken transfer."""

    def __init__(self, app: ASGIApp, web: Web) -> None:
        self.app, self.web = app, web

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        request = Request(scope)
        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # the log has the traceback, never the caller
            if started:
                log.error(
                    "tidemark dead letters: %s %s failed after the answer began; "
                    "the connection is cut so the client sees a broken transfer: %s",
                    request.method,
                    request.url.path,
                    mask(one_line(exc)),
                )
                raise TransferAborted(one_line(exc)) from exc
            log.exception("tidemark dead letters: %s %s failed", request.method, request.url.path)
            await self.web.error(
                request,
                500,
                f"internal error ({type(exc).__name__}); the API server's log has the details",
            )(scope, receive, send)


class BodyLimit:
    """Caps a request body at ``limit`` bytes and ``seconds`` before anything reads it (the
    CSRF check in ``guard``, the handlers): a Content-Length over it is refused unread, a
    chunked body is counted as it arrives, and one that has not arrived whole in time is
    refused (a trickled body would otherwise hold a connection, before authentication, for as
    long as the client likes). A body on a method that takes none is refused unread. The body
    (at most ``limit`` bytes) is read here and handed on whole."""

    def __init__(
        self, app: ASGIApp, web: Web, limit: int = MAX_BODY, seconds: float = BODY_SECONDS
    ) -> None:
        self.app, self.web, self.limit, self.seconds = app, web, limit, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "").strip()
        method = scope["method"]
        if method in BODYLESS and (
            (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
        ):
            await self.web.error(Request(scope), 400, f"{method} takes no request body")(
                scope, receive, send
            )
            return
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, receive, send)
            return
        if method not in BODYLESS:
            # Who asks, from the headers alone, before a byte of the body is read: a caller
            # who is not signed in gets no buffer at all (400 connections of 2 MiB each
            # would otherwise sit in memory before any of them was refused).
            request = Request(scope)
            try:
                await web_auth.authenticate(request)
            except NotAuthenticated as exc:
                await (await not_authenticated(request, exc))(scope, receive, send)
                return
        try:
            async with asyncio.timeout(self.seconds):
                body = await self._read(receive)
        except TimeoutError:
            await self.web.error(
                Request(scope), 408, f"request body not received within {self.seconds:g} s"
            )(scope, receive, send)
            return
        if body is None:  # the client left: nobody to answer
            return
        if len(body) > self.limit:
            await self._refuse(scope, receive, send)
            return
        whole: Message | None = {"type": "http.request", "body": body, "more_body": False}
        del body

        async def replay() -> Message:
            nonlocal whole
            if whole is None:  # after the body: a disconnect, for streamed answers
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or its first bytes past ``limit`` (no more is read); None if the
        client left."""
        data = bytearray()  # one copy of the body, grown in place
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            data += message.get("body", b"")
            if len(data) > self.limit or not message.get("more_body", False):
                return bytes(data)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The server drops the unread rest of the body after this answer.
        response = self.web.error(
            Request(scope),
            413,
            f"request body too large: at most {self.limit:,} bytes; send fewer dead-letter "
            f"ids at a time",
        )
        await response(scope, receive, send)


class SlashRedirect:
    """``/tidemark/dlq`` -> ``/tidemark/dlq/`` (and a trailing slash too many, removed), as a
    path without scheme and host, when only the other form names a route of ``routes``."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app, self.routes = app, routes  # the router's own list: routes added later count

    def _routed(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is not Match.NONE for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and rel(Request(scope)) not in ("", "/")
            and not self._routed(scope)
        ):
            path = scope["path"]
            other = {**scope, "path": path.rstrip("/") if path.endswith("/") else path + "/"}
            if self._routed(other):
                # One leading slash whatever the path holds: "//host" or "/\\host" would be
                # another host to a browser.
                location = "/" + quote(other["path"]).lstrip("/\\")
                if scope.get("query_string"):
                    location += "?" + scope["query_string"].decode("latin-1")
                await RedirectResponse(location, status_code=307)(scope, receive, send)
                return
        await self.app(scope, receive, send)
