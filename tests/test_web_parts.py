"""The dead-letter app's parts in-process, without Airflow (tests/test_dlq_web.py has them
behind Airflow's API server): what the middlewares answer before a route or authentication
runs, that a failure gets the security headers or, once the answer began, breaks the
transfer, that routes included in the factory get the app-wide guard, and the typed
selection of a POST."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse
from starlette.testclient import TestClient

from tidemark.core.errors import BadInput
from tidemark.web.app import create_app
from tidemark.web.auth import Caller, guard
from tidemark.web.middleware import CSP, MAX_BODY, TransferAborted
from tidemark.web.selection import ActionBody, ByIds, Matching


class _User:
    def get_name(self) -> str:
        return "tester"

    def get_id(self) -> str:
        return "1"


def _app() -> FastAPI:
    """The app with a route that fails before it answers and one that fails midway, and
    the caller taken as given (no Airflow to ask)."""
    app = create_app()
    extra = APIRouter()

    @extra.get("/dlq/api/boom")
    def boom() -> None:
        raise RuntimeError("secret detail")

    @extra.get("/dlq/api/cut")
    def cut() -> StreamingResponse:
        def lines() -> Iterator[bytes]:
            yield b"first\n"
            raise RuntimeError("the ledger went away")

        return StreamingResponse(lines())

    app.include_router(extra)
    app.dependency_overrides[guard] = lambda: Caller(_User(), "jwt", via_cookie=False)
    return app


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(_app(), root_path="/tidemark", raise_server_exceptions=False) as c:
        yield c


def test_a_failure_before_the_answer_is_a_500_with_the_headers_and_no_detail(client):
    r = client.get("/dlq/api/boom")
    assert r.status_code == 500
    assert r.json() == {
        "detail": "internal error (RuntimeError); the API server's log has the details"
    }
    assert r.headers["content-security-policy"] == CSP
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["cache-control"] == "no-store"


def test_a_failure_after_the_first_byte_breaks_the_transfer():
    # Called as the server calls it: the TestClient cannot carry a BaseException out.
    sent: list[dict] = []

    bodies = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:  # no body, and the client stays
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/dlq/api/cut",
        "raw_path": b"/dlq/api/cut",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"localhost")],
        "server": ("localhost", 80),
        "client": ("127.0.0.1", 1),
    }
    with pytest.raises(TransferAborted, match="the ledger went away"):
        asyncio.run(_app()(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    out = [m for m in sent if m["type"] == "http.response.body"]
    assert out[0]["body"] == b"first\n"
    assert all(m.get("more_body", False) for m in out)  # never a clean end


def test_bodies_too_large_or_where_none_belong_are_refused_before_authentication(client):
    # No Airflow here: authenticating would fail, so these answers come before it.
    r = client.post(
        "/dlq/api/discard",
        content=b"{}",
        headers={"Content-Length": str(MAX_BODY + 1), "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["detail"].startswith("request body too large")
    assert r.headers["content-security-policy"] == CSP
    r = client.request("GET", "/dlq/api/records", content=b"hello")
    assert r.status_code == 400 and r.json() == {"detail": "GET takes no request body"}


def test_the_slash_redirect_is_a_path_whatever_the_host(client):
    for path, to in (
        ("/dlq", "/dlq/"),
        ("/dlq/api/records/?limit=1", "/dlq/api/records?limit=1"),
        ("/dlq/api/boom/", "/dlq/api/boom"),  # a route included after the middleware was
    ):
        r = client.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
        assert (r.status_code, r.headers["location"]) == (307, to), path
        assert r.headers["x-content-type-options"] == "nosniff"


def test_every_route_depends_on_the_guard():
    app = _app()
    for route in app.routes:
        assert guard in [d.call for d in route.dependant.dependencies], route.path


def test_a_posts_selection_is_typed():
    body = ActionBody.checked({"ids": "7,4 7", "dry_run": "on", "pipeline": "orders"})
    assert body.dry and not body.all_matching_on and body.chosen() == [4, 7]
    assert ByIds(ids=body.chosen()).ids == [4, 7]
    sel = ActionBody.checked({"pipeline": "orders", "expected": "3"}).matching("redrive")
    assert isinstance(sel, Matching) and (sel.pipeline, sel.expected) == ("orders", 3)
    assert sel.filters.status == "quarantined"
    for given, named in (({"ids": [True]}, "ids [True]"), ({"dry_run": "yes"}, "dry_run 'yes'")):
        with pytest.raises(BadInput, match=re.escape(named)):
            ActionBody.checked(given).dry  # noqa: B018 - the property checks
    with pytest.raises(BadInput, match="pipeline: choose"):
        ActionBody().matching("discard")
