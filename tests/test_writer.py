"""The write task without Spark (tidemark/engine/writer.py, ``run_task``): fed Arrow batches
shaped as the driver's Spark job hands them (the source's columns, the row verdict, the
transform's output), against real PostgreSQL sinks and ledger. Asserts on the TaskResult the
driver reads and on what PostgreSQL holds: prepared transactions, the rows after COMMIT
PREPARED, the dead letters."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from tidemark.config import pg_type
from tidemark.core.columns import HEADERS, KEY, OFFSET, PARTITION, PAYLOAD, TS
from tidemark.core.participants import Target
from tidemark.engine.records import ERR_CLASS, ERR_REASON
from tidemark.engine.writer import run_task
from tidemark.ledger import redrives, state
from tidemark.protocol import coverage, sinks, twopc
from tidemark.protocol.taskspec import (
    Accounting,
    Backfilling,
    ByKey,
    ByRanges,
    ByRecords,
    CopyFormat,
    Delivering,
    Placement,
    Redriving,
    SinkTarget,
    Span,
    TaskResult,
    TaskSpec,
)
from tidemark.sources import SCHEMA as SOURCE_SCHEMA

# The conftest pipeline's transform output, as Spark types (records.output_columns).
OUTPUT = {"id": "int", "name": "string", "amount": "double", "version": "int"}
ARROW = {"int": pa.int32(), "string": pa.string(), "double": pa.float64()}
# What mapInArrow hands the task: the source's columns, the row verdict, the output columns.
SCHEMA = pa.schema(
    [
        *SOURCE_SCHEMA,
        (ERR_CLASS, pa.string()),
        (ERR_REASON, pa.string()),
        *[(n, ARROW[t]) for n, t in OUTPUT.items()],
    ]
)
RUN = 7
TABLE = "public.orders"


def order(
    partition: int,
    offset: int,
    id: int | None = None,
    *,
    error: tuple[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One record as the job hands it: by default order ``id`` (= offset) that decoded, its
    output columns as in its payload; ``fields`` overrides them, ``error`` is its verdict."""
    id = offset if id is None else id
    body = {"id": id, "name": f"order-{id}", "amount": 1.25, "version": 1} | fields
    row: dict[str, Any] = {
        PARTITION: partition,
        OFFSET: offset,
        KEY: str(id).encode(),
        PAYLOAD: json.dumps(body).encode(),
        HEADERS: json.dumps({"v": body["version"]}),
        TS: datetime(2024, 1, 1, tzinfo=UTC),
        ERR_CLASS: error[0] if error else None,
        ERR_REASON: error[1] if error else None,
    }
    return row | ({n: None for n in OUTPUT} if error else body)


def batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=SCHEMA)


def orders(partition: int, offsets: range, **kw: Any) -> pa.RecordBatch:
    return batch([order(partition, o, **kw) for o in offsets])


class Bench:
    """A pipeline with sinks ``main`` (env.sink_dsn) and ``copy`` (env.sink2_dsn), their tables
    made as the driver makes them (``ddl``: a table the user made first), and the task run as
    Spark would run it."""

    def __init__(self, env: Any, ddl: dict[str, str] | None = None) -> None:
        self.env = env
        self.dsn = {"main": env.sink_dsn, "copy": env.sink2_dsn}
        env.pipeline(
            sinks=[
                {"name": s, "dsn": dsn, "table": TABLE, "key": ["id"]}
                for s, dsn in self.dsn.items()
            ]
        )
        self.pipeline = env.load()
        # A task that waits on a row lock it should not (a broken rollback of an earlier
        # attempt) fails in seconds instead of the default minute.
        self.settings = env.settings(lock_timeout_ms=3000)
        with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
            sinks.prepare_database(c, "ledger")  # as every run does first
        columns = [(n, pg_type(t)) for n, t in OUTPUT.items()]
        for s in sinks.resolve(self.pipeline):
            for stmt in (ddl or {}).get(s.name, "").split(";"):
                if stmt.strip():
                    self.sql(s.name, stmt)
            sinks.ensure_table(s, columns, f"sink {s.name}")

    def spec(
        self,
        ranges: dict[str, dict[int, tuple[int, int]]],
        accounting: Accounting,
        placement: Placement | None = None,
        run_id: int = RUN,
        prepare: bool = True,
    ) -> TaskSpec:
        """As the driver's Writer._spec builds it: one SinkTarget per sink written."""
        targets = [
            SinkTarget(
                name=s.name,
                dsn=self.dsn[s.name],
                table=s.table,
                key=s.key,
                version=s.version,
                ranges=ranges[s.name],
                tombstones=self.pipeline.tombstones_of(s),
            )
            for s in self.pipeline.sinks
            if s.name in ranges
        ]
        return TaskSpec(
            run_id=run_id,
            pipeline=self.pipeline.name,
            prefix=self.settings.gid_prefix,
            prepare=prepare,
            lock_timeout_ms=self.settings.lock_timeout_ms,
            ledger_dsn=self.env.ledger_dsn,
            columns=list(OUTPUT),
            accounting=accounting,
            placement=placement or Delivering(),
            sinks=targets,
        )

    def run(
        self, spec: TaskSpec, batches: list[pa.RecordBatch], task: int = 0, attempt: int = 0
    ) -> TaskResult:
        """The task as make_task runs it: the spec through JSON, the result back through it."""
        shipped = TaskSpec.model_validate_json(spec.model_dump_json())
        result = run_task(shipped, task, attempt, iter(batches))
        return TaskResult.model_validate_json(result.model_dump_json())

    def commit(self, result: TaskResult) -> None:
        """The driver's decision: COMMIT PREPARED each participant on its database."""
        for p in result.participants:
            dsn = self.env.ledger_dsn if p.target == Target.ledger() else self.dsn[p.sink]
            with psycopg.connect(dsn, autocommit=True) as c:
                assert twopc.commit(c, p.gid) == "committed"

    def sql(self, sink: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn[sink], autocommit=True) as c:
            cur = c.execute(query, params)
            return cur.fetchall() if cur.description else []

    def rows(self, sink: str = "main") -> list[tuple[Any, ...]]:
        """(id, name, amount, partition, offset, run) of every row, by id."""
        return self.sql(
            sink,
            f"SELECT id, name, amount, _tm_partition, _tm_offset, _tm_run_id FROM {TABLE} "
            "ORDER BY id",
        )

    def prepared(self, sink: str | None = None) -> list[str]:
        dsn = self.env.ledger_dsn if sink is None else self.dsn[sink]
        with psycopg.connect(dsn, autocommit=True) as c:
            return [g for g, _ in twopc.prepared(c, "%")]

    def letters(self) -> list[tuple[Any, ...]]:
        """(sink, partition, offset, class, status, run) of every dead letter."""
        return self.env.ledger(
            "SELECT sink, source_partition, source_offset, error_class::text, status::text, "
            "run_id FROM tidemark.dlq ORDER BY sink, source_partition, source_offset"
        )


@pytest.fixture
def bench(env: Any) -> Bench:
    return Bench(env)


def by_ranges(*reads: list[Span]) -> ByRanges:
    return ByRanges(reads=list(reads))


def test_a_delivery_by_ranges_prepares_one_transaction_per_sink(bench: Bench) -> None:
    """Task 0 reads partition 0 [0, 50) in two batches; sink ``copy`` takes only [0, 30) of
    it. One prepared transaction per sink (no letters: none on the ledger), nothing visible
    before COMMIT PREPARED, then exactly the range's rows."""
    spec = bench.spec(
        {"main": {0: (0, 50)}, "copy": {0: (0, 30)}},
        by_ranges([Span(partition=0, start=0, end=50)]),
    )
    r = bench.run(spec, [orders(0, range(0, 20)), orders(0, range(20, 50))])

    assert r.error is None and r.records == 50
    assert [(p.gid, p.target, p.rows) for p in r.participants] == [
        (f"tm:{RUN}:s.main:0:0", Target.sink("main"), 50),
        (f"tm:{RUN}:s.copy:0:0", Target.sink("copy"), 30),
    ]
    main, copy = r.sinks["main"], r.sinks["copy"]
    assert (main.counts.records, main.counts.rows, main.counts.dead, main.counts.superseded) == (
        50,
        50,
        0,
        0,
    )
    assert (copy.counts.records, copy.counts.rows, copy.counts.dead, copy.counts.superseded) == (
        30,
        30,
        0,
        0,
    )
    assert r.seen == {}  # by ranges: the task itself accounts for every offset
    assert bench.prepared("main") == [f"tm:{RUN}:s.main:0:0"]
    assert bench.prepared("copy") == [f"tm:{RUN}:s.copy:0:0"]
    assert bench.prepared() == []  # no dead letters: no ledger participant
    assert bench.rows("main") == [] and bench.rows("copy") == []

    bench.commit(r)
    assert bench.prepared("main") == bench.prepared("copy") == []
    assert [(i, p, o, run) for i, _, _, p, o, run in bench.rows("main")] == [
        (o, 0, o, RUN) for o in range(50)
    ]
    assert [o for _, _, _, _, o, _ in bench.rows("copy")] == list(range(30))
    assert bench.sql("main", "SELECT gid FROM tidemark.commits") == [(f"tm:{RUN}:s.main:0:0",)]


def test_a_task_that_cannot_account_for_its_range_prepares_nothing(bench: Bench) -> None:
    """Ranges are dense: a record the transform dropped (offset 7), or one it doubled, fails
    the task's accounting; nothing is prepared and the sinks stay empty."""
    spec = bench.spec({"main": {0: (0, 10)}}, by_ranges([Span(partition=0, start=0, end=10)]))
    dropped = bench.run(spec, [orders(0, range(0, 7)), orders(0, range(8, 10))])
    assert dropped.participants == [] and dropped.error is not None
    assert dropped.error.startswith("partition 0 [0, 10): 1 record(s) missing, 0 extra")
    assert "first at offset 7" in dropped.error

    doubled = bench.run(spec, [orders(0, range(0, 10)), orders(0, range(3, 4))])
    assert doubled.participants == [] and doubled.error is not None
    assert "0 record(s) missing, 1 extra cop(ies)" in doubled.error
    assert bench.prepared("main") == [] and bench.rows("main") == []


def test_a_retried_attempt_rolls_back_what_the_earlier_left_prepared(bench: Bench) -> None:
    spec = bench.spec({"main": {1: (0, 5)}}, by_ranges([Span(partition=1, start=0, end=5)]))
    first = bench.run(spec, [orders(1, range(5))], task=0, attempt=0)
    assert bench.prepared("main") == [first.participants[0].gid] == [f"tm:{RUN}:s.main:0:0"]
    # Without the rollback the retry would wait on the first attempt's row locks.
    retry = bench.run(spec, [orders(1, range(5))], task=0, attempt=1)
    assert bench.prepared("main") == [retry.participants[0].gid] == [f"tm:{RUN}:s.main:0:1"]
    bench.commit(retry)
    assert len(bench.rows("main")) == 5


def test_at_least_once_commits_instead_of_preparing(bench: Bench) -> None:
    spec = bench.spec(
        {"main": {0: (0, 5)}}, by_ranges([Span(partition=0, start=0, end=5)]), prepare=False
    )
    r = bench.run(spec, [orders(0, range(5))])
    assert [p.gid for p in r.participants] == [f"tm:{RUN}:s.main:0:0"]
    assert bench.prepared("main") == [] and len(bench.rows("main")) == 5


def test_binary_copy_and_the_csv_fallback(env: Any) -> None:
    """The table the driver creates takes every output column by binary COPY; a user's table
    with a numeric column for the double output cannot (binary values must have the column's
    exact type), so that sink's rows go by CSV, which PostgreSQL parses and casts, quoting
    and all."""
    bench = Bench(
        env,
        ddl={
            "copy": f"""CREATE TABLE {TABLE} (id integer PRIMARY KEY, name text,
                amount numeric, version bigint, _tm_partition integer NOT NULL,
                _tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL)"""
        },
    )
    spec = bench.spec(
        {"main": {0: (0, 4)}, "copy": {0: (0, 4)}}, by_ranges([Span(partition=0, start=0, end=4)])
    )
    awkward = ['quote " comma , new\nline', "", None, "日本 \\x41"]
    records = [order(0, o, name=awkward[o], amount=o * 1.25) for o in range(4)]
    r = bench.run(spec, [batch(records)])
    assert r.sinks["main"].copy_format == CopyFormat.BINARY
    assert r.sinks["copy"].copy_format == CopyFormat.CSV
    assert r.sinks["copy"].csv_why.startswith("column amount (double into numeric")
    bench.commit(r)
    for sink in ("main", "copy"):
        got = [(i, n, float(a)) for i, n, a, *_ in bench.rows(sink)]
        assert got == [(o, awkward[o], o * 1.25) for o in range(4)], sink


def test_records_postgresql_refuses_are_bisected_into_dead_letters(env: Any) -> None:
    """Of 40 records, PostgreSQL refuses two rows (a check constraint, a NOT NULL column):
    the direct COPY fails, the merge bisects down to those two, which become ``sink_write``
    letters in the ledger transaction prepared beside the rows; a record that failed to
    decode and one whose key is NULL become letters too. The rest is written."""
    bench = Bench(
        env,
        ddl={
            "main": f"""CREATE TABLE {TABLE} (id integer PRIMARY KEY, name text NOT NULL,
                amount double precision CHECK (amount >= 0), version integer,
                _tm_partition integer NOT NULL, _tm_offset bigint NOT NULL,
                _tm_run_id bigint NOT NULL)"""
        },
    )
    spec = bench.spec({"main": {0: (0, 40)}}, by_ranges([Span(partition=0, start=0, end=40)]))
    records = [order(0, o) for o in range(40)]
    records[13] = order(0, 13, amount=-1.0)
    records[21] = order(0, 21, name=None)
    records[30] = order(0, 30, error=("decode", "payload is not JSON"))
    records[33] = order(0, 33) | {"id": None}
    r = bench.run(spec, [batch(records[:25]), batch(records[25:])])

    main = r.sinks["main"]
    assert (main.counts.records, main.counts.rows, main.counts.dead, main.error) == (
        40,
        36,
        4,
        None,
    )
    assert [(p.gid, p.target, p.rows) for p in r.participants] == [
        (f"tm:{RUN}:s.main:0:0", Target.sink("main"), 36),
        (f"tm:{RUN}:d.main:0:0", Target.ledger(), 4),
    ]
    assert bench.prepared() == [f"tm:{RUN}:d.main:0:0"]
    assert bench.letters() == []  # prepared, not yet committed

    bench.commit(r)
    assert [o for _, _, _, _, o, _ in bench.rows("main")] == [
        o for o in range(40) if o not in (13, 21, 30, 33)
    ]
    assert bench.letters() == [
        ("main", 0, 13, "sink_write", "quarantined", RUN),
        ("main", 0, 21, "sink_write", "quarantined", RUN),
        ("main", 0, 30, "decode", "quarantined", RUN),
        ("main", 0, 33, "transform", "quarantined", RUN),
    ]
    reasons = dict(
        env.ledger(
            "SELECT source_offset, reason FROM tidemark.dlq WHERE error_class = 'sink_write'"
        )
    )
    assert "check constraint" in reasons[13] and "not-null constraint" in reasons[21]
    # A letter keeps the record's bytes as the source had them.
    (payload,) = env.ledger("SELECT payload FROM tidemark.dlq WHERE source_offset = 13")[0]
    assert bytes(payload) == records[13][PAYLOAD]


def test_direct_copy_first_then_the_merge_replaces_by_key(bench: Bench) -> None:
    """A first delivery of new keys goes by COPY straight into the table (no staging merge).
    A later run whose records repeat a key (3 and 4 from before, 20 twice) cannot: its rows
    go through the staging merge, which replaces the existing rows by key and keeps only
    the newest version of a key within the batch (the other is superseded)."""
    first = bench.spec({"main": {0: (0, 10)}}, by_ranges([Span(partition=0, start=0, end=10)]))
    r1 = bench.run(first, [orders(0, range(10))])
    assert (r1.sinks["main"].counts.rows, r1.sinks["main"].counts.superseded) == (10, 0)
    assert "merge" not in r1.sinks["main"].phases  # straight into the target
    bench.commit(r1)

    later = bench.spec(
        {"main": {0: (10, 15)}},
        by_ranges([Span(partition=0, start=10, end=15)]),
        run_id=RUN + 1,
    )
    ids = [3, 4, 20, 20, 21]
    r2 = bench.run(later, [batch([order(0, 10 + i, k, version=2) for i, k in enumerate(ids)])])
    main = r2.sinks["main"]
    assert (main.counts.records, main.counts.rows, main.counts.superseded) == (5, 4, 1)
    assert "merge" in main.phases
    bench.commit(r2)
    got = {i: (o, run) for i, _, _, _, o, run in bench.rows("main")}
    assert sorted(got) == [*range(10), 20, 21]
    assert got[3] == (10, RUN + 1) and got[4] == (11, RUN + 1)  # replaced by key
    assert got[20] == (13, RUN + 1)  # the newer of its two versions
    assert got[5] == (5, RUN)  # untouched


def test_a_backfill_replaces_its_range_by_position(bench: Bench) -> None:
    """Re-delivering [0, 10): every row of the range goes and the records that pass now are
    placed again; one that fails now (offset 4) loses its row to a dead letter, which the
    ledger transaction prepared beside the rows holds."""
    ranges = {"main": {0: (0, 10)}}
    read = by_ranges([Span(partition=0, start=0, end=10)])
    r1 = bench.run(bench.spec(ranges, read), [orders(0, range(10))])
    bench.commit(r1)

    records = [order(0, o, amount=9.5) for o in range(10)]
    records[4] = order(0, 4, error=("transform", "required column id is NULL"))
    spec = bench.spec(ranges, read, Backfilling(by="bob"), run_id=RUN + 1)
    r2 = bench.run(spec, [batch(records)])
    main = r2.sinks["main"]
    assert (main.counts.records, main.counts.removed, main.counts.rows, main.counts.dead) == (
        10,
        10,
        9,
        1,
    )
    assert [p.gid for p in r2.participants] == [
        f"tm:{RUN + 1}:s.main:0:0",
        f"tm:{RUN + 1}:d.main:0:0",
    ]
    assert len(bench.rows("main")) == 10  # the first run's rows until the decision
    bench.commit(r2)
    assert [(i, a, run) for i, _, a, _, _, run in bench.rows("main")] == [
        (o, 9.5, RUN + 1) for o in range(10) if o != 4
    ]
    assert bench.letters() == [("main", 0, 4, "transform", "quarantined", RUN + 1)]


def test_spread_tasks_each_account_for_part_of_every_span(bench: Bench) -> None:
    """By key: two tasks each see the records of their keys from both partitions and return
    which offsets they saw; only together do they cover the spans, which the driver checks
    from their bitmaps (protocol.coverage). Each task prepares its own transaction."""
    spread = [Span(partition=p, start=0, end=20) for p in (0, 1)]
    spec = bench.spec({"main": {0: (0, 20), 1: (0, 20)}}, ByKey(spread=spread))

    def mine(task: int, skip: int | None = None) -> list[pa.RecordBatch]:
        # Keys are unique over both partitions (partition 1 holds 100..119).
        return [
            batch([order(p, o, 100 * p + o) for o in range(20) if o % 2 == task and o != skip])
            for p in (0, 1)
        ]

    r0, r1 = bench.run(spec, mine(0), task=0), bench.run(spec, mine(1), task=1)
    assert (r0.error, r1.error, r0.records, r1.records) == (None, None, 20, 20)
    assert coverage.problem(spread, [r0.seen, r1.seen]) is None
    assert bench.prepared("main") == [f"tm:{RUN}:s.main:0:0", f"tm:{RUN}:s.main:1:0"]
    bench.commit(r0)
    bench.commit(r1)
    assert len(bench.rows("main")) == 40

    # A task alone cannot tell a record is missing; the tasks' bitmaps together do.
    again = bench.spec({"main": {0: (0, 20), 1: (0, 20)}}, ByKey(spread=spread), run_id=RUN + 1)
    g0, g1 = bench.run(again, mine(0), task=0), bench.run(again, mine(1, skip=7), task=1)
    assert (g0.error, g1.error) == (None, None)
    assert coverage.problem(spread, [g0.seen, g1.seen]) == (
        "partition 0 [0, 20): 1 record(s) missing, 0 seen by two tasks (first at offset 7)"
    )
    # A copy within one task is caught by the task itself, before it prepares.
    twice = bench.run(again, [*mine(0), batch([order(0, 2, 2)])], task=0, attempt=1)
    assert twice.participants == [] and twice.error is not None
    assert "1 extra cop(ies)" in twice.error


def test_a_redrive_places_the_records_of_its_letters(env: Any) -> None:
    """By records: a record PostgreSQL refused becomes a letter; once the table is fixed, a
    redrive request for it is placed by one task that must see each held record once. The
    letter is resolved in the ledger transaction prepared beside the row."""
    bench = Bench(
        env,
        ddl={
            "main": f"""CREATE TABLE {TABLE} (id integer PRIMARY KEY, name text,
                amount double precision, version integer, _tm_partition integer NOT NULL,
                _tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL);
                ALTER TABLE {TABLE} ADD CONSTRAINT positive CHECK (amount >= 0)"""
        },
    )
    spec = bench.spec({"main": {0: (0, 10)}}, by_ranges([Span(partition=0, start=0, end=10)]))
    records = [order(0, o) for o in range(10)]
    records[5] = order(0, 5, amount=-2.0)
    first = bench.run(spec, [batch(records)])
    bench.commit(first)
    assert bench.letters() == [("main", 0, 5, "sink_write", "quarantined", RUN)]

    bench.sql("main", f"ALTER TABLE {TABLE} DROP CONSTRAINT positive")  # the fix
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        # The driver's own state: the pipeline and the sink's checkpoint past the letter.
        state.ensure_pipeline(c, "orders", {})
        c.execute(
            "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset) "
            "VALUES ('orders', 'main', 0, 10)"
        )
        (letter,) = c.execute("SELECT id FROM tidemark.dlq").fetchone() or ()
        request = redrives.create(c, "orders", "alice", ids=[letter])
    assert request is not None
    redrive = bench.spec(
        {"main": {0: (5, 6)}},
        ByRecords(),
        Redriving(request=request.request_id, by="alice"),
        run_id=RUN + 1,
    )

    missing = bench.run(redrive, [])
    assert missing.participants == [] and missing.error is not None
    assert "0 record(s) seen more than once, 1 missing" in missing.error

    r = bench.run(redrive, [batch([records[5]])])
    main = r.sinks["main"]
    assert (main.redriven, main.counts.rows, main.counts.resolved, main.failed_again) == (
        1,
        1,
        1,
        [],
    )
    assert bench.letters()[0][4] == "quarantined"  # until the decision
    bench.commit(r)
    assert bench.rows("main")[5] == (5, "order-5", -2.0, 0, 5, RUN + 1)
    assert env.ledger("SELECT status::text, resolved_by FROM tidemark.dlq") == [
        ("redriven", "alice")
    ]


def test_a_sink_user_without_rights_on_the_schema_tidemark_is_told_what_to_grant(env):
    """docs/production.md, "Database users": every database Tidemark prepares on keeps its
    schema tidemark. A user who may not create it, or may not use the one another user made,
    is told in one line what to grant, before any task writes."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from tidemark.core.errors import TidemarkError

    role, pw = f"payer_{env.names['sink']}", "Pw-x9f3kQ-payer"
    db = conninfo_to_dict(env.sink_dsn)["dbname"]
    dsn = make_conninfo(env.sink_dsn, user=role, password=pw)
    admin = psycopg.connect(env.sink_dsn, autocommit=True)

    def refusal() -> str:
        with psycopg.connect(dsn, autocommit=True) as c, pytest.raises(TidemarkError) as e:
            sinks.prepare_database(c, "sink main")
        assert pw not in str(e.value) and "\n" not in str(e.value)
        return str(e.value)

    grant = (
        "grant it CREATE on the database (Tidemark creates the schema tidemark), or USAGE "
        "and CREATE on schema tidemark and SELECT, INSERT, DELETE on tidemark.commits "
        '(docs/production.md, "Database users")'
    )
    where = f"sink main: user {role} in database {db}"
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{pw}'")
    try:
        assert refusal() == (
            f"{where} cannot keep Tidemark's schema tidemark (permission denied for "
            f"database {db}): {grant}"
        )
        sinks.prepare_database(admin, "sink main")  # another user made the schema
        assert refusal() == (
            f"{where} cannot keep Tidemark's schema tidemark (permission denied for "
            f"schema tidemark): {grant}"
        )
        # Recovery, which prunes the markers of every database, says the same.
        env.pipeline(sinks=[{"name": "main", "dsn": dsn, "table": "orders", "key": ["id"]}])
        report = env.recover()
        assert [e.split(": ", 1)[1] for e in report.errors] == [
            f"permission denied for schema tidemark: {grant}"
        ]
        assert pw not in str(report.errors)
        admin.execute(f"GRANT USAGE ON SCHEMA tidemark TO {role}")
        assert refusal() == (
            f"{where} lacks CREATE on schema tidemark; SELECT, INSERT, DELETE on "
            f"tidemark.commits (Tidemark's schema tidemark, made by another user): {grant}"
        )
        admin.execute(f"GRANT CREATE ON SCHEMA tidemark TO {role}")
        admin.execute(f"GRANT SELECT, INSERT ON tidemark.commits TO {role}")
        assert refusal().startswith(f"{where} lacks DELETE on tidemark.commits (")
        admin.execute(f"GRANT DELETE ON tidemark.commits TO {role}")
        with psycopg.connect(dsn, autocommit=True) as c:
            sinks.prepare_database(c, "sink main")  # granted as told: nothing to say
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
        admin.close()
