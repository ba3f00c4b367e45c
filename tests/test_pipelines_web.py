"""The Pipelines pages (tidemark/web/pipelines_pages.py) in a real Airflow 3.3, the session's
(tests/airflow_site.py), over the history of real runs: a pipeline with two sinks replayed
by Spark in several runs while records keep arriving (some undecodable, some failing a
check), its lag measured between them as the maintenance DAG does (check_health). Who may see
which pipeline over HTTP (read access to its DAG, as for dead letters), then both pages in
headless Chromium: charts drawn from that data, nothing fetched from elsewhere, screenshots
in test-artifacts/pipelines/ (PIPELINES_SHOTS overrides it) for a person to look at."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.airflow_site import SCOPED_USER  # sees the pipeline orders only
from tests.conftest import REPO, Env

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(1200)]

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(os.environ.get("PIPELINES_SHOTS", REPO / "test-artifacts" / "pipelines"))
PIPELINES = (REPO / "dags" / "tidemark_pipelines.py").read_text()


def _measure(env: Env, names: list[str]) -> None:
    """What the maintenance DAG does every 5 minutes: measure lag (and keep it)."""
    from tidemark import config
    from tidemark.airflow.health import check_health

    pipelines = {n: config.load(env.dir / f"{n}.yaml") for n in names}
    health = check_health(pipelines, env.ledger_dsn)
    assert set(health.lags) == set(names), health.problems


@pytest.fixture(scope="module")
def site(airflow_site, pg, spark, tmp_path_factory):
    from tidemark.ledger import history

    tmp = tmp_path_factory.mktemp("pipelines")
    env = Env(pg, tmp)
    sinks = [
        env.orders_sink(),
        {"name": "archive", "dsn": env.sink2_dsn, "table": "public.orders_archive", "key": ["id"]},
    ]
    check = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 300}}
    env.pipeline(
        "orders",
        sinks=sinks,
        quality={"rows": [check]},
        limits={"max_records_per_partition": 60},
        airflow={"retries": 0},
    )
    env.pipeline("other", sinks=[env.orders_sink(table="public.other")])
    old, history.SAMPLE_EVERY_SECONDS = history.SAMPLE_EVERY_SECONDS, 0  # seconds apart here
    try:
        _measure(env, ["orders"])  # nothing yet
        n = 0
        for batch in (200, 120, 40):
            env.append_orders(range(n, n + batch))  # amount = id * 1.25: 241 and up fail
            env.append([(n % 2, b"bad", b"{not json", None, None)])  # a decode letter
            n += batch
            _measure(env, ["orders"])
            for _ in range(2):
                report = env.run(spark, "orders")
                assert report.ok, report.summary()
                _measure(env, ["orders"])
        assert env.run(spark, "other").ok
        _measure(env, ["orders", "other"])
    finally:
        history.SAMPLE_EVERY_SECONDS = old
    dags = airflow_site.enter("test_pipelines_web", env.ledger_dsn, tmp / "docs")
    try:
        shutil.move(env.dir, dags / "pipelines")
        env.dir = dags / "pipelines"
        (dags / "tidemark_pipelines.py").write_text(PIPELINES)
        airflow_site.wait_dags(dags, ["tidemark_orders", "tidemark_other"])
        yield env, airflow_site.stack
    finally:
        airflow_site.leave(dags)
        env.drop()


def _client(stack, user: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {stack.token(user)}"} if user else {}
    return httpx.Client(base_url=stack.url, timeout=60, headers=headers)


def _charts(html: str) -> list[dict]:
    import html as h

    return [json.loads(h.unescape(m)) for m in re.findall(r'data-chart="([^"]*)"', html)]


def test_the_ledger_holds_a_real_history(site):
    env, _ = site
    runs = env.ledger(
        "SELECT count(*) FROM tidemark.runs r WHERE pipeline = 'orders' AND EXISTS "
        "(SELECT 1 FROM tidemark.run_sinks rs WHERE rs.run_id = r.run_id "
        "AND rs.state = 'committed')"
    )[0][0]
    assert runs >= 5
    lags = env.ledger(
        "SELECT count(DISTINCT at), max(head - checkpoint) FROM tidemark.lag_samples "
        "WHERE pipeline = 'orders'"
    )[0]
    assert lags[0] >= 7 and lags[1] >= 100  # 200 records came in before the first run
    classes = {c for (c,) in env.ledger("SELECT DISTINCT error_class::text FROM tidemark.dlq")}
    assert {"decode", "validation"} <= classes


def test_who_sees_which_pipeline(site):
    env, stack = site
    with _client(stack, "admin") as c:
        plugins = c.get("/api/v2/plugins").json()["plugins"]
        views = next(p for p in plugins if p["name"] == "tidemark_dlq")["external_views"]
        assert [(v["name"], v["href"]) for v in views] == [
            ("Dead letters", "/tidemark/dlq/"),
            ("Pipelines", "/tidemark/pipelines/"),
        ]
        page = c.get("/tidemark/pipelines/")
        assert page.status_code == 200, page.text
        assert re.findall(r'data-pipeline="(\w+)"', page.text) == ["orders", "other"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        detail = c.get("/tidemark/pipelines/orders")
        assert detail.status_code == 200
        api = c.get("/tidemark/pipelines/api/orders").json()
        assert [s["name"] for s in api["sinks"]] == ["archive", "main"]
        assert c.get("/tidemark/pipelines/static/uPlot.iife.min.js").status_code == 200
        assert c.get("/tidemark/pipelines/static/..%2Fpipelines_pages.py").status_code == 404
        assert c.get("/tidemark/pipelines/nope").status_code == 404
        assert c.get("/tidemark/pipelines/orders?days=3").status_code == 400
    with _client(stack, "viewer") as c:  # read access to every DAG
        page = c.get("/tidemark/pipelines/")
        assert re.findall(r'data-pipeline="(\w+)"', page.text) == ["orders", "other"]
    with _client(stack, SCOPED_USER) as c:  # the DAGs of orders only
        page = c.get("/tidemark/pipelines/")
        assert re.findall(r'data-pipeline="(\w+)"', page.text) == ["orders"]
        assert "other" not in page.text
        assert c.get("/tidemark/pipelines/orders").status_code == 200
        # No access to other: not found, like a pipeline that does not exist.
        for path in ("/tidemark/pipelines/other", "/tidemark/pipelines/api/other"):
            r = c.get(path)
            assert r.status_code == 404, (path, r.status_code)
            assert "no pipeline" in r.text and "other-" not in r.text
    with _client(stack, None) as c:  # not signed in: Airflow's login, nothing of the data
        r = c.get("/tidemark/pipelines/", follow_redirects=False)
        assert r.status_code == 303 and "login" in r.headers["location"]
        r = c.get("/tidemark/pipelines/api/orders", follow_redirects=False)
        assert r.status_code in (303, 401) and "orders" not in r.text


def test_charts_carry_the_runs_data(site):
    env, stack = site
    with _client(stack, "admin") as c:
        detail = c.get("/tidemark/pipelines/orders?days=1").text
    charts = {ch["title"]: ch for ch in _charts(detail)}
    lag = charts["records behind, per partition: main"]
    assert [s["label"] for s in lag["series"]] == ["partition 0", "partition 1"]
    assert max(v for s in lag["series"] for v in s["values"] if v is not None) >= 100
    rate = charts["records per second, per run: main"]
    runs = env.ledger(
        "SELECT count(*) FROM tidemark.runs r JOIN tidemark.run_sinks rs USING (run_id) "
        "WHERE r.pipeline = 'orders' AND rs.sink = 'main' AND r.finished_at IS NOT NULL"
    )[0][0]
    assert sum(v is not None for v in rate["series"][0]["values"]) >= min(runs, 1)
    letters = charts["dead letters created, per error class"]
    total = env.ledger("SELECT count(*) FROM tidemark.dlq WHERE pipeline = 'orders'")[0][0]
    assert sum(v or 0 for s in letters["series"] for v in s["values"]) == total
    # Where each sink began, and where it is now, per partition.
    with psycopg.connect(env.ledger_dsn) as c:
        rows = c.execute(
            "SELECT partition, start_offset, next_offset FROM tidemark.checkpoints "
            "WHERE pipeline = 'orders' AND sink = 'main' ORDER BY 1"
        ).fetchall()
    for part, start, nxt in rows:
        row = re.search(
            rf'<section class="sink" data-sink="main">.*?<tr data-partition="{part}">(.*?)</tr>',
            detail,
            re.S,
        )[1]
        cells = [re.sub(r"<[^>]+>", "", x).strip() for x in re.findall(r"<td[^>]*>.*?</td>", row)]
        assert cells[1:3] == [f"{start:,}", f"{nxt:,}"], cells


def test_both_pages_in_chromium(site):
    from urllib.parse import urlsplit

    from playwright.sync_api import expect, sync_playwright

    env, stack = site
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        asked: list[str] = []
        problems: list[str] = []
        page.on("request", lambda r: asked.append(r.url))
        page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(stack.url + "/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", stack.password())
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("link", name="Pipelines").first.click()
        frame = page.frame_locator("iframe").first
        expect(frame.locator("#multiples")).to_be_visible(timeout=60_000)
        expect(frame.locator("[data-drawn]").first).to_be_visible()
        page.wait_for_load_state("networkidle")
        page.screenshot(path=SHOTS / "01-airflow-nav.png")

        problems.clear()  # Airflow's own console is not this test's
        for days in (1, 7):
            page.goto(stack.url + f"/tidemark/pipelines/?days={days}")
            charts = page.locator("[data-chart]")
            expect(charts).to_have_count(6)
            orders = page.locator(".mname[data-pipeline=orders] ~ .chart").first
            expect(orders.locator("canvas")).to_have_count(1)
        page.screenshot(path=SHOTS / "02-overview.png", full_page=True)
        drawn = page.locator("[data-drawn]")
        assert drawn.count() >= 5  # other's letters chart may be empty: it has none

        page.get_by_role("link", name="orders").first.click()
        expect(page.locator("#last-run")).to_contain_text("run")
        expect(page.locator("section.sink[data-sink=main] table tr[data-partition]")).to_have_count(
            2
        )
        lag = page.locator("section.sink[data-sink=main] .chart.wide").first
        expect(lag.locator("canvas")).to_have_count(1)
        page.screenshot(path=SHOTS / "03-detail-7d.png", full_page=True)
        page.get_by_role("link", name="24 hours").click()
        expect(page.locator("[data-drawn]").first).to_be_visible()
        page.screenshot(path=SHOTS / "04-detail-24h.png", full_page=True)
        # Every chart of the page drawn, none left empty: the runs made all of them.
        assert page.locator(".chart .empty").count() == 0
        # The chart is readable: its axis labels are inside the chart, not cut.
        box = lag.bounding_box()
        assert box and box["width"] > 600 and box["height"] >= 200
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        browser.close()
    here = urlsplit(stack.url).netloc
    assert [u for u in asked if urlsplit(u).netloc not in (here, "")] == []
    assert not [p for p in problems if "Content Security Policy" in p or "uPlot" in p], problems
