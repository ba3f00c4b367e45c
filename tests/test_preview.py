"""Preview (issue 36 point 5): a dry run of a backfill or a redrive goes through claim, write
and verify like the real one, reports per sink what it would do, then rolls everything back:
the sink rows, the dead letters, the checkpoints and the prepared transactions are exactly as
before, and the real run then does what the preview said. Real PostgreSQL and Spark."""

from __future__ import annotations

import json

import pytest

from tidemark.core.errors import BadInput
from tidemark.core.ranges import Range
from tidemark.driver.run import Backfill, Run

ROWS = "expect_column_values_to_be_between"


def _world(env) -> dict[str, list[tuple]]:
    """Everything a run may change that a preview must leave as it was."""
    dbs = [env.names["ledger"], env.names["sink"], env.names["sink2"]]
    return {
        "rows": env.q(env.sink_dsn, "SELECT * FROM public.orders ORDER BY id"),
        "columns": env.q(
            env.sink_dsn,
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'orders' ORDER BY ordinal_position",
        ),
        "letters": env.ledger("SELECT * FROM tidemark.dlq ORDER BY id"),
        "checkpoints": env.ledger("SELECT * FROM tidemark.checkpoints ORDER BY 1, 2, 3"),
        "leases": env.ledger("SELECT pipeline, sink, run_id, owner FROM tidemark.leases"),
        "prepared": env.q(
            env.ledger_dsn,
            "SELECT gid, database FROM pg_prepared_xacts WHERE database = ANY(%s)",
            (dbs,),
        ),
    }


def _counts(report, sink: str = "main") -> dict:
    out = report.sinks[sink]
    counts = {k: n for k, n in out.counts.to_json().items() if k != "records"}
    return {**counts, "classes": out.classes}


def _assert_previewed(env, preview, before: dict) -> None:
    assert preview.ok and preview.dry_run, preview.summary()
    assert all(
        s.previewed and s.state == "previewed" and s.error is None for s in preview.sinks.values()
    )
    assert _world(env) == before
    # The ledger keeps the preview as its own state, that left nothing for recovery.
    states = env.ledger(
        "SELECT state::text, error FROM tidemark.run_sinks WHERE run_id = %s", (preview.run_id,)
    )
    assert states == [("previewed", None)] * len(preview.sinks)
    rec = env.recover()
    assert not (rec.rolled_forward or rec.aborted or rec.rolled_back or rec.errors), rec
    summary = preview.summary()
    assert summary.startswith("dry run: nothing was committed"), summary
    assert preview.to_dict()["dry_run"] is True


@pytest.mark.engines("spark", "connect")
def test_a_backfill_preview_changes_nothing_and_reports_what_the_backfill_then_does(env, engine):
    """After a check changes, the preview of a backfill says which rows go, which records
    quarantine and which letters resolve; between it and the backfill nothing moved."""
    records = [(7, 200), (7, 500), (7, 50), (8, 500), (8, 50), (9, 150)]
    env.append(
        [
            (
                0,
                str(i).encode(),
                json.dumps({"id": i, "name": "x", "amount": a, "version": 1}).encode(),
                None,
                None,
            )
            for i, a in records
        ]
    )
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 300}}]})
    assert env.run(engine).ok
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "min_value": 100}}]})
    before = _world(env)

    preview = env.run(engine, mode=Backfill([Range(0, 1, 5)]), dry_run=True)
    _assert_previewed(env, preview, before)
    summary = preview.summary()
    assert "rows removed (the range's, replaced by position): 2" in summary, summary
    assert "records quarantined (new letters or live again): 2 (validation 2)" in summary, summary
    assert "dead letters resolved: 2" in summary, summary

    real = env.run(engine, mode=Backfill([Range(0, 1, 5)]))
    assert real.ok and not real.dry_run, real.summary()
    assert _counts(preview) == _counts(real)
    assert _counts(real)["removed"] == 2 and _counts(real)["resolved"] == 2
    assert _world(env)["rows"] != before["rows"]  # the backfill did change what it said


def test_a_redrive_preview_leaves_the_letters_quarantined_and_its_request_reusable(env, spark):
    """One letter would pass now, one would fail again: the preview says so, touches
    neither, and the same request then redrives them as it said."""
    amounts = [200, 500, 900, 50]
    env.append(
        [
            (
                0,
                str(i).encode(),
                json.dumps({"id": i, "name": "x", "amount": a, "version": 1}).encode(),
                None,
                None,
            )
            for i, a in enumerate(amounts)
        ]
    )
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 300}}]})
    assert env.run(spark).ok
    ids = {o: i for i, o in env.ledger("SELECT id, source_offset FROM tidemark.dlq")}
    assert set(ids) == {1, 2}
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 600}}]})
    before = _world(env)

    preview = _redrive(env, spark, ids=sorted(ids.values()), dry_run=True)
    _assert_previewed(env, preview, before)
    assert preview.redrive is not None
    assert preview.redrive["redriven"] == 1 and preview.redrive["failed_again"] == [ids[2]]
    summary = preview.summary()
    assert "1 would be redriven, 1 would fail again" in summary, summary
    assert f"--request {preview.redrive['request']}" in summary, summary

    real = _redrive(env, spark, request=preview.redrive["request"])
    assert real.ok, real.summary()
    assert real.redrive is not None
    assert {k: real.redrive[k] for k in ("redriven", "failed_again", "skipped")} == {
        k: preview.redrive[k] for k in ("redriven", "failed_again", "skipped")
    }
    assert _counts(preview) == _counts(real)
    letters = env.ledger(
        "SELECT source_offset, status::text, attempts FROM tidemark.dlq ORDER BY source_offset"
    )
    assert letters == [(1, "redriven", 1), (2, "quarantined", 2)]


def test_a_preview_with_a_new_output_column_says_it_would_add_it_and_adds_nothing(env, spark):
    env.append_orders(range(6), partitions=1)
    env.pipeline()
    assert env.run(spark).ok
    env.pipeline(
        transform={
            "select": {
                "id": "id",
                "name": "name",
                "amount": "amount",
                "version": "version",
                "domain": "concat(name, '.example')",
            }
        }
    )
    before = _world(env)

    preview = env.run(spark, mode=Backfill([Range(0, 0, 6)]), dry_run=True)
    _assert_previewed(env, preview, before)
    assert preview.sinks["main"].schema_changes == ["would add column domain text"]
    assert "table: would add column domain text" in preview.summary()

    real = env.run(spark, mode=Backfill([Range(0, 0, 6)]))
    assert real.ok, real.summary()
    assert real.sinks["main"].schema_changes == ["added column domain text"]
    assert _counts(preview) == _counts(real)
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders WHERE domain IS NOT NULL") == [(6,)]


def test_a_dry_run_of_an_at_least_once_pipeline_is_refused(env):
    env.pipeline(delivery="at_least_once")
    with pytest.raises(BadInput, match="needs delivery: exactly_once"):
        Run(env.load(), env.settings(), ledger_dsn=env.ledger_dsn, dry_run=True)


def _redrive(env, spark, **kw):
    from tidemark import config
    from tidemark.driver.redrive import redrive_run

    all_p, _ = config.load_all(env.dir)
    return redrive_run(
        all_p["orders"],
        env.settings(),
        ledger_dsn=env.ledger_dsn,
        by="alice",
        all_pipelines=all_p,
        spark=spark,
        log=lambda m: None,
        **kw,
    ).execute()
