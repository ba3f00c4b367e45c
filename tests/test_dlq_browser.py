"""The Dead letters page in a real browser: headless Debian Chromium driven by Playwright,
against a real Airflow 3.3 (the session's, tests/airflow_site.py), with dead letters a real
Spark run quarantined.

Log in, open Dead letters from Airflow's navigation, filter, open a record (its `<script>`
payload shown, never run), preview a redrive of one that now passes and one that still fails
(the redrive DAG as a dry run: its page says what each sink would get, and nothing changed),
then redrive what was previewed from that page (through the redrive DAG, Spark and the
two-phase commit), discard one with a note from a page older than the session cookie; all
checked in the ledger. Screenshots go to test-artifacts/browser/."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import REPO, Env

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]

CHROMIUM = "/usr/bin/chromium"
SHOTS = REPO / "test-artifacts" / "browser"
PIPELINES = (REPO / "dags" / "tidemark_pipelines.py").read_text()
XSS = b"<script>window.pwned=1</script>"
NAME = "shop"
GATED = "shopgate"


def _rows_check(max_value: int) -> dict:
    return {"expect_column_values_to_be_between": {"column": "amount", "max_value": max_value}}


@pytest.fixture(scope="module")
def site(airflow_site, pg, spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    env = Env(pg, tmp)
    env.append_orders(range(90))  # amount = id * 1.25: ids 81..89 fail the check
    env.append([(0, b"xss", XSS, None, None)])
    # Its own pipeline name, not another module's: the modules share the session's Airflow.
    env.pipeline(
        NAME, quality={"rows": [_rows_check(100)]}, airflow={"retries": 0, "driver_memory": "1g"}
    )
    report = env.run(spark, NAME, settings=env.settings(data_docs_dir=tmp / "docs"))
    assert report.ok, report.summary()
    # A second pipeline whose batch gate fails (max amount 111.25): its letters link the
    # failed gate's Data Docs page.
    env.pipeline(
        GATED,
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.gated", "key": ["id"]}],
        quality={
            "batch": [{"expect_column_max_to_be_between": {"column": "amount", "max_value": 100}}],
            "on_gate_failure": "quarantine_batch",
        },
        airflow={"retries": 0, "driver_memory": "1g"},
    )
    report = env.run(spark, GATED, settings=env.settings(data_docs_dir=tmp / "docs"))
    assert report.ok, report.summary()
    # The fix a user makes before redriving: amounts up to 105 are fine (ids 81..84).
    env.pipeline(
        NAME, quality={"rows": [_rows_check(105)]}, airflow={"retries": 0, "driver_memory": "1g"}
    )
    dags = airflow_site.enter("test_dlq_browser", env.ledger_dsn, tmp / "docs")
    try:
        shutil.move(env.dir, dags / "pipelines")
        env.dir = dags / "pipelines"
        (dags / "tidemark_pipelines.py").write_text(PIPELINES)
        airflow_site.wait_dags(dags, [f"tidemark_{NAME}_redrive", f"tidemark_{GATED}"])
        yield env, airflow_site.stack
    finally:
        airflow_site.leave(dags)
        env.drop()


def _letter(env, **where) -> tuple:
    cond = " AND ".join(f"{k} = %s" for k in where)
    return env.ledger(
        f"SELECT id, status::text, resolved_by, note, attempts FROM tidemark.dlq WHERE {cond}",
        tuple(where.values()),
    )[0]


def _sign_in(page, stack) -> None:
    """Airflow's own sign-in form, as admin."""
    page.goto(stack.url + "/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password())
    page.get_by_role("button", name="Sign in").click()


def _world(env) -> tuple:
    """What a preview must leave as it was: the sink's rows and every dead letter."""
    return (
        env.q(env.sink_dsn, "SELECT * FROM public.orders ORDER BY id"),
        env.ledger("SELECT * FROM tidemark.dlq ORDER BY id"),
    )


def _ended(page, state: str = "success") -> None:
    """The run's page reloads itself until Airflow says the run has ended."""
    from playwright.sync_api import expect

    expect(page.locator("#state")).to_have_text(state, timeout=420_000)


def test_review_preview_redrive_and_discard_in_the_browser(site):
    from playwright.sync_api import expect, sync_playwright

    env, stack = site
    SHOTS.mkdir(parents=True, exist_ok=True)
    passing = _letter(env, pipeline=NAME, source_offset=41, source_partition=1)  # id 83
    failing = _letter(env, pipeline=NAME, source_offset=44, source_partition=0)  # id 88: 110
    xss = _letter(env, pipeline=NAME, error_class="decode")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        _sign_in(page, stack)
        page.get_by_role("link", name="Dead letters").first.click()
        frame = page.frame_locator("iframe").first
        expect(frame.get_by_text("Dead letters").first).to_be_visible(timeout=60_000)
        page.screenshot(path=SHOTS / "01-dead-letters.png", full_page=True)

        # The page itself (outside Airflow's frame) from here on: same session cookie.
        page.goto(stack.url + "/tidemark/dlq/")
        page.select_option("select[name=error_class]", "validation")
        page.get_by_role("button", name="Filter").click()
        rows = page.locator("tbody tr")
        expect(rows).to_have_count(9)
        page.screenshot(path=SHOTS / "02-filtered.png", full_page=True)

        # The <script> payload is shown as text and never runs.
        page.goto(stack.url + f"/tidemark/dlq/record/{xss[0]}")
        expect(page.get_by_text("<script>window.pwned=1</script>").first).to_be_visible()
        assert page.evaluate("typeof window.pwned") == "undefined"
        page.screenshot(path=SHOTS / "03-record.png", full_page=True)

        # Preview a redrive of one record that now passes and one that still fails: the
        # redrive DAG as a dry run, up to PREPARE, rolled back.
        before = _world(env)
        page.goto(stack.url + "/tidemark/dlq/?error_class=validation")
        page.check(f"input[name=ids][value='{passing[0]}']")
        page.check(f"input[name=ids][value='{failing[0]}']")
        expect(page.locator("#selected-count")).to_have_text("2 selected")
        page.screenshot(path=SHOTS / "04-preview-button.png", full_page=True)
        page.get_by_role("button", name="Preview").click()
        expect(page.get_by_text("Triggered a preview (dry run)")).to_be_visible()
        expect(page.get_by_text("paused")).to_have_count(0)  # it runs when triggered
        page.screenshot(path=SHOTS / "05-preview-requested.png", full_page=True)
        page.get_by_role("link", name="See what it would do").click()
        _ended(page)
        sink = page.locator("tr[data-sink=main] td")
        expect(sink).to_have_text(["main", "would commit", "2", "1", "1", "0"])
        expect(page.locator("#nothing-committed")).to_contain_text("nothing was committed")
        expect(page.locator("#request")).to_contain_text("2 quarantined")
        page.screenshot(path=SHOTS / "06-preview-outcome.png", full_page=True)
        assert _world(env) == before
        assert env.prepared() == []

        # Then redrive what was previewed, from the preview's page: the same request.
        page.get_by_role("button", name="Redrive these 2").click()
        expect(page.get_by_text(f"tidemark_{NAME}_redrive").first).to_be_visible()
        page.get_by_role("link", name="Follow the redrive").click()
        _ended(page)
        expect(sink).to_have_text(["main", "committed", "2", "1", "1", "0"])
        expect(page.locator("#request")).to_contain_text("1 quarantined, 1 redriven")
        page.screenshot(path=SHOTS / "07-redriven.png", full_page=True)

        # Discard the unreadable one with a note, from a page loaded before Airflow refreshed
        # its _token cookie (a new JWT for the same user): the form's CSRF token still holds.
        page.goto(stack.url + "/tidemark/dlq/?error_class=decode")
        old = next(c for c in page.context.cookies() if c["name"] == "_token")
        page.context.add_cookies([{**old, "value": stack.token("admin")}])
        assert (
            next(c for c in page.context.cookies() if c["name"] == "_token")["value"]
            != old["value"]
        )
        page.check(f"input[name=ids][value='{xss[0]}']")
        page.fill("[name=note]", "not a real order: test payload")
        page.get_by_role("button", name="Discard").click()
        expect(page.get_by_text("discarded").first).to_be_visible()
        page.screenshot(path=SHOTS / "08-discarded.png", full_page=True)
        browser.close()

    assert _letter(env, id=xss[0])[1:4] == ("discarded", "admin", "not a real order: test payload")
    assert _letter(env, id=passing[0])[1:3] == ("redriven", "admin")
    assert _letter(env, id=failing[0])[1::3] == ("quarantined", 2)  # failed again, once
    assert env.q(env.sink_dsn, "SELECT count(*) FROM public.orders WHERE id = 83") == [(1,)]
    others = env.ledger(
        "SELECT count(*) FROM tidemark.dlq WHERE error_class = 'validation' "
        "AND status = 'quarantined'"
    )
    assert others == [(8,)]
    assert env.prepared() == []


def test_data_docs_render_in_their_sandbox_and_send_nothing_anywhere(site):
    """A real run's Data Docs page, from a gate letter's record page: it reads (the
    failing check and its unexpected values are there), none of its scripts runs, and it
    asks nothing of any host but this one (its styles are the site's own copies) and the
    stylesheet CDNs DOCS_CSP names."""
    from urllib.parse import urlsplit

    from playwright.sync_api import expect, sync_playwright

    from tidemark.web.pages import DOCS_FONTS, DOCS_STYLES

    env, stack = site
    SHOTS.mkdir(parents=True, exist_ok=True)
    letter = _letter(env, pipeline=GATED, source_offset=44, source_partition=1)  # 111.25
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        _sign_in(page, stack)
        expect(page.get_by_role("link", name="Dead letters").first).to_be_visible(timeout=60_000)
        page.goto(stack.url + f"/tidemark/dlq/record/{letter[0]}")
        docs = page.locator("a[href*='/tidemark/dlq/docs/']").first
        href = docs.get_attribute("href")
        asked: list[str] = []
        console: list[str] = []
        blocked: list[str] = []  # asked for, refused by the policy before it left
        page.on("request", lambda r: asked.append(r.url))
        page.on("console", lambda m: console.append(m.text))
        page.on("requestfailed", lambda r: r.failure == "csp" and blocked.append(r.url))
        page.goto(stack.url + href)
        expect(page.get_by_text("Status: Failed").first).to_be_visible()
        expect(
            page.get_by_text("maximum value must be less than or equal to 100").first
        ).to_be_visible()
        expect(page.get_by_text("111.25").first).to_be_visible()  # what the gate saw
        page.screenshot(path=SHOTS / "09-data-docs.png", full_page=True)
        browser.close()
    here = urlsplit(stack.url).netloc
    sent = [u for u in asked if u not in blocked]
    elsewhere = [
        u for u in sent if urlsplit(u).netloc != here and not u.startswith(DOCS_STYLES + DOCS_FONTS)
    ]
    assert elsewhere == [], elsewhere
    assert not [u for u in sent if urlsplit(u).path.endswith(".js")], sent
    # Styled offline (tidemark/quality/docs.py): its stylesheets come from the site itself,
    # and GX's logo too, never from GX's S3 bucket with the project's id (a beacon).
    assert any("/static/vendor/" in u and u.endswith(".css") for u in sent), sent
    assert not any("great-expectations-web-assets" in u for u in asked), asked
    assert any("sandboxed" in m and "allow-scripts" in m for m in console), console
