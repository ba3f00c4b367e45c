"""The Pipelines page's Rebuild action (tidemark/web/rebuild.py) in-process, on a real ledger
(PostgreSQL) without Airflow: Airflow's REST API is a recording stand-in at the HTTP layer
(what the app asks it and with which conf), and who may do what is decided by a stand-in for
Airflow's auth manager. tests/test_dlq_web.py has the same guard, CSRF and trigger path
behind Airflow's real API server (the redrive's); this file checks what the Rebuild action
adds: shown only to editors, refused to others, always a preview first, and the rebuild for
real only from a preview that ended well, with the preview's own sink and options."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import psycopg
import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from bench.pipelines_bench import seed
from tidemark.core import dsn as core_dsn
from tidemark.core.settings import get_settings
from tidemark.web import airflow_api
from tidemark.web import auth as web_auth
from tidemark.web.app import create_app
from tidemark.web.auth import Caller, guard

DAG = "tidemark_p00_rebuild"
CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(
    os.environ.get("REBUILD_SHOTS", Path(__file__).parents[1] / "test-artifacts" / "rebuild")
)
# user -> what they may do on every DAG: admin edits, viewer reads, stranger nothing
ACCESS = {"admin": {"GET", "PUT"}, "viewer": {"GET"}, "stranger": set()}


class _User:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name

    def get_id(self) -> str:
        return self.name


class FakeAirflow:
    """Airflow's REST API as the app calls it: the rebuild DAG's details (Params), triggers
    (recorded with their conf), and runs whose state the test sets."""

    def __init__(self) -> None:
        self.triggered: list[tuple[str, dict]] = []
        self.runs: dict[str, dict] = {}
        self.staged = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = unquote(request.url.path)
        if path == f"/api/v2/dags/{DAG}/details":
            return httpx.Response(
                200,
                json={
                    "dag_id": DAG,
                    "params": {
                        "sink": {"value": "main", "schema": {"enum": ["main", "archive"]}},
                        "staged": {"value": self.staged, "schema": {"type": "boolean"}},
                        "accept_pruned": {"value": False, "schema": {"type": "boolean"}},
                        "dry_run": {"value": True, "schema": {"type": "boolean"}},
                    },
                },
            )
        if path == f"/api/v2/dags/{DAG}/dagRuns" and request.method == "POST":
            body = json.loads(request.content)
            run_id = f"manual__{len(self.triggered)}"
            self.triggered.append((DAG, body["conf"]))
            self.runs[run_id] = {"dag_run_id": run_id, "state": "queued", "conf": body["conf"]}
            return httpx.Response(200, json={"dag_run_id": run_id})
        if m := re.fullmatch(rf"/api/v2/dags/{DAG}/dagRuns/(.+)", path):
            run = self.runs.get(m[1])
            return httpx.Response(200, json=run) if run else httpx.Response(404, json={})
        if path == f"/api/v2/dags/{DAG}":
            return httpx.Response(200, json={"is_paused": False})
        return httpx.Response(404, json={"detail": f"no {path}"})


@pytest.fixture
def asgi(env, monkeypatch) -> Iterator[tuple[FastAPI, FakeAirflow]]:
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        seed(c, pipelines=1, days=1, letters_per_run=0)  # p00, sinks main and archive
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    monkeypatch.setattr(core_dsn, "_lookup", None)
    get_settings.cache_clear()
    fake = FakeAirflow()

    def client_init(self, token: str, api: str | None = None) -> None:
        self.api = "http://airflow.test/api/v2"
        self._http = httpx.Client(
            transport=httpx.MockTransport(fake), headers={"Authorization": f"Bearer {token}"}
        )

    monkeypatch.setattr(airflow_api.AirflowApi, "__init__", client_init)

    async def caller(request: Request) -> Caller:
        return Caller(_User(request.headers.get("x-user", "")), "jwt", via_cookie=False)

    monkeypatch.setattr(web_auth, "authenticate", caller)  # BodyLimit asks it for a POST
    monkeypatch.setattr(web_auth, "_multi_team", lambda: False)
    monkeypatch.setattr(web_auth, "_allowed", lambda c, method, dag, team: method in ACCESS[c.name])
    monkeypatch.setattr(web_auth, "may_read_all", lambda c: "GET" in ACCESS[c.name])
    application = create_app()
    application.dependency_overrides[guard] = caller
    try:
        yield application, fake
    finally:
        get_settings.cache_clear()


@pytest.fixture
def app(asgi) -> Iterator[tuple[TestClient, FakeAirflow]]:
    application, fake = asgi
    with TestClient(application, root_path="/tidemark", follow_redirects=False) as client:
        yield client, fake


def _as(user: str) -> dict[str, str]:
    return {"x-user": user}


def _finish_preview(env, fake: FakeAirflow, run_id: str, ok: bool = True) -> None:
    """What the DAG run would leave: success in Airflow, the ledger's run rolled back as a
    dry run (or aborted)."""
    fake.runs[run_id]["state"] = "success" if ok else "failed"
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        (rid,) = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner, dag_id, dag_run_id, finished_at) "
            "VALUES ('p00', 'rebuild', 'test:1', %s, %s, now()) RETURNING run_id",
            (DAG, run_id),
        ).fetchone()
        c.execute(
            "INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch, counts, error) "
            "VALUES (%s, 'archive', %s, 1, '{\"records\": 1200, \"rows\": 1100}', %s)",
            (rid, *(("previewed", None) if ok else ("aborted", "Spark failed"))),
        )


def test_the_action_is_shown_to_editors_only(app):
    client, fake = app
    page = client.get("/pipelines/p00", headers=_as("admin"))
    assert page.status_code == 200, page.text
    forms = re.findall(r'action="([^"]+)" class="rebuild" data-rebuild="(\w+)"', page.text)
    assert sorted(forms) == [("/tidemark/pipelines/p00/rebuild", s) for s in ("archive", "main")]
    assert 'name="staged"' not in page.text  # no staged version: no such checkbox
    assert 'name="accept_pruned"' in page.text
    fake.staged = True
    assert 'name="staged"' in client.get("/pipelines/p00", headers=_as("admin")).text
    viewer = client.get("/pipelines/p00", headers=_as("viewer"))
    assert viewer.status_code == 200
    assert "data-rebuild" not in viewer.text and "/rebuild" not in viewer.text


def test_a_post_without_edit_access_is_refused(app):
    client, fake = app
    form = {"sink": "main"}
    r = client.post("/pipelines/p00/rebuild", data=form, headers=_as("viewer"))
    assert r.status_code == 403, r.text
    r = client.post("/pipelines/p00/rebuild", data=form, headers=_as("stranger"))
    assert r.status_code == 404, r.text  # may not read it: not found, as if it did not exist
    assert fake.triggered == []


def test_the_first_submit_is_always_a_preview_and_only_it_unlocks_the_rebuild(env, app):
    client, fake = app
    form = {"sink": "archive", "staged": "true", "accept_pruned": "true"}
    r = client.post("/pipelines/p00/rebuild", data=form, headers=_as("admin"))
    assert r.status_code == 303, r.text
    conf = {"sink": "archive", "staged": True, "accept_pruned": True, "dry_run": True}
    assert fake.triggered == [(DAG, conf)]
    page_url = r.headers["location"]
    assert page_url == "/tidemark/pipelines/p00/rebuild/manual__0"
    # A dry_run of its own is refused: the form cannot skip the preview.
    r = client.post(
        "/pipelines/p00/rebuild", data={**form, "dry_run": "false"}, headers=_as("admin")
    )
    assert r.status_code == 400 and "dry_run" in r.text
    # While the preview runs, nor when it failed: no rebuild for real.
    page = client.get(page_url.removeprefix("/tidemark"), headers=_as("admin"))
    assert page.status_code == 200 and "rebuild-for-real" not in page.text
    assert 'http-equiv="refresh"' in page.text
    early = client.post(
        "/pipelines/p00/rebuild", data={"preview": "manual__0"}, headers=_as("admin")
    )
    assert early.status_code == 400 and len(fake.triggered) == 1
    _finish_preview(env, fake, "manual__0")
    page = client.get(page_url.removeprefix("/tidemark"), headers=_as("admin"))
    assert "rebuild-for-real" in page.text and "would commit" in page.text
    assert 'http-equiv="refresh"' not in page.text
    # A reader sees the preview, not the button; and may not press it.
    assert (
        "rebuild-for-real"
        not in client.get(page_url.removeprefix("/tidemark"), headers=_as("viewer")).text
    )
    r = client.post("/pipelines/p00/rebuild", data={"preview": "manual__0"}, headers=_as("viewer"))
    assert r.status_code == 403 and len(fake.triggered) == 1
    # The rebuild for real: the preview's own sink and options, whatever else is sent.
    r = client.post(
        "/pipelines/p00/rebuild",
        data={"preview": "manual__0", "sink": "main"},
        headers=_as("admin"),
    )
    assert r.status_code == 400 and len(fake.triggered) == 1
    r = client.post("/pipelines/p00/rebuild", data={"preview": "manual__0"}, headers=_as("admin"))
    assert r.status_code == 303, r.text
    assert fake.triggered[-1] == (DAG, {**conf, "dry_run": False})
    real = client.get(r.headers["location"].removeprefix("/tidemark"), headers=_as("admin"))
    assert "Preview of a rebuild" not in real.text and "rebuild-for-real" not in real.text
    # A rebuild is not a preview: it unlocks nothing.
    r = client.post("/pipelines/p00/rebuild", data={"preview": "manual__1"}, headers=_as("admin"))
    assert r.status_code == 400 and len(fake.triggered) == 2


def test_a_failed_preview_unlocks_nothing(env, app):
    client, fake = app
    r = client.post("/pipelines/p00/rebuild", data={"sink": "main"}, headers=_as("admin"))
    run_id = r.headers["location"].rsplit("/", 1)[1]
    _finish_preview(env, fake, run_id, ok=False)
    page = client.get(f"/pipelines/p00/rebuild/{run_id}", headers=_as("admin"))
    assert "rebuild-for-real" not in page.text and "Spark failed" in page.text
    r = client.post("/pipelines/p00/rebuild", data={"preview": run_id}, headers=_as("admin"))
    assert r.status_code == 400 and len(fake.triggered) == 1


def test_the_action_in_chromium(env, asgi):
    """The page as a person sees it: the forms under each sink, a preview from a click, its
    page with the rebuild for real once the preview ended; screenshots in
    test-artifacts/rebuild/ (REBUILD_SHOTS overrides it)."""
    import uvicorn
    from playwright.sync_api import expect, sync_playwright

    application, fake = asgi
    fake.staged = True
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until the server accepts them
    port = sock.getsockname()[1]
    from starlette.applications import Starlette
    from starlette.routing import Mount

    mounted = Starlette(routes=[Mount("/tidemark", app=application)])  # as Airflow mounts it
    server = uvicorn.Server(uvicorn.Config(mounted, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}/tidemark"
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            context = browser.new_context(
                viewport={"width": 1400, "height": 900}, extra_http_headers=_as("admin")
            )
            page = context.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on(
                "response",
                lambda r: r.status >= 400 and "/tidemark/" in r.url and problems.append(r.url),
            )
            page.goto(f"{base}/pipelines/p00?days=1")
            form = page.locator("form[data-rebuild=archive]")
            expect(form).to_be_visible()
            expect(form.get_by_label("with the staged version")).to_be_visible()
            expect(page.locator("[data-drawn]").first).to_be_visible()
            page.screenshot(path=SHOTS / "01-pipeline-rebuild-action.png", full_page=True)
            form.get_by_label("accept pruned records").check()
            form.get_by_role("button", name="Preview rebuild").click()
            expect(page.locator("#sink")).to_have_text("archive")
            assert fake.triggered == [
                (DAG, {"sink": "archive", "staged": False, "accept_pruned": True, "dry_run": True})
            ]
            _finish_preview(env, fake, "manual__0")
            page.reload()
            expect(page.get_by_role("button", name="Rebuild for real")).to_be_visible()
            page.screenshot(path=SHOTS / "02-preview-done.png", full_page=True)
            page.get_by_role("button", name="Rebuild for real").click()
            expect(page.locator("h1")).to_contain_text("Rebuild")
            assert fake.triggered[-1][1]["dry_run"] is False
            browser.close()
        assert problems == []
    finally:
        server.should_exit = True
        thread.join(timeout=30)
