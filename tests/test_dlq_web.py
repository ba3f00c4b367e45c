"""The Dead letters plugin in a real Airflow 3.3 (API server, scheduler, DAG processor), the
session's (tests/airflow_site.py): Airflow's auth manager in front of every route, read vs
edit rights, CSRF and origin checks, filters and injection over HTTP, escaping, Data Docs
confinement, redrive through the pipeline's redrive DAG, bounded bodies and payloads, and
answers that say no more than needed (a letter one may not see is not found; no ledger host;
no server paths)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote, unquote

import httpx
import psycopg
import pytest
from fastapi.routing import APIRoute

from tests.airflow_site import SCOPED_USER  # sees and edits the pipeline orders only
from tests.conftest import REPO, Env
from tests.test_dlq import INJECTIONS, add, exported
from tidemark.devstack.airflow_stack import Stack
from tidemark.ledger import redrives

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]


PIPELINES = (REPO / "dags" / "tidemark_pipelines.py").read_text()
XSS = b"<script>window.pwned=1</script>"
AIRFLOW_RUN = {
    "dag_id": "tidemark_orders",
    "run_id": "manual__2026-03-01T12:00:00+00:00",
    "task_id": "replay",
    "try_number": 2,
}


@dataclass
class Site:
    env: Env
    stack: Stack
    ids: dict[str, int]
    docs: Path
    secret: Path
    admin: str  # JWTs
    viewer: str
    scoped: str  # may see and edit the pipeline orders only (tests/scoped_auth.py)

    def client(self, token: str | None = None, cookie: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.stack.url,
            timeout=60,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            cookies={"_token": cookie} if cookie else None,
        )

    def csrf(self, jwt: str) -> str:
        """The CSRF token a page rendered for this session embeds in its forms."""
        with self.client(cookie=jwt) as c:
            return form_token(c)

    def letter(self, rid: int) -> tuple:
        return self.env.ledger(
            "SELECT status::text, resolved_by, note FROM tidemark.dlq WHERE id = %s", (rid,)
        )[0]

    def count(self) -> int:
        return self.env.ledger("SELECT count(*) FROM tidemark.dlq")[0][0]

    def request(self, request_id: int) -> tuple[str, str, list[int]]:
        """A redrive request: (pipeline, requested_by, its letters' ids)."""
        pipeline, by = self.env.ledger(
            "SELECT pipeline, requested_by FROM tidemark.redrive_requests WHERE request_id = %s",
            (request_id,),
        )[0]
        ids = [
            i
            for (i,) in self.env.ledger(
                "SELECT letter_id FROM tidemark.redrive_letters WHERE request_id = %s ORDER BY 1",
                (request_id,),
            )
        ]
        return pipeline, by, ids


def form_token(c: httpx.Client) -> str:
    page = c.get("/tidemark/dlq/")
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf_token" value="([0-9a-f]*)"', page.text)[1]


def _seed(env: Env, docs_page: Path) -> dict[str, int]:
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders'), ('other')")
        run = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner, dag_id, dag_run_id, "
            "task_id, try_number) VALUES ('orders', 'run', 'test:1', %(dag_id)s, "
            "%(run_id)s, %(task_id)s, %(try_number)s) RETURNING run_id",
            AIRFLOW_RUN,
        ).fetchone()[0]
        c.execute(
            "INSERT INTO tidemark.dq_results (run_id, success, docs_path) VALUES (%s, false, %s)",
            (run, str(docs_page)),
        )
        return {
            "xss": add(
                c,
                run_id=run,
                payload=XSS,
                key=b"<k>",
                headers={"h": "<b>bold</b>"},
                reason="<img src=x onerror=alert(1)>",
            ),
            "json": add(c, run_id=run, cls="validation", payload=b'{"id": 7, "amount": 1e9}'),
            "binary": add(c, run_id=run, sink="archive", cls="transform", payload=bytes(range(40))),
            "done": add(c, run_id=run, status="discarded"),
            "victim": add(c, run_id=run),
            "csrf": add(c, run_id=run),
            "redrive1": add(c, run_id=run, cls="sink_write"),
            "redrive2": add(c, run_id=run, cls="sink_write"),
            "other": add(c, run_id=run, pipeline="other", cls="dq_gate"),
            "cli_run": add(
                c,
                run_id=c.execute(
                    "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES ('orders', 'run', "
                    "'host:2') RETURNING run_id"
                ).fetchone()[0],
                status="redriven",
                resolved_by="carol",
                note="fixed upstream",
                payload=None,
                key=None,
            ),
            "no_run": add(c, run_id=424_242, status="discarded"),
        }


@pytest.fixture(scope="module")
def site(airflow_site, pg, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dlqweb")
    env = Env(pg, tmp)
    docs = tmp / "docs"
    site_root = docs / "orders" / "gx" / "uncommitted" / "data_docs" / "local_site"
    page = site_root / "validations" / "run 1.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html><body>GX validation result</body></html>")
    secret = tmp / "secret.txt"
    secret.write_text("not for the web")
    (site_root / "escape.txt").symlink_to(secret)
    # The rest of the GX project is not the site: its config and stored results stay private.
    (docs / "orders" / "gx" / "great_expectations.yml").write_text("not for the web")
    (docs / "orders" / "gx" / "uncommitted" / "validations").mkdir()
    (docs / "orders" / "gx" / "uncommitted" / "validations" / "r.json").write_text(
        "not for the web"
    )
    ids = _seed(env, page)
    env.pipeline("orders")
    dags = airflow_site.enter("test_dlq_web", env.ledger_dsn, docs)
    try:
        shutil.move(env.dir, dags / "pipelines")
        env.dir = dags / "pipelines"
        (dags / "tidemark_pipelines.py").write_text(PIPELINES)
        stack = airflow_site.stack
        airflow_site.wait_dags(dags, ["tidemark_orders", "tidemark_orders_redrive"])
        yield Site(
            env,
            stack,
            ids,
            docs,
            secret,
            stack.token("admin"),
            stack.token("viewer"),
            stack.token(SCOPED_USER),
        )
    finally:
        airflow_site.leave(dags)
        env.drop()


def test_plugin_is_in_airflows_navigation(site):
    with site.client(site.admin) as c:
        plugins = c.get("/api/v2/plugins").json()["plugins"]
    mine = next(p for p in plugins if p["name"] == "tidemark_dlq")
    assert mine["fastapi_apps"][0]["url_prefix"] == "/tidemark"
    view = mine["external_views"][0]
    assert (view["name"], view["href"], view["destination"], view["url_route"]) == (
        "Dead letters",
        "/tidemark/dlq/",
        "nav",
        "dead-letters",
    )


def _routes() -> list[tuple[str, str]]:
    from tidemark.web.app import app

    assert all(isinstance(r, APIRoute) for r in app.routes), app.routes
    fill = {
        "record_id": "1",
        "pipeline": "orders",
        "path": "index.html",
        "name": "dlq.css",
        "dag_run_id": "manual__2026-03-01T12:00:00+00:00",
    }
    return [
        (m, "/tidemark" + re.sub(r"\{(\w+)(:\w+)?\}", lambda x: fill[x[1]], r.path))
        for r in app.routes
        for m in sorted(r.methods)
    ]


def test_every_route_refuses_the_anonymous(site):
    routes = _routes()
    assert len(routes) >= 11
    for creds in (
        {},
        {"headers": {"Authorization": "Bearer not-a-jwt"}},
        {"cookies": {"_token": "forged"}},
    ):
        with httpx.Client(base_url=site.stack.url, timeout=60, **creds) as c:
            for method, path in routes:
                body = {"ids": [site.ids["victim"]], "note": "x"} if method == "POST" else None
                r = c.request(method, path, json=body)
                machine = ("/dlq/api/", "/dlq/static/", "/pipelines/api/", "/pipelines/static/")
                api = any(m in path for m in machine) or method != "GET"
                if api:
                    assert r.status_code == 401, (method, path, creds, r.text)
                    assert r.json()["detail"].startswith("not authenticated")
                else:
                    assert r.status_code == 303, (method, path, creds, r.text)
                    assert r.headers["location"].startswith("/auth/login?next=%2Ftidemark%2F")
    assert site.letter(site.ids["victim"])[0] == "quarantined"


def test_viewer_reads_but_may_not_discard_or_redrive(site):
    with site.client(site.viewer) as c:
        listed = c.get("/tidemark/dlq/api/records", params={"pipeline": "orders"})
        assert listed.status_code == 200
        assert site.ids["victim"] in [r["id"] for r in listed.json()["records"]]
        assert c.get(f"/tidemark/dlq/api/records/{site.ids['json']}").status_code == 200
        page = c.get("/tidemark/dlq/")
        assert page.status_code == 200 and 'name="ids"' in page.text
        assert 'id="discard"' not in page.text  # no buttons for what they may not do
        for action, body in (("discard", {"note": "x"}), ("redrive", {})):
            r = c.post(f"/tidemark/dlq/api/{action}", json={"ids": [site.ids["victim"]], **body})
            assert r.status_code == 403, r.text
            assert r.json()["detail"] == (
                "viewer may not change dead letters of orders: needs "
                "edit access to DAG tidemark_orders"
            )
    assert site.letter(site.ids["victim"]) == ("quarantined", None, None)


def test_admin_discards_with_a_note(site):
    victim, done = site.ids["victim"], site.ids["done"]
    with site.client(site.admin) as c:
        for body, needle in (
            ({"ids": [victim], "note": "  "}, "note: required"),
            ({"ids": [victim]}, "note: required"),
            ({"ids": ["7x"], "note": "n"}, "ids: '7x' is not a dead-letter id"),
            ({"note": "n"}, "ids: select at least one"),
        ):
            r = c.post("/tidemark/dlq/api/discard", json=body)
            assert r.status_code == 400 and needle in r.json()["detail"], r.text
        r = c.post(
            "/tidemark/dlq/api/discard", content=b"ids=1", headers={"Content-Type": "text/plain"}
        )
        assert r.status_code == 400 and "content type" in r.json()["detail"]
        assert site.letter(victim)[0] == "quarantined"
        r = c.post(
            "/tidemark/dlq/api/discard",
            json={"ids": [victim, done, 99_999], "note": "duplicate of order 7"},
        )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "discarded": [victim],
        "by": "admin",
        "skipped": [
            {"id": done, "reason": "already discarded"},
            {"id": 99_999, "reason": "no such dead letter"},
        ],
    }
    assert site.letter(victim) == ("discarded", "admin", "duplicate of order 7")
    at = site.env.ledger(
        "SELECT resolved_at IS NOT NULL FROM tidemark.dlq WHERE id = %s", (victim,)
    )
    assert at == [(True,)]


def test_cookie_posts_need_the_csrf_token_and_our_origin(site):
    rid = site.ids["csrf"]
    with site.client(cookie=site.admin) as c:
        token = form_token(c)
        body = {"ids": [rid], "note": "csrf"}
        r = c.post("/tidemark/dlq/api/discard", json=body)
        assert r.status_code == 403 and "CSRF" in r.json()["detail"]
        r = c.post(
            "/tidemark/dlq/api/discard", json=body, headers={"X-CSRF-Token": site.csrf(site.viewer)}
        )
        assert r.status_code == 403
        r = c.post(
            "/tidemark/dlq/api/discard",
            data={"ids": str(rid), "note": "csrf", "csrf_token": token},
            headers={"Origin": "http://evil.example"},
        )
        assert r.status_code == 403 and "cross-origin" in r.text
        assert site.letter(rid)[0] == "quarantined"
        r = c.post(
            "/tidemark/dlq/api/discard",
            data={
                "ids": str(rid),
                "note": "form post",
                "csrf_token": token,
                "back": "pipeline=orders&evil=//x.example",
            },
            headers={"Origin": site.stack.url},
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert f"Discarded 1 dead letter(s): {rid}" in r.text
    assert 'href="/tidemark/dlq/?pipeline=orders"' in r.text
    assert site.letter(rid) == ("discarded", "admin", "form post")
    with site.client(site.admin) as c:  # a Bearer token is no cookie: no CSRF token needed
        r = c.post(
            "/tidemark/dlq/api/export",
            json={"ids": [rid]},
            headers={"Origin": "http://evil.example"},
        )
        assert r.status_code == 403  # but never from another origin


def test_filters_and_injection_over_http(site):
    ids = site.ids
    before = site.count()
    with site.client(site.admin) as c:

        def listed(**params) -> list[int]:
            r = c.get("/tidemark/dlq/api/records", params=params)
            assert r.status_code == 200, r.text
            return [x["id"] for x in r.json()["records"]]

        assert listed(pipeline="other") == [ids["other"]]
        assert listed(error_class="transform") == [ids["binary"]]
        assert listed(sink="archive") == [ids["binary"]]
        assert listed(pipeline="orders", error_class="sink_write", status="quarantined") == [
            ids["redrive2"],
            ids["redrive1"],
        ]
        assert ids["done"] in listed(status="discarded")
        assert listed(ids=f"{ids['json']},{ids['xss']}") == [ids["json"], ids["xss"]]
        assert listed(since="2030-01-01T00:00:00Z") == []
        first = c.get("/tidemark/dlq/api/records", params={"limit": 2}).json()
        older = listed(limit=2, before=first["next_before"])
        assert len(first["records"]) == 2 and older and max(older) < first["next_before"]

        for name in (
            "pipeline",
            "sink",
            "error_class",
            "status",
            "since",
            "until",
            "ids",
            "limit",
            "before",
        ):
            for evil in INJECTIONS:
                r = c.get("/tidemark/dlq/api/records", params={name: evil})
                assert r.status_code == 400, (name, evil, r.text)
                assert name in r.json()["detail"] and "\n" not in r.json()["detail"]
                r = c.get("/tidemark/dlq/", params={name: evil})
                assert r.status_code == 400 and "Traceback" not in r.text
        r = c.get("/tidemark/dlq/api/records/1 OR 1=1")
        assert (
            r.status_code == 400 and r.json()["detail"] == "id '1 OR 1=1': not a positive integer"
        )
        r = c.post("/tidemark/dlq/api/discard", json={"ids": [INJECTIONS[1]], "note": "x"})
        assert r.status_code == 400
        assert c.get("/tidemark/dlq/api/records/99999").status_code == 404
    assert site.count() == before


def test_record_page_escapes_everything_and_links_the_run(site):
    with site.client(site.admin) as c:
        r = c.get(f"/tidemark/dlq/record/{site.ids['xss']}")
        assert r.status_code == 200
        html = r.text
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp
        assert "<script>window.pwned" not in html and "<img src=x" not in html
        assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in html
        assert "&lt;img src=x onerror=alert(1)&gt;" in html
        assert "&lt;b&gt;bold&lt;/b&gt;" in html and "&lt;k&gt;" in html
        assert re.findall(r"<script[^>]*>", html) == [
            '<script src="/tidemark/dlq/static/dlq.js" defer>'
        ]
        run_url = "/dags/tidemark_orders/runs/manual__2026-03-01T12%3A00%3A00%2B00%3A00"
        assert f'href="{run_url}"' in html
        assert f'href="{run_url}/tasks/replay?try_number=2"' in html
        assert "/dlq/docs/" not in html  # Data Docs only for validation and dq_gate

        r = c.get(f"/tidemark/dlq/record/{site.ids['json']}")
        assert "Pretty JSON" in r.text and "&#34;amount&#34;: 1000000000.0" in r.text
        docs = re.search(r'href="(/tidemark/dlq/docs/[^"]+)"', r.text)[1]
        assert docs == "/tidemark/dlq/docs/orders/validations/run%201.html"
        page = c.get(docs)
        assert page.status_code == 200 and "GX validation result" in page.text
        assert page.headers["content-security-policy"].startswith("sandbox")

        r = c.get(f"/tidemark/dlq/record/{site.ids['cli_run']}")  # not started by Airflow
        assert r.status_code == 200 and "/dags/" not in r.text and "No payload." in r.text
        assert "carol" in r.text and "fixed upstream" in r.text
        r = c.get(f"/tidemark/dlq/record/{site.ids['no_run']}")
        assert r.status_code == 200 and "(not in the ledger)" in r.text
        r = c.get(f"/tidemark/dlq/record/{site.ids['binary']}", params={"format": "hex"})
        assert "00000000  00 01 02 03" in r.text
        api = c.get(f"/tidemark/dlq/api/records/{site.ids['xss']}").json()
        assert base64.b64decode(api["payload"]) == XSS
        assert api["payload_rendered"] == {"kind": "text", "text": XSS.decode()}
        assert api["links"]["task_log"].endswith("/tasks/replay?try_number=2")


def test_data_docs_styles_are_the_ones_great_expectations_names_and_no_script_runs():
    """The contract with GX's Data Docs templates: every remote stylesheet they link is one
    DOCS_CSP allows (else a GX upgrade renders the pages unstyled: update DOCS_STYLES), and
    the policy runs none of their remote scripts, sends nothing anywhere."""
    import great_expectations

    from tidemark.web.pages import DOCS_CSP, DOCS_STYLES

    templates = Path(great_expectations.__file__).parent / "render" / "view" / "templates"
    html = "".join(p.read_text() for p in templates.rglob("*.j2"))
    sheets = set(re.findall(r'<link[^>]*href="(https://[^"]+\.css)"', html))
    scripts = set(re.findall(r'<script[^>]*src="(https://[^"]+)"', html))
    assert sheets and scripts, "GX's templates moved: find their stylesheets and scripts again"
    assert {u for u in sheets if not u.startswith(DOCS_STYLES)} == set()
    policy = dict(d.strip().split(" ", 1) for d in DOCS_CSP.split(";"))
    assert policy["sandbox"] == "allow-popups"  # no allow-scripts, no allow-same-origin
    assert policy["script-src"] == "'none'" and policy["connect-src"] == "'none'"
    assert policy["img-src"] == "'self' data:" and policy["default-src"] == "'none'"


def test_data_docs_are_served_only_from_their_folder(site):
    with site.client(site.admin) as c:
        assert c.get("/tidemark/dlq/docs/orders/validations/run%201.html").status_code == 200
        for path in (
            "orders/%2e%2e/secret.txt",
            "orders/validations/%2e%2e/%2e%2e/secret.txt",
            "orders/escape.txt",
            "orders/%2fetc%2fpasswd",
            "orders/..%2fsecret.txt",
            "orders/%2e%2e/%2e%2e/great_expectations.yml",
            "orders/%2e%2e/validations/r.json",
            "orders/gx/great_expectations.yml",
            "gx/great_expectations.yml",
            "orders/",
            "%2e%2e/orders/validations/run%201.html",
            "other/index.html",
            "orders/validations",
        ):
            r = c.get(f"/tidemark/dlq/docs/{path}")
            assert r.status_code == 404, (path, r.text)
            assert "not for the web" not in r.text


def test_counts_and_export(site):
    with site.client(site.viewer) as c:
        counts = c.get("/tidemark/dlq/api/counts").json()
        assert counts["pipelines"]["other"] == {
            "decode": 0,
            "transform": 0,
            "validation": 0,
            "dq_gate": 1,
            "sink_write": 0,
        }
        assert (
            counts["total"]
            == site.env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'quarantined'")[0][
                0
            ]
        )
        r = c.get("/tidemark/dlq/api/export", params={"pipeline": "orders", "status": "any"})
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    recs = {x["id"]: x for x in exported(r.text.splitlines())}
    assert site.ids["other"] not in recs and site.ids["done"] in recs
    assert base64.b64decode(recs[site.ids["binary"]]["payload"]) == bytes(range(40))
    assert base64.b64decode(recs[site.ids["xss"]]["key"]) == b"<k>"


def test_list_page_offers_bulk_selection(site):
    with site.client(cookie=site.admin) as c:
        html = c.get("/tidemark/dlq/", params={"pipeline": "orders", "limit": 2}).text
    assert 'id="select-all"' in html and html.count('class="row-select"') == 2
    assert 'name="note"' in html and 'id="discard"' in html and 'id="redrive"' in html
    assert 'id="older"' in html and "sink_write <b>2</b>" in html


def test_redrive_triggers_the_pipelines_redrive_dag(site):
    dag = "tidemark_orders_redrive"
    site.stack.wait_dag(dag)
    ids = site.ids
    with site.stack.api(site.admin) as api:
        # Paused, the run stays queued: this test is about the trigger, not Spark.
        api.patch(f"/dags/{dag}", json={"is_paused": True}).raise_for_status()
        with site.client(site.admin) as c:
            r = c.post(
                "/tidemark/dlq/api/redrive",
                json={"ids": [ids["redrive2"], ids["redrive1"], ids["done"], 99_999]},
            )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["errors"] == []
        assert out["skipped"] == [
            {"id": 99_999, "reason": "no such dead letter"},
            {"id": ids["done"], "reason": "already discarded"},
        ]
        (run,) = out["runs"]
        assert (run["dag_id"], run["ids"], run["paused"]) == (
            dag,
            [ids["redrive1"], ids["redrive2"]],
            True,
        )
        got = api.get(f"/dags/{dag}/dagRuns/{run['dag_run_id']}").json()
        # Only the ledger request's id goes to Airflow; its letters are in the ledger.
        assert got["conf"] == {"request": run["request"], "requested_by": "admin"}
        assert got["triggering_user_name"] == "admin"
        assert site.request(run["request"]) == (
            "orders",
            "admin",
            [ids["redrive1"], ids["redrive2"]],
        )

        with site.client(cookie=site.admin) as c:  # the list page's form
            r = c.post(
                "/tidemark/dlq/api/redrive",
                headers={"Origin": site.stack.url},
                data={"ids": [str(ids["json"])], "csrf_token": site.csrf(site.admin)},
            )
        assert r.status_code == 200 and "Triggered" in r.text
        run_id = re.search(r"/dags/tidemark_orders_redrive/runs/([^\"]+)\"", r.text)[1]
        got = api.get(f"/dags/{dag}/dagRuns/{run_id}").json()
        assert site.request(got["conf"]["request"])[2] == [ids["json"]]
    assert site.letter(ids["redrive1"])[0] == "quarantined"  # the DAG does that, not the UI


def test_the_pipelines_rebuild_action_triggers_a_preview_of_the_rebuild_dag(site):
    """The Pipelines page's Rebuild form (tidemark/web/rebuild.py; tests/test_rebuild_web.py
    has its flow in-process) against the real API server: the rebuild DAG's Params read from
    Airflow, the cookie form's CSRF token, the trigger as the caller with dry_run true."""
    dag = "tidemark_orders_rebuild"
    site.stack.wait_dag(dag)
    # A sink with a checkpoint has its section (and form) on the page.
    site.env.ledger(
        "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset) "
        "VALUES ('orders', 'main', 0, 0) RETURNING 1"
    )
    try:
        with site.stack.api(site.admin) as api:
            # Paused, the run stays queued: this test is about the trigger, not Spark.
            api.patch(f"/dags/{dag}", json={"is_paused": True}).raise_for_status()
            with site.client(site.viewer) as c:  # reads every DAG, edits none
                page = c.get("/tidemark/pipelines/orders")
                assert page.status_code == 200 and "data-rebuild" not in page.text
                r = c.post("/tidemark/pipelines/orders/rebuild", json={"sink": "main"})
                assert r.status_code == 403, r.text
            with site.client(cookie=site.admin) as c:
                page = c.get("/tidemark/pipelines/orders")
                form = re.search(r'<form[^>]*data-rebuild="main">(.*?)</form>', page.text, re.S)
                assert form, page.text
                assert 'name="staged"' not in form[1]  # no orders.next.yaml
                token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', form[1])[1]
                r = c.post(
                    "/tidemark/pipelines/orders/rebuild",
                    data={"sink": "main", "accept_pruned": "true"},
                    headers={"Origin": site.stack.url},
                )
                assert r.status_code == 403 and "CSRF" in r.text
                r = c.post(
                    "/tidemark/pipelines/orders/rebuild",
                    data={"sink": "main", "accept_pruned": "true", "csrf_token": token},
                    headers={"Origin": site.stack.url},
                )
                assert r.status_code == 303, r.text
                where = r.headers["location"]
                assert where.startswith("/tidemark/pipelines/orders/rebuild/")
                run_id = unquote(where.rsplit("/", 1)[1])
                got = api.get(f"/dags/{dag}/dagRuns/{quote(run_id, safe='')}").json()
                assert got["conf"] == {
                    "sink": "main",
                    "staged": False,
                    "accept_pruned": True,
                    "dry_run": True,
                }
                assert got["triggering_user_name"] == "admin"
                page = c.get(where)
                assert page.status_code == 200 and "The DAG is paused" in page.text
                assert "rebuild-for-real" not in page.text  # the preview has not run
                r = c.post(
                    "/tidemark/pipelines/orders/rebuild",
                    data={"preview": run_id, "csrf_token": token},
                    headers={"Origin": site.stack.url},
                )
                assert r.status_code == 400 and "not a preview that ended" in r.text
            runs = api.get(f"/dags/{dag}/dagRuns").json()["dag_runs"]
            assert [x["dag_run_id"] for x in runs] == [run_id]
    finally:
        site.env.ledger("DELETE FROM tidemark.checkpoints WHERE pipeline = 'orders' RETURNING 1")


def test_a_record_shows_the_headers_as_the_source_had_them_and_the_source_time(site):
    """Not the jsonb copy (reordered, \\u0000 base64-wrapped); a letter from before ledger
    V007 whose record the source no longer held shows the jsonb copy and says why."""
    from markupsafe import escape

    from tidemark.ledger import letters

    exact = '{"b": 1,  "a": "x\\u0000y"}'
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(
            c,
            headers={"_tm_unstorable_headers_base64": "eA=="},
            source_headers=exact.encode(),
            source_kept=True,
            source_ts=datetime(2026, 3, 1, 12, 34, 56, 789012, tzinfo=UTC),
        )
        old = add(c, headers={"z": 1}, source_kept=False, source_note=letters.SOURCE_GONE)
    with site.client(site.admin) as c:
        page = c.get(f"/tidemark/dlq/record/{rid}").text
        assert f'<pre id="headers">{escape(exact)}</pre>' in page
        assert '<dd id="source-ts">2026-03-01 12:34:56 UTC</dd>' in page
        api = c.get(f"/tidemark/dlq/api/records/{rid}").json()
        assert base64.b64decode(api["source_headers"]).decode() == exact
        assert api["source_ts"] == "2026-03-01T12:34:56.789012+00:00"
        page = c.get(f"/tidemark/dlq/record/{old}").text
        assert "&#34;z&#34;: 1" in page and str(escape(letters.SOURCE_GONE)) in page


# -- bounded payloads ---------------------------------------------------------------------------
def test_a_10_mb_payload_shows_a_bounded_page_and_downloads_whole(site):
    payload = b'{"blob": "' + base64.b64encode(os.urandom(7_500_000)) + b'"}'  # 10 MB of text
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c, payload=payload)
        nested = add(c, payload=b"[" * 100_000)  # json.loads: RecursionError, not ValueError
    with site.client(site.admin) as c:
        page = c.get(f"/tidemark/dlq/record/{rid}")
        assert page.status_code == 200, page.text
        assert len(page.content) < 400_000  # 256 KiB of the payload, escaped, and the page
        assert (
            "first 262,144 bytes" in page.text
            and f"{len(payload) - 262_144:,} more bytes" in page.text
        )
        href = re.search(r'href="([^"]+)" id="download-payload"', page.text)[1]
        assert href == f"/tidemark/dlq/api/records/{rid}/payload"
        api = c.get(f"/tidemark/dlq/api/records/{rid}")
        assert api.status_code == 200 and len(api.content) < 800_000
        rec = api.json()
        assert (rec["payload"], rec["payload_size"], rec["payload_complete"]) == (
            None,
            len(payload),
            False,
        )
        assert rec["payload_download"] == href
        with c.stream("GET", href) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
            assert (
                r.headers["content-disposition"] == f'attachment; filename="dead-letter-{rid}.bin"'
            )
            digest, got = hashlib.sha256(), 0
            for chunk in r.iter_bytes():
                digest.update(chunk)
                got += len(chunk)
        assert (got, digest.hexdigest()) == (len(payload), hashlib.sha256(payload).hexdigest())
        small = c.get(f"/tidemark/dlq/api/records/{site.ids['binary']}/payload")
        assert small.content == bytes(range(40))

        r = c.get(f"/tidemark/dlq/record/{nested}")
        assert r.status_code == 200, r.text
        assert "shown as text" in r.text and "[[[[[[[[" in r.text
        assert (
            c.get(f"/tidemark/dlq/api/records/{nested}").json()["payload_rendered"]["kind"]
            == "text"
        )
        r = c.get(f"/tidemark/dlq/api/records/{nested}", params={"format": "json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["detail"]
    with site.client(site.viewer) as c:  # read access is enough for the bytes; none: 401
        assert c.get(href).status_code == 200
    assert httpx.get(site.stack.url + href).status_code == 401


def test_export_streams_big_letters_whole(site):
    payloads = [os.urandom(3_000_000) for _ in range(3)]
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        ids = [add(c, pipeline="other", payload=p) for p in payloads]
    with (
        site.client(site.admin) as c,
        c.stream("GET", "/tidemark/dlq/api/export", params={"ids": ",".join(map(str, ids))}) as r,
    ):
        assert r.status_code == 200
        lines = exported(r.iter_lines())
    assert [x["id"] for x in lines] == ids
    assert [base64.b64decode(x["payload"]) for x in lines] == payloads


def _cut_the_ledger(site: Site) -> int:
    """SIGTERM-equivalent for the server's ledger session mid-stream: the backend serving a
    download or export is terminated, as a PostgreSQL restart or failover would."""
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        return c.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND xact_start IS NOT NULL"
        ).fetchone()[0]


def test_an_export_or_download_cut_midway_is_a_broken_transfer_never_a_clean_one(site):
    """Once the first byte is sent the status is 200 and cannot change: a failure after it
    must abort the connection, so no client takes a cut export for a whole one. A whole
    export ends with a trailer that counts its letters."""
    payloads = [os.urandom(1_500_000) for _ in range(12)]  # about 2 MiB a line in base64
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        ids = [add(c, pipeline="other", payload=p) for p in payloads]
    query = {"ids": ",".join(map(str, ids))}
    with site.client(site.admin) as c:
        whole = c.get("/tidemark/dlq/api/export", params=query).text.splitlines()
        assert [x["id"] for x in exported(whole)] == ids
        lines: list[str] = []
        with (
            pytest.raises(httpx.TransportError),
            c.stream("GET", "/tidemark/dlq/api/export", params=query) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if not lines:
                    assert _cut_the_ledger(site) == 1
                lines.append(line)
        assert 0 < len([x for x in lines if x]) < 12
        assert not any("tidemark_export_end" in x for x in lines)
        with psycopg.connect(site.env.ledger_dsn, autocommit=True) as conn:
            big = os.urandom(40_000_000)  # more than the sockets between hold: still sending
            rid = add(conn, pipeline="other", payload=big)
        got = b""
        with (
            pytest.raises(httpx.TransportError),
            c.stream("GET", f"/tidemark/dlq/api/records/{rid}/payload") as r,
        ):
            for chunk in r.iter_bytes():
                if not got:
                    assert _cut_the_ledger(site) == 1
                got += chunk
        assert 0 < len(got) < len(big)


# -- bounded request bodies ---------------------------------------------------------------------
def test_request_bodies_are_capped_before_auth_and_parsing(site):
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c)
    big = {"ids": [rid], "note": "x" * 3_000_000}
    url = "/tidemark/dlq/api/discard"

    def chunked():  # no Content-Length: the cap counts the bytes as they come
        data = json.dumps(big).encode()
        for i in range(0, len(data), 64 * 1024):
            yield data[i : i + 64 * 1024]

    for creds in ({}, {"token": site.admin}):
        with site.client(**creds) as c:
            r = c.post(url, json=big)
            assert r.status_code == 413, (creds, r.text)
            assert r.json()["detail"].startswith("request body too large: at most 2,097,152")
            assert r.headers["content-security-policy"].startswith("default-src 'none'")
            r = c.post(url, content=chunked(), headers={"Content-Type": "application/json"})
            if creds:
                assert r.status_code == 413 and "too large" in r.json()["detail"], r.text
            else:  # not signed in: refused before a byte of the body is read
                assert r.status_code == 401, r.text
    with site.client(cookie=site.admin) as c:  # a form gets the error page
        token = form_token(c)
        r = c.post(url, data={"ids": str(rid), "note": "x" * 3_000_000, "csrf_token": token})
        assert r.status_code == 413 and r.headers["content-type"].startswith("text/html")
        assert "request body too large" in r.text
        assert site.letter(rid)[0] == "quarantined"
        r = c.post(
            url,
            data={"ids": str(rid), "note": "fits", "csrf_token": token, "padding": "y" * 1_500_000},
        )  # under the cap: parsed as usual
    assert r.status_code == 200 and f"Discarded 1 dead letter(s): {rid}" in r.text
    assert site.letter(rid)[:2] == ("discarded", "admin")


def _raw(site, request: bytes) -> bytes:
    """Send ``request`` as it is and read the answer's status line and headers (a client
    that trickles a body, or sends one where none belongs: httpx does neither)."""
    host, port = site.stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = sock.recv(4096)  # blocks until the server answers: the event we await
            if not got:
                break
            answer += got
    return answer


def test_a_trickled_body_is_cut_off_and_bodies_where_none_belong_are_refused(site):
    """A chunked body that stops arriving holds the connection for at most the body time
    limit, then gets a 408; a caller who is not signed in is answered 401 before a byte of
    the body is read (a promised megabyte that never comes); a GET with a body is a 400."""
    url = "/tidemark/dlq/api/discard"
    answer = _raw(
        site,
        (
            f"POST {url} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer {site.admin}"
            f'\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{{"ids\r\n'
        ).encode(),
    )
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    answer = _raw(
        site,
        (
            f"POST {url} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: 1000000\r\n\r\n"
        ).encode(),
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    answer = _raw(
        site, b"GET /tidemark/dlq/api/records HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    with site.client(token=site.admin) as c:  # a GET without a body is as it was
        assert c.get("/tidemark/dlq/api/records", params={"limit": 1}).status_code == 200


# -- CSRF ---------------------------------------------------------------------------------------
def test_csrf_tokens_are_masked_per_page_and_outlive_airflows_token_refresh(site):
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        first, second, third = add(c), add(c), add(c)
    with site.client(cookie=site.admin) as c:
        t1, t2 = form_token(c), form_token(c)
    assert t1 != t2 and len(t1) == len(t2) == 128  # never the same bytes twice (BREACH)
    viewer = site.csrf(site.viewer)
    # Airflow's refresh middleware replaces the _token cookie with a new JWT while a page
    # stays open: the form rendered under the old one still posts.
    refreshed = site.stack.token("admin")
    assert refreshed != site.admin
    url = "/tidemark/dlq/api/discard"
    with site.client(cookie=refreshed) as c:
        for rid, token in ((first, t1), (second, t2)):
            r = c.post(url, data={"ids": str(rid), "note": "old form", "csrf_token": token})
            assert r.status_code == 200 and "Discarded 1" in r.text, r.text
        tampered = t1[:-1] + ("0" if t1[-1] != "0" else "1")
        for bad in (viewer, tampered, t1[:64], "zz" * 64, ""):  # another user's, broken ones
            r = c.post(url, data={"ids": str(third), "note": "x", "csrf_token": bad})
            assert r.status_code == 403 and "CSRF token" in r.text, bad
            r = c.post(
                url,
                json={"ids": [third], "note": "x"},
                headers={"X-CSRF-Token": bad} if bad else {},
            )
            assert r.status_code == 403, bad
    assert site.letter(first)[0] == site.letter(second)[0] == "discarded"
    assert site.letter(third)[0] == "quarantined"


# -- answers that say no more than needed -------------------------------------------------------
def test_letters_one_may_not_see_are_not_found(site):
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        hidden, mine = add(c, pipeline="other"), add(c)
    missing = 99_998
    with site.client(site.scoped) as c:
        listed = [
            x["id"]
            for x in c.get("/tidemark/dlq/api/records", params={"status": "any"}).json()["records"]
        ]
        assert mine in listed and hidden not in listed
        r = c.get("/tidemark/dlq/api/records", params={"pipeline": "other", "status": "any"})
        assert r.status_code == 200 and r.json()["records"] == []
        for path in (
            "/tidemark/dlq/api/records/{}",
            "/tidemark/dlq/api/records/{}/payload",
            "/tidemark/dlq/record/{}",
        ):
            seen, absent = c.get(path.format(hidden)), c.get(path.format(missing))
            assert seen.status_code == absent.status_code == 404, (path, seen.text)
            assert re.sub(rf"\b{hidden}\b", "N", seen.text) == re.sub(
                rf"\b{missing}\b", "N", absent.text
            )
            assert "other" not in seen.text
        r = c.post(
            "/tidemark/dlq/api/discard", json={"ids": [hidden, missing, mine], "note": "scoped"}
        )
        assert r.status_code == 200, r.text
        assert r.json() == {
            "discarded": [mine],
            "by": SCOPED_USER,
            "skipped": [
                {"id": hidden, "reason": "no such dead letter"},
                {"id": missing, "reason": "no such dead letter"},
            ],
        }
        r = c.post("/tidemark/dlq/api/redrive", json={"ids": [hidden, missing]})
        assert r.status_code == 200 and r.json() == {
            "runs": [],
            "errors": [],
            "skipped": [
                {"id": hidden, "reason": "no such dead letter"},
                {"id": missing, "reason": "no such dead letter"},
            ],
        }
        for r in (
            c.post("/tidemark/dlq/api/export", json={"ids": [hidden, mine]}),
            c.get("/tidemark/dlq/api/export", params={"ids": f"{hidden},{mine}"}),
        ):
            assert r.status_code == 200
            assert [x["id"] for x in exported(r.text.splitlines())] == [mine]
    assert site.letter(hidden)[0] == "quarantined"


def test_no_server_paths_in_the_api(site):
    with site.client(site.admin) as c:
        r = c.get(f"/tidemark/dlq/api/records/{site.ids['json']}")
    assert r.status_code == 200
    (docs,) = r.json()["data_docs"]
    assert set(docs) == {"scope", "success", "href"}
    assert docs["href"].endswith("/validations/run%201.html")
    assert str(site.docs) not in r.text and str(site.env.tmp) not in r.text


def test_the_ledger_unavailable_is_a_503_without_its_address(site):
    port = str(site.env.cluster.port)
    admin_db = site.env.cluster.dsn("postgres")
    led = site.env.names["ledger"]
    with psycopg.connect(admin_db, autocommit=True) as c:  # refused connections
        c.execute(f'ALTER DATABASE "{led}" ALLOW_CONNECTIONS false')
        try:
            with site.client(site.admin) as web:
                api = web.get("/tidemark/dlq/api/records")
                page = web.get("/tidemark/dlq/")
        finally:
            c.execute(f'ALTER DATABASE "{led}" ALLOW_CONNECTIONS true')
    assert api.status_code == 503
    assert api.json() == {"detail": "the ledger database is unavailable; try again later"}
    assert page.status_code == 503 and port not in page.text and led not in page.text
    assert re.search(r'id="error-message">([^<]*)<', page.text)[1] == (
        "the ledger database is unavailable; try again later"
    )

    # A query that fails (here: a lock it may not wait for) says the same, nothing more.
    with (
        psycopg.connect(site.env.ledger_dsn) as holder,
        psycopg.connect(admin_db, autocommit=True) as admin,
    ):
        holder.execute("LOCK TABLE tidemark.dlq IN ACCESS EXCLUSIVE MODE")
        admin.execute(f"ALTER DATABASE \"{led}\" SET lock_timeout = '200ms'")  # new sessions
        try:
            with site.client(site.admin) as web:
                r = web.get(f"/tidemark/dlq/api/records/{site.ids['json']}")
        finally:
            admin.execute(f'ALTER DATABASE "{led}" RESET lock_timeout')
            holder.rollback()
    assert r.status_code == 503
    assert r.json() == {"detail": "the ledger database is unavailable; try again later"}
    with site.client(site.admin) as web:
        assert web.get(f"/tidemark/dlq/api/records/{site.ids['json']}").status_code == 200


def test_redrive_all_matching_is_one_request_made_from_the_filters(site):
    dag = "tidemark_orders_redrive"
    site.stack.wait_dag(dag)
    ids = site.ids
    with site.client(cookie=site.admin) as c:
        html = c.get(
            "/tidemark/dlq/", params={"pipeline": "orders", "error_class": "sink_write"}
        ).text
        assert 'id="redrive-all"' in html and "Redrive all 2 matching" in html
        # The button leads to a confirm step: the count the server finds, then the form.
        href = re.search(r'id="redrive-all" href="([^"]+)"', html)[1].replace("&amp;", "&")
        page = c.get(href)
    assert page.status_code == 200, page.text
    assert re.search(
        r"Redrive <b>2</b> quarantined dead letters matching pipeline orders, "
        r"class sink_write\?",
        page.text,
    ), page.text
    assert 'name="all_matching"' in page.text and 'name="expected" value="2"' in page.text
    assert 'name="error_class" value="sink_write"' in page.text
    with site.client(site.viewer) as c:
        html = c.get("/tidemark/dlq/", params={"pipeline": "orders"}).text
        assert 'id="redrive-all"' not in html and 'id="discard-all"' not in html
        r = c.get("/tidemark/dlq/confirm", params={"action": "redrive", "pipeline": "orders"})
        assert r.status_code == 403, r.text
        r = c.post("/tidemark/dlq/api/redrive", json={"all_matching": True, "pipeline": "orders"})
        assert r.status_code == 403, r.text
    with site.stack.api(site.admin) as api:
        api.patch(f"/dags/{dag}", json={"is_paused": True}).raise_for_status()
        with site.client(site.admin) as c:
            r = c.post("/tidemark/dlq/api/redrive", json={"all_matching": True})
            assert r.status_code == 400 and "pipeline: choose" in r.json()["detail"]
            r = c.post(
                "/tidemark/dlq/api/redrive",
                json={"all_matching": True, "pipeline": "orders", "error_class": "sink_write"},
            )
            assert r.status_code == 200, r.text
            # More match than were confirmed: no request, nothing triggered.
            fewer = c.post(
                "/tidemark/dlq/api/redrive",
                json={
                    "all_matching": True,
                    "pipeline": "orders",
                    "error_class": "sink_write",
                    "expected": 1,
                },
            )
        assert fewer.status_code == 502, fewer.text
        assert (
            fewer.json()["runs"] == []
            and "not the 1 confirmed" in fewer.json()["errors"][0]["error"]
        )
        (run,) = r.json()["runs"]
        assert (run["letters"], run["ids"]) == (2, [])
        got = api.get(f"/dags/{dag}/dagRuns/{run['dag_run_id']}").json()
        assert got["conf"] == {"request": run["request"], "requested_by": "admin"}
        assert site.request(run["request"]) == (
            "orders",
            "admin",
            [ids["redrive1"], ids["redrive2"]],
        )
        assert site.env.ledger(
            "SELECT selection FROM tidemark.redrive_requests WHERE request_id = %s",
            (run["request"],),
        ) == [({"pipeline": "orders", "error_class": "sink_write"},)]


def test_preview_triggers_a_dry_run_that_changes_nothing_and_its_selection_can_then_be_redriven(
    site,
):
    """Preview is the redrive DAG with dry_run set in its conf, for the same request a redrive
    would make; no letter changes. The page of the run follows it, and the request it made
    can then be redriven as it is (``request``), as can the same selection anew. (The DAG is
    paused here: this is the trigger's and the request's test; tests/test_dlq_browser.py runs
    a preview and the redrive after it through Spark.)"""
    dag = "tidemark_orders_redrive"
    site.stack.wait_dag(dag)
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        a, b = add(c, cls="transform"), add(c, cls="transform")
    letters = "SELECT * FROM tidemark.dlq ORDER BY id"
    before = site.env.ledger(letters)
    with site.stack.api(site.admin) as api:
        api.patch(f"/dags/{dag}", json={"is_paused": True}).raise_for_status()
        with site.client(site.admin) as c:
            r = c.post("/tidemark/dlq/api/redrive", json={"ids": [b, a], "dry_run": True})
            assert r.status_code == 200, r.text
            (run,) = r.json()["runs"]
            assert (run["ids"], run["letters"], run["dry_run"]) == ([a, b], 2, True)
            got = api.get(f"/dags/{dag}/dagRuns/{run['dag_run_id']}").json()
            assert got["conf"] == {
                "request": run["request"],
                "requested_by": "admin",
                "dry_run": True,
            }
            assert site.request(run["request"]) == ("orders", "admin", [a, b])
            assert (
                run["outcome"] == f"/tidemark/dlq/runs/orders/{quote(run['dag_run_id'], safe='')}"
            )

            # The run's page: Airflow's state (queued, the DAG paused) and the request's
            # letters as they are now; it reloads itself until the run ends.
            out = c.get(run["outcome"].replace("/dlq/runs/", "/dlq/api/runs/")).json()
            assert (out["state"], out["final"], out["paused"], out["dry_run"]) == (
                "queued",
                False,
                True,
                True,
            )
            assert out["request"] == {
                "id": run["request"],
                "letters": 2,
                "now": {"quarantined": 2},
            }
            assert out["sinks"] == [] and out["redrive_ready"] is False
            page = c.get(run["outcome"])
            assert page.status_code == 200, page.text
            assert '<meta http-equiv="refresh" content="3">' in page.text
            assert "Preview of a redrive" in page.text and "The DAG is paused" in page.text
            assert 'id="redrive-request"' not in page.text  # only once a preview succeeded

            # The request the preview made is not used up: it redrives as it is...
            r = c.post("/tidemark/dlq/api/redrive", json={"request": run["request"]})
            assert r.status_code == 200, r.text
            (real,) = r.json()["runs"]
            assert (real["request"], real["letters"], real["dry_run"]) == (run["request"], 2, False)
            got = api.get(f"/dags/{dag}/dagRuns/{real['dag_run_id']}").json()
            assert got["conf"] == {"request": run["request"], "requested_by": "admin"}
            # ... and so does the same selection, as a new request.
            r = c.post("/tidemark/dlq/api/redrive", json={"ids": [a, b]})
            (again,) = r.json()["runs"]
            assert again["request"] != run["request"] and again["dry_run"] is False
            assert site.request(again["request"]) == ("orders", "admin", [a, b])

            # Every letter of the pipeline's filters at once, previewed the same way.
            r = c.post(
                "/tidemark/dlq/api/redrive",
                json={
                    "all_matching": True,
                    "pipeline": "orders",
                    "error_class": "transform",
                    "dry_run": "true",
                },
            )
            assert r.status_code == 200, r.text
            (matching,) = r.json()["runs"]
            assert a in site.request(matching["request"])[2]
            got = api.get(f"/dags/{dag}/dagRuns/{matching['dag_run_id']}").json()
            assert got["conf"]["dry_run"] is True

        with site.client(cookie=site.admin) as c:  # the list page's Preview button
            r = c.post(
                "/tidemark/dlq/api/redrive",
                headers={"Origin": site.stack.url},
                data={"ids": [str(a)], "dry_run": "1", "csrf_token": site.csrf(site.admin)},
            )
            assert r.status_code == 200 and "Triggered a preview (dry run)" in r.text, r.text
            assert "nothing is committed and no dead letter changes" in r.text
            run_id = re.search(r"/dags/tidemark_orders_redrive/runs/([^\"]+)\"", r.text)[1]
            got = api.get(f"/dags/{dag}/dagRuns/{run_id}").json()
            assert got["conf"]["dry_run"] is True
            assert site.request(got["conf"]["request"])[2] == [a]
    assert site.env.ledger(letters) == before  # the UI changes no letter; the DAG would


def test_preview_asks_what_a_redrive_asks(site):
    """Who may not redrive may not preview; a request of a pipeline one may not read is not
    found; dry_run is true or false, nothing else."""
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        mine = add(c)
        hidden = redrives.create(c, "other", "alice", ids=[add(c, pipeline="other")])
    assert hidden is not None
    with site.client(site.viewer) as c:
        r = c.post("/tidemark/dlq/api/redrive", json={"ids": [mine], "dry_run": True})
        assert r.status_code == 403, r.text
        assert "viewer may not change dead letters of orders" in r.json()["detail"]
        r = c.post("/tidemark/dlq/api/redrive", json={"request": hidden.request_id})
        assert r.status_code == 403, r.text
        html = c.get("/tidemark/dlq/", params={"pipeline": "orders"}).text
        assert 'id="preview"' not in html
    with site.client(site.scoped) as c:
        seen = c.post("/tidemark/dlq/api/redrive", json={"request": hidden.request_id})
        absent = c.post("/tidemark/dlq/api/redrive", json={"request": 99_999_999})
        assert seen.status_code == absent.status_code == 404, seen.text
        assert seen.json()["detail"] == f"no redrive request {hidden.request_id}"
        assert c.get("/tidemark/dlq/runs/other/manual__x").status_code == 404
        assert c.get("/tidemark/dlq/api/runs/orders/manual__none").status_code == 404
    with site.client(site.admin) as c:
        for body, needle in (
            ({"ids": [mine], "dry_run": "yes"}, "dry_run 'yes': expected true or false"),
            ({"ids": [mine], "dry_run": 1}, "dry_run 1: expected true or false"),
            ({"request": hidden.request_id, "ids": [mine]}, "request: runs a redrive request"),
            ({"request": "x7"}, "request 'x7': not a positive integer"),
        ):
            r = c.post("/tidemark/dlq/api/redrive", json=body)
            assert r.status_code == 400 and needle in r.json()["detail"], (body, r.text)
        # A discard has no preview: asking for one is refused, never a discard.
        r = c.post(
            "/tidemark/dlq/api/discard", json={"ids": [mine], "note": "try", "dry_run": True}
        )
        assert r.status_code == 400 and "a discard has no preview" in r.json()["detail"], r.text
        html = c.get("/tidemark/dlq/", params={"pipeline": "orders"}).text
        assert 'id="preview"' in html and 'name="dry_run" value="1"' in html
        page = c.get("/tidemark/dlq/confirm", params={"action": "redrive", "pipeline": "orders"})
        assert 'id="confirm-preview"' in page.text and 'id="confirm-redrive"' in page.text
        assert 'id="preview"' in c.get(f"/tidemark/dlq/record/{mine}").text
        # A request the page did not make here stays when its trigger fails (pipeline other
        # has no DAG): it is still there to redrive once the DAG is deployed.
        r = c.post("/tidemark/dlq/api/redrive", json={"request": hidden.request_id})
        assert r.status_code == 502, r.text
        assert "DAG tidemark_other_redrive not found" in r.json()["errors"][0]["error"]
    assert site.request(hidden.request_id)[0] == "other"
    assert site.letter(mine)[0] == "quarantined"


def test_redrive_never_calls_the_host_the_client_names(site):
    """A forged Host header must not choose where the server sends the caller's token: the
    trap (a listener on a free port) gets no connection, the real Airflow gets the trigger."""
    dag = "tidemark_orders_redrive"
    site.stack.wait_dag(dag)
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    try:
        with site.stack.api(site.admin) as api:
            api.patch(f"/dags/{dag}", json={"is_paused": True}).raise_for_status()
            with site.client(site.admin) as c:
                r = c.post(
                    "/tidemark/dlq/api/redrive",
                    json={"ids": [site.ids["redrive2"]]},
                    headers={"Host": f"127.0.0.1:{trap.getsockname()[1]}"},
                )
            assert r.status_code == 200, r.text
            (run,) = r.json()["runs"]
            got = api.get(f"/dags/{dag}/dagRuns/{run['dag_run_id']}").json()
            assert got["conf"]["request"] == run["request"]
        # The trigger was synchronous: had the server connected to the trap, the connection
        # would be waiting in its backlog now.
        with pytest.raises(BlockingIOError):
            trap.accept()
    finally:
        trap.close()


def test_search_on_the_reason_and_discard_all_matching_after_a_confirm_step(site):
    env = site.env
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        bad = [
            add(
                c,
                pipeline="other",
                cls="validation",
                reason=f"expect_column_values_to_be_between(column=amount): unexpected "
                f"value -{i}.5",
            )
            for i in range(3)
        ]
        keep = add(c, pipeline="other", cls="validation", reason="origin 'BOS' not in set")
    with site.client(site.admin) as c:
        r = c.get(
            "/tidemark/dlq/api/records", params={"pipeline": "other", "reason": "COLUMN=AMOUNT"}
        )
        assert sorted(x["id"] for x in r.json()["records"]) == bad
        r = c.get("/tidemark/dlq/api/records", params={"reason": "x" * 201})
        assert r.status_code == 400 and "at most 200" in r.json()["detail"]
        for evil in INJECTIONS:
            r = c.get("/tidemark/dlq/api/records", params={"reason": evil})
            assert r.status_code == 200 and r.json()["records"] == []
    with site.client(cookie=site.admin) as c:
        html = c.get("/tidemark/dlq/", params={"pipeline": "other", "reason": "amount"}).text
        assert 'name="reason" value="amount"' in html
        assert "Discard all 3 matching" in html
        href = re.search(r'id="discard-all" href="([^"]+)"', html)[1].replace("&amp;", "&")
        page = c.get(href)
        assert page.status_code == 200, page.text
        assert (
            "Discard <b>3</b> quarantined dead letters matching pipeline other, reason "
            "contains &#39;amount&#39;?" in page.text
        )
        form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page.text))
        assert form["expected"] == "3" and form["reason"] == "amount"
        assert form["all_matching"] == "1" and form["csrf_token"]
        # no CSRF token: refused, as every cookie POST
        r = c.post(
            "/tidemark/dlq/api/discard", data={**form, "csrf_token": "", "note": "bad amounts"}
        )
        assert r.status_code == 403
        r = c.post(
            "/tidemark/dlq/api/discard",
            data={**form, "note": "bad amounts"},
            headers={"Origin": site.stack.url},
        )
    assert r.status_code == 200, r.text
    assert "Discarded 3 dead letter(s) matching pipeline other, reason contains" in r.text
    assert [site.letter(i) for i in bad] == [("discarded", "admin", "bad amounts")] * 3
    assert site.letter(keep)[0] == "quarantined"
    with site.client(site.scoped) as c:  # sees and edits orders only: other is not theirs
        r = c.post(
            "/tidemark/dlq/api/discard",
            json={"all_matching": True, "pipeline": "other", "note": "x"},
        )
        assert r.status_code == 403, r.text
    with site.client(site.admin) as c:
        r = c.post("/tidemark/dlq/api/discard", json={"all_matching": True, "note": "x"})
        assert r.status_code == 400 and "pipeline: choose" in r.json()["detail"]
        r = c.post(
            "/tidemark/dlq/api/discard",
            json={
                "all_matching": True,
                "pipeline": "other",
                "reason": "BOS",
                "note": "x",
                "expected": 0,
            },
        )
        assert (
            r.status_code == 400 and "1 dead letter(s) match now, not the 0" in r.json()["detail"]
        )
    assert site.letter(keep)[0] == "quarantined"


# -- issue 34: bounded renderings, ids within bigint, checked bodies, relative redirects --------
def test_a_letter_that_grows_when_rendered_gets_bounded_pages(site):
    # 121 KB that, indented, made a 48.5 MB page (and about 240 MB of the API server's memory)
    wide = b"[" * 400 + b",".join([b"1"] * 60_000) + b"]" * 400
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c, payload=wide, key=b"[" * 1000 + b"]" * 1000)
    with site.client(site.admin) as c:
        for fmt in ("auto", "json", "text", "hex"):
            page = c.get(f"/tidemark/dlq/record/{rid}", params={"format": fmt})
            assert page.status_code == 200, (fmt, page.text[:300])
            assert len(page.content) < 800_000, (fmt, len(page.content))
            assert 'href="?format=json"' in page.text  # the JSON tab, still offered
            api = c.get(f"/tidemark/dlq/api/records/{rid}", params={"format": fmt})
            assert api.status_code == 200, (fmt, api.text[:300])
            assert len(api.content) < 1_000_000, (fmt, len(api.content))
            rendered = api.json()["payload_rendered"]
            if fmt in ("auto", "json"):
                assert rendered["kind"] == "text"
                assert rendered["text"].endswith(
                    "not pretty-printed: indented, this JSON would "
                    "pass 524,288 characters; this is its plain "
                    "text"
                )
                assert "not pretty-printed" in page.text
                assert 'id="download-payload"' in page.text
            if fmt == "hex":
                assert "more bytes not shown; download or export the record" in page.text
                assert "more bytes not shown" in rendered["text"]


def test_ids_past_bigint_are_a_400_naming_the_field(site):
    huge = "99999999999999999999"
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c)
    with site.client(site.admin) as c:
        for r in (
            c.get("/tidemark/dlq/api/export", params={"ids": huge}),
            c.get("/tidemark/dlq/api/records", params={"ids": f"{rid},{huge}"}),
            *(
                c.post(f"/tidemark/dlq/api/{action}", json={"ids": [rid, int(huge)], "note": "x"})
                for action in ("discard", "redrive", "export")
            ),
            c.post("/tidemark/dlq/api/discard", json={"ids": huge, "note": "x"}),
        ):
            assert r.status_code == 400, (r.request.url, r.text)
            assert re.fullmatch(
                rf"ids: '?{huge}'? is not a dead-letter id \(a positive "
                r"integer up to 9,223,372,036,854,775,807\)",
                r.json()["detail"],
            ), r.text
        r = c.get("/tidemark/dlq/api/records", params={"before": huge})
        assert (
            r.status_code == 400
            and r.json()["detail"] == f"before '{huge}': at most 9,223,372,036,854,775,807"
        )
        r = c.get(f"/tidemark/dlq/api/records/{huge}")
        assert (
            r.status_code == 400
            and r.json()["detail"] == f"id '{huge}': at most 9,223,372,036,854,775,807"
        )
    assert site.letter(rid)[0] == "quarantined"


def test_bodies_of_the_wrong_shape_are_a_400_naming_the_field(site):
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c)
    cases = [
        ("discard", {"ids": [rid], "note": 123}, "note 123: expected text"),
        ("discard", {"ids": [rid], "note": ["x"]}, "note ['x']: expected text"),
        ("discard", {"ids": {"a": rid}, "note": "x"}, "ids"),
        ("discard", {"ids": [rid], "note": "x", "back": 5}, "back 5: expected text"),
        (
            "discard",
            {"all_matching": True, "pipeline": ["orders"], "note": "x"},
            "pipeline ['orders']: expected text",
        ),
        ("discard", {"all_matching": True, "pipeline": "orders", "note": {"a": 1}}, "note"),
        ("redrive", {"ids": [[rid]]}, "ids"),
        (
            "redrive",
            {"ids": [rid], "all_matching": [1]},
            "all_matching [1]: expected true or false",
        ),
        (
            "redrive",
            {"all_matching": True, "pipeline": "orders", "expected": 1.5},
            "expected 1.5: expected a count",
        ),
        ("redrive", {"all_matching": True, "pipeline": "orders", "sink": 7}, "sink 7"),
        ("export", {"ids": [True]}, "ids"),
    ]
    with site.client(site.admin) as c:
        for action, body, detail in cases:
            r = c.post(f"/tidemark/dlq/api/{action}", json=body)
            assert r.status_code == 400, (action, body, r.status_code, r.text)
            assert r.json()["detail"].startswith(detail), (action, body, r.text)
    assert site.letter(rid)[0] == "quarantined"


def test_the_trailing_slash_redirect_is_relative(site):
    for creds in ({}, {"headers": {"Authorization": f"Bearer {site.admin}"}}):
        with httpx.Client(base_url=site.stack.url, timeout=60, **creds) as c:
            for path, to in (
                ("/tidemark/dlq", "/tidemark/dlq/"),
                (
                    "/tidemark/dlq?status=any&pipeline=orders",
                    "/tidemark/dlq/?status=any&pipeline=orders",
                ),
                ("/tidemark/dlq/api/records/", "/tidemark/dlq/api/records"),
            ):
                r = c.get(path, headers={"Host": "evil.example"})
                assert r.status_code == 307, (path, r.status_code, r.text)
                assert r.headers["location"] == to, (path, creds)
                assert r.headers["x-content-type-options"] == "nosniff"


def test_nul_characters_and_ambiguous_dry_runs_are_bad_input(site):
    """A NUL character no text column can hold is the caller's to mend (400), not a ledger
    outage (503); a form that says dry_run twice, differently, or bare, redrives nothing."""
    with psycopg.connect(site.env.ledger_dsn, autocommit=True) as c:
        rid = add(c, cls="transform")
    letters = "SELECT * FROM tidemark.dlq ORDER BY id"
    requests = "SELECT count(*) FROM tidemark.redrive_requests"
    before, asked = site.env.ledger(letters), site.env.ledger(requests)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with site.client(site.admin) as c:
        r = c.post("/tidemark/dlq/api/discard", json={"ids": [rid], "note": "a\u0000b"})
        assert r.status_code == 400 and "NUL" in r.text, r.text
        r = c.get("/tidemark/dlq/api/runs/orders/%00")
        assert r.status_code in (400, 404), r.text
        for body in (f"ids={rid}&dry_run=1&dry_run=0", f"ids={rid}&dry_run"):
            r = c.post("/tidemark/dlq/api/redrive", content=body, headers=form)
            assert r.status_code == 400 and "dry_run" in r.text, (body, r.text)
    assert site.env.ledger(letters) == before and site.env.ledger(requests) == asked
