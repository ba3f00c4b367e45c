"""A discard stands (issue 45, case 6; docs/design.md, "DLQ envelope"): a letter an operator
discarded stays discarded while its record fails again, through a backfill, a rebuild and a
redrive of other letters; no DLQ alert counts it. A record that now passes gets its row and
its letter is resolved. Retention may drop a discarded letter's payload, never the row that
places its record (invariant 1). The letter page shows an earlier resolution as history.
Real PostgreSQL and Spark."""

from __future__ import annotations

import json

import psycopg
from starlette.requests import Request

from tests.invariants import assert_exactly_once
from tests.test_cli import tm
from tidemark.core.ranges import Range
from tidemark.driver.modes import Rebuild
from tidemark.driver.run import Backfill
from tidemark.ledger import dlq
from tidemark.protocol.prune import Policy, prune

ROWS = "expect_column_values_to_be_between"
NOTE = "garbage from the load test"


def _world(env, spark) -> int:
    """Orders 0 .. 29 on one partition (amount = id * 1.25); amounts over 25 fail a row
    check, so 21 .. 29 are quarantined. The letter of offset 29 is discarded: its id."""
    env.append_orders(range(30), partitions=1)
    _check(env, 25)
    assert env.run(spark).ok
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        (last,) = c.execute("SELECT id FROM tidemark.dlq WHERE source_offset = 29").fetchone()
        assert dlq.discard(c, [last], NOTE, "dora").changed == [last]
        assert dlq.quarantined(c, "orders") == 8
    return last


def _check(env, max_amount: float) -> None:
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": max_amount}}]})


def _letter(env, lid: int) -> tuple:
    return env.ledger(
        "SELECT status::text, resolved_by, note, attempts FROM tidemark.dlq WHERE id = %s", (lid,)
    )[0]


def _live(env) -> tuple[int, dict]:
    """What the DLQ alerts read: the pipeline's quarantined letters (alerts.dlq_max) and
    the live letters per class (the maintenance check's gauges)."""
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        return dlq.quarantined(c, "orders"), dlq.counts_by_pipeline(c).get("orders", {})


def _ids(env) -> list[int]:
    return [i for (i,) in env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id")]


def test_a_discard_stands_through_a_backfill_while_its_record_fails(env, spark):
    last = _world(env, spark)
    report = env.run(spark, mode=Backfill([Range(0, 0, 30)]), by="erin")
    assert report.ok, report.summary()
    status, by, note, attempts = _letter(env, last)
    assert (status, by, note) == ("discarded", "dora", NOTE)
    assert attempts == 2  # seen failing again: its history grows, its decision stands
    quarantined, by_class = _live(env)
    assert quarantined == 8 and by_class["validation"] == 8  # not re-alerted
    assert_exactly_once(env)


def test_a_discard_stands_through_a_redrive_of_other_letters_and_a_rebuild(env, spark):
    last = _world(env, spark)
    others = [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq WHERE status = 'quarantined'")]
    _check(env, 27.5)  # 21 and 22 pass now, 23 .. 29 still fail
    rep = env.redrive(spark, ids=others, by="fay")
    assert rep.ok and rep.redrive["redriven"] == 2, rep.summary()
    assert _letter(env, last)[:3] == ("discarded", "dora", NOTE)
    # A redrive takes quarantined letters only: a discarded one asked for is skipped.
    rep = env.redrive(spark, ids=[last], by="fay")
    assert rep.redrive["skipped"] == [last], rep.summary()
    assert _letter(env, last) == ("discarded", "dora", NOTE, 1)

    report = env.run(spark, mode=Rebuild("main"), sink_names=["main"])
    assert report.ok, report.summary()
    assert _letter(env, last) == ("discarded", "dora", NOTE, 2)
    assert _live(env)[0] == 6
    assert _ids(env) == list(range(23))
    assert_exactly_once(env)


def test_a_discarded_record_that_passes_now_is_placed_and_its_letter_resolved(env, spark):
    last = _world(env, spark)
    assert env.run(spark, mode=Backfill([Range(0, 0, 30)])).ok  # fails again: stands
    assert _letter(env, last)[0] == "discarded"
    _check(env, 100)
    report = env.run(spark, mode=Backfill([Range(0, 0, 30)]), by="erin")
    assert report.ok, report.summary()
    assert _ids(env) == list(range(30))
    status, by, note, _ = _letter(env, last)
    assert (status, by) == ("redriven", "erin") and "backfill" in note
    assert _live(env)[0] == 0
    assert_exactly_once(env)


def test_prune_keeps_a_discarded_letters_place_and_may_drop_its_payload(env, spark):
    last = _world(env, spark)
    _check(env, 27.5)
    assert env.run(spark, mode=Backfill([Range(0, 0, 30)])).ok  # 21, 22 redriven
    redriven = [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq WHERE status = 'redriven'")]
    assert len(redriven) == 2
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute(
            "UPDATE tidemark.dlq SET resolved_at = now() - interval '40 days' "
            "WHERE status <> 'quarantined'"
        )
    code, out, err = tm(env.cli_env(), "prune", "--dry-run")
    assert code == 0, err
    counts = {ln[:26].strip(): ln[26:].split()[0] for ln in out.splitlines()[2:] if ln[26:]}
    assert counts["dead letters"] == "2", out
    assert counts["discarded payloads"] == "1", out
    assert "their rows stay" in out

    s = prune(env.ledger_dsn, Policy(), env.tmp / "docs")
    assert s.rows["dlq"] == 2 and s.rows["dlq_payloads"] == 1, s.rows
    assert env.ledger("SELECT id FROM tidemark.dlq WHERE id = ANY(%s)", (redriven,)) == []
    kept = env.ledger(
        "SELECT status::text, resolved_by, note, sink, source_partition, source_offset, key, "
        "payload, headers, source_headers, detail, pruned_at IS NOT NULL "
        "FROM tidemark.dlq WHERE id = %s",
        (last,),
    )
    assert kept == [("discarded", "dora", NOTE, "main", 0, 29, b"29", None, None, None, None, True)]
    assert_exactly_once(env)
    # Nothing left to drop; in JSON, the same words.
    code, out, err = tm(env.cli_env(), "prune", "--json")
    assert code == 0, err
    assert json.loads(out)["rows"].get("dlq_payloads", 0) == 0

    # Still failing, still discarded, its payload still dropped.
    assert env.run(spark, mode=Backfill([Range(0, 0, 30)])).ok
    assert _letter(env, last)[:3] == ("discarded", "dora", NOTE)
    assert env.ledger("SELECT payload FROM tidemark.dlq WHERE id = %s", (last,)) == [(None,)]
    assert_exactly_once(env)
    # Passing, it is placed; failing again later, it is live again with its bytes back
    # from its record, for a redrive to replay.
    _check(env, 100)
    assert env.run(spark, mode=Backfill([Range(0, 0, 30)])).ok
    assert _letter(env, last)[0] == "redriven" and 29 in _ids(env)
    _check(env, 25)
    assert env.run(spark, mode=Backfill([Range(0, 0, 30)])).ok
    back = env.ledger(
        "SELECT status::text, payload, headers, source_headers IS NOT NULL, pruned_at "
        "FROM tidemark.dlq WHERE id = %s",
        (last,),
    )
    body = env.ledger('SELECT payload, headers FROM src.log WHERE "offset" = 29')[0]
    assert back == [("quarantined", body[0], body[1], True, None)]
    assert_exactly_once(env)


def _page(env, lid: int) -> str:
    """The letter's page as the web app renders it (without Airflow in front)."""
    from tidemark.web import views
    from tidemark.web.context import Web, templates

    web = Web(jinja=templates())
    request = Request(
        {
            "type": "http",
            "method": "GET",
            "path": f"/dlq/record/{lid}",
            "root_path": "/tidemark",
            "query_string": b"",
            "headers": [],
            "server": ("localhost", 8080),
            "scheme": "http",
        }
    )
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        rec = dlq.get(c, lid, payload_limit=views.SHOW_BYTES)
    assert rec is not None
    page = web.html(
        request,
        "record.html",
        r=views.record(web, request, rec, "auto"),
        fmt="auto",
        formats=["auto", "text", "hex"],
        show_bytes=views.SHOW_BYTES,
        can_act=True,
        headers_text=views.headers_text(rec),
    )
    return bytes(page.body).decode()


def test_the_letter_page_shows_an_earlier_resolution_as_history(env):
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        # A letter resolved once and live again since (its record failed again), as the
        # ledger keeps it: who resolved it before, when and the note stay.
        (again,) = c.execute(
            """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
               source_offset, key, payload, error_class, reason, attempts, status, resolved_by,
               resolved_at, note) VALUES ('orders', 'main', 1, 0, 7, 'k', '{}', 'validation',
               'amount too big', 2, 'quarantined', 'admin', now() - interval '1 day',
               'duplicate of order 6') RETURNING id"""
        ).fetchone()
    page = _page(env, again)
    assert 'id="status">quarantined<' in page
    assert 'id="resolved-by"' not in page  # no resolution beside a live badge
    assert 'id="earlier"' in page and "admin" in page and "duplicate of order 6" in page
    assert "failed again since" in page
    assert 'id="discard-form"' in page  # live: it still needs a decision
    code, out, err = tm(env.cli_env(), "dlq", "show", str(again))
    assert code == 0, err
    assert "earlier    by admin" in out and "failed again since" in out
    assert "resolved   by" not in out


def test_the_page_of_a_discarded_letter_whose_payload_retention_dropped(env):
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        (done,) = c.execute(
            """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
               source_offset, key, payload, error_class, reason, status, resolved_by,
               resolved_at, note, pruned_at) VALUES ('orders', 'main', 1, 0, 8, 'k', NULL,
               'validation', 'amount too big', 'discarded', 'admin', now(), 'test data',
               now()) RETURNING id"""
        ).fetchone()
    page = _page(env, done)
    assert 'id="status">discarded<' in page and 'id="resolved-by">admin<' in page
    assert 'id="discard-form"' not in page
    assert 'id="payload-pruned"' in page and "retention" in page
    code, out, err = tm(env.cli_env(), "dlq", "show", str(done))
    assert code == 0, err
    assert "resolved   by admin" in out and "retention dropped the payload" in out
