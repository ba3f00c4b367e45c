"""Redrive: quarantined records replayed through the current pipeline code, exactly once, the
dead letters' status changing in the same two-phase commit as the sink writes; and a crash
(SIGKILL of the whole job) mid-redrive, then recovery. Real Spark, PostgreSQL and GX."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime

import pytest

from tests.invariants import assert_exactly_once
from tests.proc import JobProcess

ROWS = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
LOOSER = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 1000}}
BATCH = {"expect_table_row_count_to_be_between": {"min_value": 10}}  # never met by a redrive


def _world(env, spark, sinks: int = 1):
    """100 orders (ids >= 81 fail the row check: amount = id * 1.25), one record that is not
    JSON; after a first run 19 + 1 dead letters per sink (a letter names its sink)."""
    env.append_orders(range(100))
    env.append([(0, b"poison", b"{not json", None, None)])
    targets = [
        {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]},
        {"name": "second", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]},
    ][:sinks]
    env.pipeline(sinks=targets, quality={"rows": [ROWS], "batch": [BATCH]})
    report = env.run(spark)
    assert report.ok, report.summary()
    return targets


def _letters(env) -> dict[int, tuple]:
    """id -> (class, status, attempts, resolved_by, amount in the payload)."""
    out = {}
    for i, cls, status, attempts, by, payload in env.ledger(
        "SELECT id, error_class::text, status::text, attempts, resolved_by, payload "
        "FROM tidemark.dlq ORDER BY id"
    ):
        try:
            amount = json.loads(bytes(payload))["amount"]
        except ValueError:
            amount = None
        out[i] = (cls, status, attempts, by, amount)
    return out


def _ids(letters, pred) -> list[int]:
    return [i for i, v in letters.items() if pred(v)]


def _redrive(env, spark, ids, by="alice", **kw):
    return env.redrive(spark, ids=ids, by=by, **kw)


def _count(env, dsn, where="true") -> int:
    return env.q(dsn, f"SELECT count(*) FROM public.orders WHERE {where}")[0][0]


def test_redrive_delivers_what_now_passes_once_and_keeps_what_fails_again(env, spark):
    targets = _world(env, spark, sinks=2)
    before = {s["name"]: env.checkpoints(sink=s["name"]) for s in targets}
    letters = _letters(env)
    # Per sink: ids 81 .. 92 now pass, 93 .. 99 fail again, one is not JSON.
    passing = _ids(letters, lambda v: v[0] == "validation" and v[4] <= 115)
    failing = _ids(letters, lambda v: v[0] == "validation" and v[4] > 115)
    poison = _ids(letters, lambda v: v[0] == "decode")
    assert len(passing) == 2 * 12 and len(failing) == 2 * 7 and len(poison) == 2
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("main", 20),
        ("second", 20),
    ]

    # The fix: the row check now allows up to 115.
    env.pipeline(
        sinks=targets,
        quality={
            "rows": [
                {"expect_column_values_to_be_between": {"column": "amount", "max_value": 115}}
            ],
            "batch": [BATCH],
        },
    )
    report = _redrive(env, spark, passing + failing + poison)
    assert report.ok, report.summary()
    assert report.mode == "redrive"
    assert report.redrive["redriven"] == 24
    assert sorted(report.redrive["failed_again"]) == sorted(failing + poison)

    after = _letters(env)
    for i in passing:
        assert after[i][1:4] == ("redriven", 1, "alice")
    for i in failing + poison:
        assert after[i][1:3] == ("quarantined", 2), after[i]
    assert len(after) == 40  # no new dead letters: failures kept their own
    reason, run = env.ledger(
        "SELECT reason, run_id FROM tidemark.dlq WHERE id = %s", (failing[0],)
    )[0]
    assert run == report.run_id and "expect_column_values_to_be_between" in reason
    for s in targets:  # both sinks got the 12, once; checkpoints did not move
        assert _count(env, s["dsn"]) == 81 + 12
        assert _count(env, s["dsn"], "id BETWEEN 81 AND 92") == 12
        assert env.checkpoints(sink=s["name"]) == before[s["name"]]
    assert (
        env.ledger(
            "SELECT mode, state::text FROM tidemark.runs JOIN tidemark.run_sinks "
            "USING (run_id) WHERE run_id = %s",
            (report.run_id,),
        )
        == [("redrive", "committed")] * 2
    )
    assert_exactly_once(env, sinks={s["name"]: s["dsn"] for s in targets})

    # Again: the redriven are skipped, nothing is written twice.
    again = _redrive(env, spark, passing)
    assert again.run_id is None and sorted(again.redrive["skipped"]) == sorted(passing)
    for s in targets:
        assert _count(env, s["dsn"]) == 93


def test_redrive_from_the_cli_by_class_and_bad_input(env, spark):
    _world(env, spark)
    env.pipeline(
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}],
        quality={"rows": [LOOSER]},
    )
    out = subprocess.run(
        env.cli_argv(
            "dlq",
            "redrive",
            "orders",
            "--class",
            "validation",
            "--all",
            "--yes",
            "--by",
            "bob",
            "--json",
        ),
        env=env.cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["mode"] == "redrive" and rep["redrive"]["redriven"] == 19
    assert env.ledger(
        "SELECT request_id, requested_by, letters FROM tidemark.redrive_requests"
    ) == [(rep["redrive"]["request"], "bob", 19)]
    assert _count(env, env.sink_dsn) == 100
    assert env.ledger(
        "SELECT count(*) FROM tidemark.dlq WHERE status = 'redriven' AND resolved_by = 'bob'"
    ) == [(19,)]
    assert_exactly_once(env)

    for argv, msg in [
        (["orders"], "give dead-letter ids"),
        (["orders", "x1"], "'x1' is not a dead-letter id"),
        (["orders", "--class", "nope"], "error_class 'nope'"),
        (["orders", "4", "--class", "validation"], "not both"),
        (["orders", "--request", "1", "--all"], "no ids or filters"),
        (["orders", "--request", "999"], "no redrive request 999"),
    ]:
        bad = subprocess.run(
            env.cli_argv("dlq", "redrive", *argv),
            env=env.cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode != 0 and msg in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


@pytest.mark.engines("local", "spark", "connect")
def test_a_sink_write_failure_keeps_its_own_dead_letter(env, engine):
    """A record quarantined at one sink (class sink_write) goes back to that sink only."""
    env.append_orders(range(10))
    env.pipeline()
    assert env.run(engine).ok
    env.append_orders([50, 51])
    with _Conn(env.sink_dsn) as c:
        c.execute("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (id < 50)")
    rep = env.run(engine)
    assert rep.ok and rep.sinks["main"].counts.dead == 2
    ids = [
        i
        for (i,) in env.ledger(
            "SELECT id FROM tidemark.dlq WHERE error_class = "
            "'sink_write' AND sink = 'main' ORDER BY id"
        )
    ]
    assert len(ids) == 2
    rep = _redrive(env, engine, ids)  # still refused by the sink
    assert rep.ok and sorted(rep.redrive["failed_again"]) == ids
    assert env.ledger("SELECT DISTINCT attempts, status::text FROM tidemark.dlq") == [
        (2, "quarantined")
    ]
    with _Conn(env.sink_dsn) as c:
        c.execute("ALTER TABLE public.orders DROP CONSTRAINT small")
    rep = _redrive(env, engine, ids)
    assert rep.ok and rep.redrive["redriven"] == 2
    assert _count(env, env.sink_dsn) == 12
    assert_exactly_once(env)


class _Conn:
    def __init__(self, dsn):
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)

    def __enter__(self):
        return self.conn

    def __exit__(self, *exc):
        self.conn.close()


# point -> does the decision exist when the job dies (recovery then rolls forward)
CRASH = {
    "task_after_prepare": False,
    "after_prepare": False,
    "after_decide": True,
    "mid_finish": True,
}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(CRASH))
def test_a_crash_mid_redrive_then_recovery_leaves_it_exactly_once(env, spark, point):
    _world(env, spark)
    env.pipeline(
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}],
        quality={"rows": [LOOSER]},
    )
    ids = _ids(_letters(env), lambda v: v[0] == "validation")
    job = JobProcess(
        env.cli_argv("dlq", "redrive", "orders", *map(str, ids), "--by", "carol"),
        env.cli_env(),
        crash_at=point,
    )
    assert job.wait() == -signal.SIGKILL, job.output()
    assert env.prepared() != [] or point == "mid_finish"

    assert env.recover().ok
    statuses = {
        s
        for (s,) in env.ledger(
            "SELECT DISTINCT status::text FROM tidemark.dlq WHERE error_class = 'validation'"
        )
    }
    if CRASH[point]:  # decided: rolled forward, the 19 are in the sink and redriven
        assert statuses == {"redriven"}
        assert _count(env, env.sink_dsn) == 100
    else:  # undecided: rolled back, nothing changed
        assert statuses == {"quarantined"}
        assert _count(env, env.sink_dsn) == 81
    assert_exactly_once(env)

    rep = _redrive(env, spark, ids)  # finishing the job: the rest goes through, once
    assert rep.ok or rep.run_id is None, rep.summary()
    assert _count(env, env.sink_dsn) == 100
    assert env.ledger(
        "SELECT count(*) FROM tidemark.dlq WHERE status = 'redriven' AND attempts = 1"
    ) == [(19,)]
    assert_exactly_once(env)


N_LARGE = 100_000


def large_redrive(env, spark, n: int = N_LARGE, log=lambda m: None):
    """After a bad deploy: ``n`` records in the log, each quarantined for sink main as
    ``validation`` (letters made with one INSERT ... SELECT from the log), the sink's
    checkpoint past them all. Then every validation letter is redriven at once, as
    `tidemark dlq redrive orders --class validation --all` does: a request made from the
    filter in the ledger, one run. Returns (report, seconds of the redrive)."""
    import time

    from tidemark import config
    from tidemark.driver.redrive import redrive_run
    from tidemark.ledger import dlq, redrives

    env.append_orders(range(n))
    env.pipeline(
        quality={
            "rows": [{"expect_column_values_to_be_between": {"column": "amount", "min_value": 0}}]
        }
    )
    with _Conn(env.ledger_dsn) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        c.execute("""INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset)
                     SELECT 'orders', 'main', "partition", max("offset") + 1 FROM src.log
                     GROUP BY 3""")
        c.execute("""INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
                         source_offset, key, payload, headers, error_class, reason,
                         source_headers, source_ts, source_kept)
                     SELECT 'orders', 'main', 1, "partition", "offset", key, payload, headers,
                            'validation', 'amount: expect_column_values_to_be_between',
                            convert_to(headers::text, 'UTF8'), ts, true
                     FROM src.log""")
        c.execute("ANALYZE tidemark.dlq")
    all_p, _ = config.load_all(env.dir)
    started = time.monotonic()
    with _Conn(env.ledger_dsn) as c:
        req = redrives.create(
            c, "orders", "dave", filters=dlq.Filters.parse(error_class="validation")
        )
    report = redrive_run(
        all_p["orders"],
        env.settings(),
        ledger_dsn=env.ledger_dsn,
        request=req.request_id,
        by="dave",
        all_pipelines=all_p,
        spark=spark,
        log=log,
    ).execute()
    return report, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_redrive_of_100000_letters_places_each_exactly_once(env, spark, record_property):
    report, seconds = large_redrive(env, spark)
    print(
        f"\nredrive of {N_LARGE:,} letters: {seconds:.1f}s wall "
        f"(run {report.run_id}: {report.phases})"
    )
    record_property("redrive_seconds", round(seconds, 1))
    assert report.ok, report.summary()
    assert report.redrive["redriven"] == N_LARGE, report.summary()
    assert report.redrive["failed_again"] == [] and report.redrive["skipped"] == []
    assert _count(env, env.sink_dsn) == N_LARGE
    assert _count(env, env.sink_dsn, f"_tm_run_id = {int(report.run_id)}") == N_LARGE
    assert env.ledger(
        "SELECT status::text, resolved_by, count(*) FROM tidemark.dlq GROUP BY 1, 2"
    ) == [("redriven", "dave", N_LARGE)]
    # The selection lives in the ledger, one row per letter; the job got only its id.
    request = report.redrive["request"]
    assert env.ledger(
        "SELECT count(*) FROM tidemark.redrive_letters WHERE request_id = %s", (request,)
    ) == [(N_LARGE,)]
    assert env.ledger(
        "SELECT pipeline, requested_by, letters, selection FROM tidemark.redrive_requests"
    ) == [("orders", "dave", N_LARGE, {"pipeline": "orders", "error_class": "validation"})]
    assert env.prepared() == []
    assert_exactly_once(env)


# Headers text jsonb would not give back: it reorders keys, drops the extra space, keeps one
# "b" and refuses \u0000 (the letter's jsonb column holds it base64-wrapped).
EXACT_HEADERS = '{"b": 1,  "a": "x\\u0000y", "b": 2}'
TS = datetime(2026, 3, 1, 12, 34, 56, 789012, tzinfo=UTC)
SEEN = {
    "id": "id",
    "name": "name",
    "amount": "amount",
    "version": "version",
    "seen_at": "_tm_ts",
    "h": "_tm_headers",
}


def _exec(env, statement: str, params=()) -> None:
    with _Conn(env.ledger_dsn) as c:
        c.execute(statement, params)


def _seen_world(env, spark, version: str | None):
    """A source whose headers column keeps the JSON text as written (json, not jsonb), ids
    1 .. 3 that pass, 200 that fails the row check (amount 250) and 300 that fails to decode
    (version "v3" is not an int), both with EXACT_HEADERS and TS. The transform reads
    _tm_ts and _tm_headers; ``version`` is the sink's version column."""
    _exec(env, "ALTER TABLE src.log ALTER COLUMN headers TYPE json")
    good = [
        (
            i % 2,
            str(i).encode(),
            json.dumps({"id": i, "name": f"o{i}", "amount": 1.5, "version": 1}).encode(),
            '{"ok": 1}',
            TS,
        )
        for i in (1, 2, 3)
    ]
    bad = [
        (
            0,
            b"200",
            json.dumps({"id": 200, "name": "big", "amount": 250.0, "version": 1}).encode(),
            EXACT_HEADERS,
            TS,
        ),
        (
            1,
            b"300",
            json.dumps({"id": 300, "name": "v", "amount": 1.0, "version": "v3"}).encode(),
            EXACT_HEADERS,
            TS,
        ),
    ]
    env.append(good + bad)
    sink = {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}
    if version:
        sink["version"] = version
    env.pipeline(
        transform={"select": SEEN, "required": ["id"]}, sinks=[sink], quality={"rows": [ROWS]}
    )
    rep = env.run(spark)
    assert rep.ok and rep.sinks["main"].counts.dead == 2, rep.summary()
    return sink


def _fixed(env, sink):
    """The fix: version may be "v<n>", amounts up to 1000."""
    env.pipeline(
        decode={"schema": {"id": "int", "name": "string", "amount": "double", "version": "string"}},
        transform={
            "select": {**SEEN, "version": "cast(regexp_replace(version, '^v', '') as int)"},
            "required": ["id"],
        },
        sinks=[sink],
        quality={"rows": [LOOSER]},
    )


def test_a_redrive_hands_the_transform_the_source_headers_and_timestamp(env, spark):
    """The letters keep the headers byte for byte and the source timestamp; a redrive hands
    them to the transform as a delivery would. With the timestamp as the sink's version column
    the redriven records are placed (a NULL _tm_ts made them fail: version column NULL)."""
    sink = _seen_world(env, spark, version="seen_at")
    got = env.ledger(
        "SELECT error_class::text, source_headers, source_ts, source_kept "
        "FROM tidemark.dlq ORDER BY source_offset, source_partition"
    )
    assert sorted(g[0] for g in got) == ["decode", "validation"]
    for _, stored, ts, kept in got:
        assert (bytes(stored).decode(), ts, kept) == (EXACT_HEADERS, TS, True)
    assert env.q(env.sink_dsn, "SELECT seen_at, h FROM public.orders WHERE id = 1") == [
        (TS, '{"ok": 1}')
    ]

    _fixed(env, sink)
    ids = [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq ORDER BY id")]
    rep = _redrive(env, spark, ids)
    assert rep.ok, rep.summary()
    assert rep.redrive["redriven"] == 2 and rep.redrive["failed_again"] == [], rep.redrive
    assert rep.redrive["source_unknown"] == []
    assert env.q(
        env.sink_dsn,
        "SELECT id, seen_at, h, version FROM public.orders WHERE id >= 200 ORDER BY id",
    ) == [(200, TS, EXACT_HEADERS, 1), (300, TS, EXACT_HEADERS, 3)]
    assert_exactly_once(env)


def test_letters_from_before_v007_get_the_source_fields_or_say_why_not(env, spark):
    """A letter written before V007 kept neither (its new columns NULL). The redrive reads
    them from the source; where the source no longer holds the record, the letter says why,
    and the transform gets a NULL _tm_ts and the headers as the letter stored them."""
    from tidemark.driver.redrive import fill_source_fields
    from tidemark.ledger import letters

    sink = _seen_world(env, spark, version=None)
    # The old shape: what V007 leaves of a letter written before it.
    _exec(
        env, "UPDATE tidemark.dlq SET source_headers = NULL, source_ts = NULL, source_kept = NULL"
    )
    kept, lost = (
        i
        for (i,) in env.ledger(
            "SELECT id FROM tidemark.dlq ORDER BY source_offset, source_partition"
        )
    )
    legacy = env.ledger("SELECT headers::text FROM tidemark.dlq WHERE id = %s", (lost,))[0][0]
    assert "_tm_unstorable_headers_base64" in legacy
    # Retention took record 300 (partition 1, below the checkpoint) from the log.
    _exec(env, 'DELETE FROM src.log WHERE "partition" = 1 AND key = %s', (b"300",))

    def fields() -> dict[int, tuple]:
        return {
            i: (None if h is None else bytes(h).decode(), ts, k, note)
            for i, h, ts, k, note in env.ledger(
                "SELECT id, source_headers, source_ts, source_kept, source_note FROM tidemark.dlq"
            )
        }

    # Before the fix both fail again: quarantined again, a letter keeps what it knows (the
    # headers the redrive handed back for the lost one are not the source's).
    rep = _redrive(env, spark, [kept, lost])
    assert rep.ok and sorted(rep.redrive["failed_again"]) == sorted([kept, lost]), rep.summary()
    again = fields()
    assert again[kept] == (EXACT_HEADERS, TS, True, None)
    assert again[lost] == (None, None, False, letters.SOURCE_GONE)

    _fixed(env, sink)
    rep = _redrive(env, spark, [kept, lost])
    assert rep.ok, rep.summary()
    assert rep.redrive["redriven"] == 2 and rep.redrive["source_unknown"] == [lost]
    assert "1 replayed with a NULL _tm_ts: the source no longer holds" in rep.summary()
    assert env.q(
        env.sink_dsn, "SELECT id, seen_at, h FROM public.orders WHERE id >= 200 ORDER BY id"
    ) == [(200, TS, EXACT_HEADERS), (300, None, legacy)]
    assert fields() == again
    show = subprocess.run(
        env.cli_argv("dlq", "show", str(lost)),
        env=env.cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert show.returncode == 0, show.stderr
    assert f"  source ts  -   {letters.SOURCE_GONE}" in show.stdout
    assert f"  headers    {legacy}" in show.stdout
    assert "no longer holds this record" in letters.SOURCE_GONE
    # Resolving the letter kept the reason (the note says who redrove it).
    assert env.ledger("SELECT status::text, note FROM tidemark.dlq WHERE id = %s", (lost,)) == [
        ("redriven", f"redriven by run {rep.run_id}")
    ]

    # Once known (or known lost), never looked up again.
    _exec(env, "UPDATE tidemark.dlq SET status = 'quarantined'")
    assert fill_source_fields(env.ledger_dsn, env.load(), rep.redrive["request"], ["main"]) == 0
