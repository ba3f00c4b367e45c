"""Pure logic: DSN masking, gids, pipeline models."""

from __future__ import annotations

import json
import re

import pytest

from tidemark import config
from tidemark.core import dsn
from tidemark.core.errors import ConfigError
from tidemark.core.ranges import Range
from tidemark.protocol import gids


@pytest.mark.parametrize(
    "raw,masked",
    [
        ("postgresql://u:secret@h:5/db", "postgresql://u:***@h:5/db"),
        ("host=h password=secret user=u", "host=h password=*** user=u"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("error at postgres://a:b@c/d: boom", "error at postgres://a:***@c/d: boom"),
        ("postgresql://:pw@h/db", "postgresql://:***@h/db"),  # empty user
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),  # URL-encoded
        ("host=h password='a b' user=u", "host=h password=*** user=u"),
        ("host=h password = 'it\\'s' user=u", "host=h password = *** user=u"),
        (
            "postgresql://u@h/db?sslmode=require&password=s3cret&x=1",
            "postgresql://u@h/db?sslmode=require&password=***&x=1",
        ),
        ("postgresql://u@h/db?password=s3cret", "postgresql://u@h/db?password=***"),
        ("PGPASSWORD=s3cret psql -h h", "PGPASSWORD=*** psql -h h"),
        ("sslpassword=key-pass host=h", "sslpassword=*** host=h"),
        # a port and a path are no password: only userinfo before '@' is
        ("see http://127.0.0.1:8080/x@y", "see http://127.0.0.1:8080/x@y"),
        ("postgresql://h:5432/db", "postgresql://h:5432/db"),
        # raw passwords: to the token's last '@', or all of the token without one
        ("postgresql://u:Ab/zz@h/db: boom", "postgresql://u:***@h/db: boom"),
        ("postgresql://u:Ab@zz@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:Ab%zz@h/db", "postgresql://u:***@h/db"),
        ("cannot read postgresql://u:Ab%zzSecret", "cannot read postgresql://u:***"),
    ],
)
def test_dsn_masking(raw, masked):
    assert dsn.mask(raw) == masked
    assert dsn.mask(masked) == masked  # masking twice changes nothing


def test_a_resolved_password_is_masked_wherever_it_stands(monkeypatch):
    # libpq quotes what it could not read, without the DSN around it; a space ends any pattern
    monkeypatch.setattr(dsn, "_SECRETS", set())
    monkeypatch.setattr(dsn, "_DSNS", {})
    monkeypatch.setenv("TM_TEST_DSN", "postgresql://u:Ab Secret9@h/db")
    dsn.resolve("${TM_TEST_DSN}", None, "sink x")
    text = 'unexpected spaces found in "Ab Secret9"; postgresql://u:Ab Secret9@h/db: down'
    assert dsn.mask(text) == 'unexpected spaces found in "***"; postgresql://u:***@h/db: down'
    dsn.remember("host=h password='p%41ss word'")
    assert dsn.mask("bad: 'p%41ss word', \"pAss word\"") == "bad: '***', \"***\""
    # a password that is also a word is hidden where libpq quotes it, not in every message
    dsn.remember("postgresql://tidemark:tidemark@h/db")
    assert dsn.mask("run `tidemark recover`; 'tidemark'") == "run `tidemark recover`; '***'"
    dsn.remember("postgresql://u:pw@h/db")  # too short to replace wherever it stands
    assert dsn.mask("'pwned'") == "'pwned'"


def test_env_references_resolve_lazily(monkeypatch):
    monkeypatch.setenv("TM_TEST_DSN", "postgresql://x@y/z")
    assert dsn.expand_env("${TM_TEST_DSN}") == "postgresql://x@y/z"
    monkeypatch.delenv("TM_TEST_DSN")
    with pytest.raises(ConfigError, match="TM_TEST_DSN is not set"):
        dsn.expand_env("${TM_TEST_DSN}", "pipeline p: sink s")


def test_airflow_connection_from_environment(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgres://u:p@h:5432/db")
    assert dsn.resolve(None, "warehouse", "x") == "postgresql://u:p@h:5432/db"


def test_gid_round_trip():
    g = gids.Gid("tm", 12, gids.sink_stage("main"), 3, 1)
    assert str(g) == "tm:12:s.main:3:1"
    assert gids.parse(str(g), "tm") == g
    assert gids.parse(str(g), "other") is None
    assert gids.parse("tm:x:s.main:3:1", "tm") is None
    assert g.sink == "main" and not g.on_ledger
    assert gids.parse("tm:12:src:0:0", "tm").on_ledger
    # A second write numbers itself in a field of its own; the first's gids read as before.
    second = gids.Gid("tm", 12, gids.dlq_stage("main"), 3, 0, write=1)
    assert str(second) == "tm:12:d.main:3:0:1"
    assert gids.parse(str(second), "tm") == second
    assert gids.parse("tm:12:d.main:3:0:0", "tm") is None
    assert g.earlier_than(second) and not second.earlier_than(g)
    assert gids.Gid("tm", 12, "s.main", 3, 0).earlier_than(g)
    assert not gids.Gid("tm", 12, "s.main", 4, 0).earlier_than(g)  # another task
    # A second write's gid from before the field (attempts from 100): still ours to sweep.
    old = gids.parse("tm:12:s.main:3:100", "tm")
    assert (old.run_id, old.sink, old.task, old.attempt, old.write) == (12, "main", 3, 100, 0)


def test_the_demo_pipeline_is_valid():
    from tests.conftest import REPO

    p = config.load(REPO / "dags" / "pipelines" / "flights.yaml")
    assert p.sinks[0].key == ["flight_date", "carrier", "flight", "origin", "copy"]
    assert p.output_columns()[:5] == p.sinks[0].key


def test_a_run_refuses_a_mode_or_quality_path_it_cannot_type_check():
    """``Run(mode="backfill")`` once ran a delivery: a mode is a Mode, never a name."""
    from tests.conftest import REPO
    from tidemark.core.settings import Settings
    from tidemark.driver.run import Backfill, QualityPath, Run

    p = config.load(REPO / "dags" / "pipelines" / "flights.yaml")
    settings = Settings(ledger_dsn="postgresql://u@h/db")
    with pytest.raises(TypeError, match="takes a Mode"):
        Run(p, settings, ledger_dsn="postgresql://u@h/db", mode="backfill")
    with pytest.raises(TypeError, match="takes a QualityPath"):
        Run(p, settings, ledger_dsn="postgresql://u@h/db", quality="first")
    run = Run(p, settings, ledger_dsn="postgresql://u@h/db", mode=Backfill([Range(0, 0, 5)]))
    assert run.mode.name == "backfill" and run.quality is QualityPath.WHILE_WRITING
    assert Run(p, settings, ledger_dsn="postgresql://u@h/db").mode.name == "run"


def test_a_mode_says_its_kind_and_the_ledger_takes_every_kind():
    """What kind of run a mode makes is its RunKind, whose value is the mode the ledger
    records (runs_mode_check of the newest migration that sets it); the driver asks nothing
    else: no isinstance on a mode, no comparing its name."""
    from tests.conftest import REPO
    from tidemark.driver.modes import Backfill, Delivery, Rebuild, RunKind
    from tidemark.driver.redrive import RedriveMode

    modes = {Delivery: "run", Backfill: "backfill", Rebuild: "rebuild", RedriveMode: "redrive"}
    assert {m.kind for m in modes} == set(RunKind)
    assert Delivery().name == "run" and Backfill([Range(0, 0, 5)]).name == "backfill"
    assert {m.kind.value for m in modes} == set(modes.values())
    checks = [
        m.group(1)
        for f in sorted((REPO / "sql").glob("V*.sql"))
        for m in re.finditer(r"mode\s+IN\s+\(([^)]*)\)", f.read_text())
    ]
    assert set(re.findall(r"'(\w+)'", checks[-1])) == {k.value for k in RunKind}
    asked = re.compile(
        r"isinstance\([^,]*\bmode\b[^,]*,[^)]*\b(Delivery|Backfill|Rebuild|RedriveMode)\b"
        r"|\bmode\.name\s*[!=]="
    )
    found = [
        f"{f.name}:{n}: {line.strip()}"
        for f in sorted((REPO / "tidemark" / "driver").glob("*.py"))
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if asked.search(line)
    ]
    assert found == [], "ask mode.kind (RunKind) instead:\n" + "\n".join(found)


def test_pg_types():
    assert config.pg_type("decimal(10, 2)") == "numeric(10,2)"
    assert config.pg_type("timestamp") == "timestamptz"
    with pytest.raises(ValueError, match="unsupported type"):
        config.pg_type("map<string,int>")


def test_secret_files_are_private_from_the_first_byte(tmp_path):
    import os
    import stat
    import sys

    from tidemark.core.private import write_private
    from tidemark.devstack.airflow_stack import Stack

    home = tmp_path / "home"
    seen: list[tuple[str, str, int]] = []  # (audit event, file, mode) of every file in home
    watching = [False]

    def watch(event: str, _args) -> None:
        # Python raises an audit event before each open, chmod and rename: a file created
        # wide and narrowed afterwards is caught at its chmod.
        if watching[0] and home.is_dir():
            watching[0] = False  # the look itself raises audit events
            try:
                seen.extend((event, f.name, stat.S_IMODE(f.stat().st_mode)) for f in home.iterdir())
            finally:
                watching[0] = True

    sys.addaudithook(watch)  # hooks cannot be removed: this one is inert outside the test
    old = os.umask(0)  # the worst umask: a plain write makes a file 0666
    watching[0] = True
    try:
        stack = Stack(home=home, ledger_dsn="postgresql://x@127.0.0.1/x")
        stack.password()
        stack.env()  # generates the keys (stack.json)
        write_private(home / "passwords.json", '{"u": "p"}')  # replaces a file in place
    finally:
        watching[0] = False
        os.umask(old)
    assert sorted(f.name for f in home.iterdir()) == ["passwords.json", "stack.json"]
    assert seen and all(mode == 0o600 for _e, _f, mode in seen), [s for s in seen if s[2] != 0o600]
    assert (home / "passwords.json").read_text() == '{"u": "p"}'


def test_pieces_cut_ranges_into_about_n_contiguous_sub_ranges():
    from tidemark.core.ranges import Range
    from tidemark.driver.modes import pieces

    read = [Range(0, 10, 110), Range(1, 5, 5), Range(2, 0, 3)]
    out = pieces(read, 4)
    for r in read:  # each range exactly covered, in order, by its pieces
        mine = [p for p in out if p.partition == r.partition]
        assert mine[0].start == r.start and mine[-1].end == r.end
        assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False))
    assert [p.size for p in out if p.partition == 0] == [25, 25, 25, 25]
    assert [p for p in out if p.partition == 1] == [Range(1, 5, 5)]


def test_spread_coverage_finds_a_missing_and_a_doubled_offset():
    import numpy as np

    from tidemark.protocol import coverage
    from tidemark.protocol.taskspec import Span

    span = Span(partition=0, start=100, end=110)
    a, b = np.zeros(10, bool), np.zeros(10, bool)
    a[:5], b[5:] = True, True
    bitmaps = [{0: coverage.encode(a)}, {0: coverage.encode(b)}]
    assert coverage.problem([span], bitmaps) is None
    b[7] = False
    assert "1 record(s) missing" in coverage.problem([span], [bitmaps[0], {0: coverage.encode(b)}])
    b[7], b[2] = True, True
    assert "1 seen by two tasks (first at offset 102)" in coverage.problem(
        [span], [bitmaps[0], {0: coverage.encode(b)}]
    )
    gaps = span.model_copy(update={"dense": False})  # an archive: a gap is no problem
    assert coverage.problem([gaps], [bitmaps[0]]) is None


def test_a_task_spec_accounts_for_what_it_places_and_survives_the_trip_to_its_task():
    """The driver->task contract is a discriminated union at both ends: a redrive, and only a
    redrive, accounts by records; a re-delivery never spreads by key."""
    from pydantic import ValidationError

    from tidemark.protocol.taskspec import (
        Backfilling,
        ByKey,
        ByRanges,
        ByRecords,
        Delivering,
        Redriving,
        Span,
        TaskSpec,
    )

    spans = [Span(partition=0, start=0, end=10)]
    base = dict(
        run_id=1,
        pipeline="orders",
        prefix="tm",
        prepare=True,
        lock_timeout_ms=1000,
        ledger_dsn="postgresql://u@h/db",
        columns=["id"],
        sinks=[],
    )
    fine = [
        (ByRanges(reads=[spans]), Delivering()),
        (ByKey(spread=spans), Delivering()),
        (ByRanges(reads=[spans]), Backfilling(by="ann", fallback=True, moved={"main": [[1]]})),
        (ByRecords(), Redriving(request=7, by="ann")),
    ]
    for accounting, placement in fine:
        spec = TaskSpec(**base, accounting=accounting, placement=placement)
        assert TaskSpec.model_validate_json(spec.model_dump_json()) == spec
        assert spec.redelivery == (not isinstance(placement, Delivering))
    for accounting, placement in [
        (ByRecords(), Delivering()),
        (ByRanges(reads=[spans]), Redriving(request=7)),
        (ByKey(spread=spans), Backfilling()),
    ]:
        with pytest.raises(ValidationError):
            TaskSpec(**base, accounting=accounting, placement=placement)
    wire = TaskSpec(**base, accounting=ByRecords(), placement=Redriving(request=7)).model_dump()
    wire["placement"]["mode"] = "run"  # a delivery has no request: refused, not ignored
    with pytest.raises(ValidationError):
        TaskSpec.model_validate(wire)


def test_a_sink_result_says_its_copy_format_and_why_csv():
    """The COPY format is an enum on the wire, and the reason for CSV its own field: given
    for CSV, and only for it."""
    from pydantic import ValidationError

    from tidemark.core.sink_counts import SinkCounts
    from tidemark.driver.report import SinkOutcome
    from tidemark.protocol.taskspec import CopyFormat, SinkResult

    csv = SinkResult(
        counts=SinkCounts(rows=2), copy_format=CopyFormat.CSV, csv_why="column amount (double)"
    )
    assert SinkResult.model_validate_json(csv.model_dump_json()) == csv
    assert SinkResult.model_validate({"copy_format": "binary"}).copy_format is CopyFormat.BINARY
    for bad in [
        {"copy_format": "csv"},
        {"copy_format": "binary", "csv_why": "x"},
        {"csv_why": "x"},
        {"copy_format": "csv: column amount"},
    ]:
        with pytest.raises(ValidationError):
            SinkResult.model_validate(bad)
    out = SinkOutcome("main", "committed")
    out.take_copy_format([SinkResult(), csv, SinkResult(copy_format=CopyFormat.CSV, csv_why="b")])
    assert (out.copy_format, out.csv_why) == (CopyFormat.CSV, "column amount (double)")
    assert json.loads(json.dumps(out.to_dict()))["copy_format"] == "csv"
    none = SinkOutcome("main", "committed")
    none.take_copy_format([SinkResult()])
    assert (none.copy_format, none.csv_why) == (None, "")


def test_per_sink_counts_are_one_type_from_the_task_to_the_ledger():
    """SinkCounts: summed over a sink's tasks, carried in the task's result (JSON), written
    to the ledger by its serializer and read back by its parser, old rows included: before
    V004 a row had ``sink_dead`` + ``source_dead``, an aborted run's only ``records``."""
    from tidemark.core.sink_counts import SinkCounts
    from tidemark.driver.report import SinkOutcome
    from tidemark.protocol.taskspec import SinkResult

    a = SinkCounts(records=10, rows=6, dead=2, superseded=1, tombstones=1)
    b = SinkCounts(records=4, rows=2, dead=1, removed=3, resolved=1, fallback=2, superseded=3)
    assert SinkCounts.total([a, b]) == SinkCounts(14, 8, 3, 4, 3, 1, 2, 1)
    assert SinkCounts.total([]) == SinkCounts()
    assert a.unbalanced() is None and b.unbalanced() is None
    assert SinkCounts(records=3, rows=1, fallback=1).unbalanced() == (
        "3 records and 1 fallback versions but 1 written + 0 quarantined + 0 superseded + "
        "0 tombstones"
    )
    wire = SinkResult(counts=b)
    assert SinkResult.model_validate_json(wire.model_dump_json()).counts == b
    stored = json.loads(json.dumps(b.to_json()))
    assert stored == {
        "records": 4,
        "rows": 2,
        "dead": 1,
        "superseded": 3,
        "removed": 3,
        "resolved": 1,
        "fallback": 2,
        "tombstones": 0,
    }
    assert SinkCounts.from_json(stored) == b
    assert SinkCounts.from_json(None) == SinkCounts.from_json({}) == SinkCounts()
    assert SinkCounts.from_json({"records": 7}) == SinkCounts(records=7)
    old = {"records": 9, "rows": 5, "sink_dead": 3, "source_dead": 1}
    assert SinkCounts.from_json(old) == SinkCounts(records=9, rows=5, dead=4)
    assert SinkCounts.from_json({**old, "dead": 2}).dead == 2  # the new key wins
    out = SinkOutcome("main", "committed")
    out.take_counts([SinkResult(counts=a), SinkResult(counts=b)])
    assert out.counts == a + b
    shown = out.to_dict()  # the run report's JSON: counts in line, as before
    assert list(shown)[:9] == [
        "sink",
        "state",
        "rows",
        "dead",
        "superseded",
        "removed",
        "resolved",
        "fallback",
        "tombstones",
    ]
    assert "counts" not in shown and "records" not in shown and shown["rows"] == 8


def test_a_task_accounts_by_ranges_by_key_or_by_records():
    import pyarrow as pa

    from tidemark.engine.accounts import (
        KeyAccounts,
        NotAccountable,
        RecordAccounts,
        SpanAccounts,
        accounts_for,
    )
    from tidemark.protocol.taskspec import ByKey, ByRanges, ByRecords, Span

    def batch(*offsets: int) -> pa.RecordBatch:
        return pa.record_batch({"_tm_offset": pa.array(offsets, pa.int64())})

    spans = [Span(partition=0, start=10, end=14)]
    ranges = accounts_for(ByRanges(reads=[spans]), 0)
    assert type(ranges) is SpanAccounts
    ranges.add(0, batch(10, 11, 13))
    assert "1 record(s) missing" in ranges.problem([])
    ranges.add(0, batch(12))
    assert ranges.problem([]) is None and ranges.bitmaps() == {}
    with pytest.raises(NotAccountable, match="beyond the 1 task"):
        accounts_for(ByRanges(reads=[spans]), 1)
    by_key = accounts_for(ByKey(spread=spans), 3)
    assert type(by_key) is KeyAccounts
    by_key.add(0, batch(11))  # the rest is other tasks'
    assert by_key.problem([]) is None and set(by_key.bitmaps()) == {0}
    by_key.add(0, batch(11))
    assert "1 extra cop(ies)" in by_key.problem([])
    records = accounts_for(ByRecords(), 0)
    assert type(records) is RecordAccounts
    records.add(2, batch(5, 9))
    held = [{2: pa.array([5, 9, 11], pa.int64())}]
    assert "1 missing" in records.problem(held)
    records.add(2, batch(11))
    assert records.problem(held) is None


def test_a_quality_strategy_judges_a_write_stands_redo_or_fails():
    from tidemark.driver.checking import (
        CheckFirst,
        CheckWhileWriting,
        Fails,
        Job,
        NoChecks,
        Redo,
        Stands,
    )

    ctx = None  # judging a failed job or a plain write reads nothing of the run
    assert NoChecks().judge(Job([]), ctx) == Stands()
    assert CheckFirst().judge(Job([]), ctx) == Stands()
    assert NoChecks().judge(Job([], "Spark job failed: x"), ctx) == Fails("Spark job failed: x")
    redo = CheckWhileWriting(ahead=None).judge(Job([], "Spark job failed: x"), ctx)
    assert isinstance(redo, Redo) and isinstance(redo.then, CheckFirst)
    assert CheckFirst.caches and not NoChecks.caches and not CheckWhileWriting.caches


# -- what users read: values in reasons, JSON decode failures, gate results ------------------
@pytest.mark.parametrize(
    "value, text",
    [
        (__import__("decimal").Decimal("-98.12"), "-98.12"),
        (__import__("decimal").Decimal("1E+3"), "1000"),
        (703.4, "703.4"),
        (9999, "9999"),
        (None, "NULL"),
        ("text", "'text'"),
        ("it's", "'it''s'"),
        (True, "true"),
        (__import__("datetime").date(2026, 1, 2), "2026-01-02"),
        (__import__("datetime").datetime(2026, 1, 2, 3, 4, 5), "2026-01-02 03:04:05"),
        (b"\x00\xff", "'\\x00ff'"),
        ([1, "a", None], "[1, 'a', NULL]"),
    ],
)
def test_values_read_as_a_user_writes_them(value, text):
    from tidemark.core.text import literal

    assert literal(value) == text


def test_a_long_value_is_cut_with_an_ellipsis():
    from tidemark.core.text import literal

    assert literal("x" * 100, 10) == "'xxxxxxxx…"


def test_row_check_reasons_show_values_not_reprs():
    from decimal import Decimal

    from tidemark.quality.reasons import reason

    between = {"column": "amount", "max_value": 0}
    assert (
        reason(
            "expect_column_values_to_be_between",
            between,
            {"_tm_partition": 0, "_tm_offset": 3, "amount": Decimal("-98.12")},
        )
        == "expect_column_values_to_be_between(column=amount): unexpected value -98.12"
    )
    assert (
        reason("expect_column_values_to_be_in_set", {"column": "origin"}, {"origin": "BOS"})
        == "expect_column_values_to_be_in_set(column=origin): 'BOS' not in set"
    )
    pair = {"column_A": "amount", "column_B": "due"}
    assert reason(
        "expect_column_pair_values_a_to_be_greater_than_b",
        pair,
        {
            "_tm_partition": 0,
            "_tm_offset": 3,
            "amount": Decimal("-98.12"),
            "due": __import__("datetime").date(2026, 1, 2),
        },
    ) == (
        "expect_column_pair_values_a_to_be_greater_than_b(column_A=amount, column_B=due): "
        "unexpected values amount = -98.12, due = 2026-01-02"
    )
    assert reason(
        "expect_multicolumn_sum_to_equal", {"column_list": ["a", "b"]}, {"a": None, "b": "x"}
    ).endswith("unexpected values a = NULL, b = 'x'")


@pytest.mark.parametrize(
    "payload, text",
    [
        (b'{"id": 1, "amount": 12.5', "payload is not valid JSON: unexpected end at byte 24"),
        (b'{"id": 1, "amount": }', "payload is not valid JSON: expecting a value at byte 20"),
        (b'{"id": 1} trailing', "payload is not valid JSON: extra data at byte 10"),
        (b'[{"id": 1}]', "payload is not a JSON object (an array)"),
        (b'"text"', "payload is not a JSON object (a string)"),
        (b"42", "payload is not a JSON object (a number)"),
        (b"null", "payload is not a JSON object (null)"),
        (b"true", "payload is not a JSON object (a boolean)"),
        ('{"name": "é", "x": '.encode(), "payload is not valid JSON: unexpected end at byte 20"),
    ],
)
def test_a_payload_that_is_no_json_object_says_which(payload, text):
    from tidemark.engine.json_reasons import decode_reason

    assert decode_reason(payload, "payload is not a JSON object") == text


def test_a_field_reason_from_spark_stands():
    from tidemark.engine.json_reasons import decode_reason

    spark = "field id: cannot read 'x' as bigint"
    assert decode_reason(b'{"id": "x"}', spark) == spark
    # Spark read it as no object, Python reads an object (e.g. a duplicate key): Spark's word
    assert (
        decode_reason(b'{"id": 1}', "payload is not a JSON object")
        == "payload is not a JSON object"
    )


@pytest.mark.parametrize(
    "result, text",
    [
        (
            {
                "expectation": "expect_column_values_to_be_in_set",
                "observed_value": None,
                "element_count": 480,
                "missing_count": 0,
                "unexpected_count": 12,
                "unexpected_percent": 2.5,
                "partial_unexpected_list": ["x", "y", "x"],
            },
            "12 of 480 values (2.5%) not in the set; e.g. 'x', 'y'",
        ),
        (
            {
                "expectation": "expect_column_values_to_not_be_in_set",
                "element_count": 10,
                "missing_count": 2,
                "unexpected_count": 1,
                "unexpected_percent": 12.5,
                "partial_unexpected_list": [7],
            },
            "1 of 8 values (12.5%) in the forbidden set; e.g. 7",
        ),
        (
            {
                "expectation": "expect_column_values_to_not_be_null",
                "element_count": 300,
                "unexpected_count": 3,
                "unexpected_percent": 1.0,
                "partial_unexpected_list": [None],
            },
            "3 of 300 values (1%) null",
        ),
        (
            {
                "expectation": "expect_column_values_to_be_between",
                "unexpected_count": 5,
                "unexpected_percent": 1 / 3,
            },
            "5 values (0.333%) out of range",
        ),
        (
            {"expectation": "expect_column_value_lengths_to_be_between", "unexpected_count": 1},
            "1 value unexpected",
        ),
        (
            {"expectation": "expect_table_row_count_to_be_between", "observed_value": 300},
            "observed 300",
        ),
        (
            {"expectation": "expect_column_mean_to_be_between", "observed_value": 1e9},
            "observed 1000000000.0",
        ),
        (
            {"expectation": "expect_column_values_to_be_unique", "observed_value": None},
            "observed nothing",
        ),
    ],
)
def test_a_gate_result_says_what_was_observed(result, text):
    from tidemark.quality.outcomes import observed

    assert observed(result) == text


def test_the_values_of_a_sliced_binary_array_are_its_own_bytes():
    import pyarrow as pa

    from tidemark.core.arrow import values

    for typ in (pa.binary(), pa.large_binary(), pa.string(), pa.large_string()):
        arr = pa.array(
            [b"ab", b"cde", b"", b"fgh"] if "binary" in str(typ) else ["ab", "cde", "", "fgh"], typ
        )
        assert values(arr).to_pybytes() == b"abcdefgh", typ
        assert values(arr.slice(1, 2)).to_pybytes() == b"cde", typ


def test_a_resolved_dsn_keeps_a_user_and_database_named_like_its_password(monkeypatch):
    monkeypatch.setattr(dsn, "_SECRETS", set())
    monkeypatch.setattr(dsn, "_DSNS", {})
    dsn.remember("postgresql://tidemark:tidemark@127.0.0.1:5/tidemark")
    got = dsn.mask("ledger postgresql://tidemark:tidemark@127.0.0.1:5/tidemark at version 15")
    assert got == "ledger postgresql://tidemark:***@127.0.0.1:5/tidemark at version 15"
    dsn.remember("host=h user=tidemark password='tide mark' dbname=tidemark")
    assert dsn.mask("host=h user=tidemark password='tide mark' dbname=tidemark") == (
        "host=h user=tidemark password=*** dbname=tidemark"
    )


_CORRECTED = """
source: {type: file_archive, uri: /tmp/x}
decode: {schema: {id: int, t: double}}
transform: {select: {id: id, temp: t}}
sinks: [{name: main, dsn: x, table: t, key: [id]}]
corrections:
  - name: celsius
"""


@pytest.mark.parametrize(
    "window,problem",
    [
        ("set: {temp: 1}", "corrections[0]: give a window: offsets (with partitions) or since"),
        ("since: 2026-01-01\n    set: {temp: 1}", "give since and until together"),
        ("offsets: [3, 5]\n    set: {temp: 1}", "offsets need partitions"),
        ("partitions: [0]\n    offsets: [5, 3]\n    set: {temp: 1}", "offsets [5, 3) is empty"),
        (
            "since: 2026-01-01T02:00:00+02:00\n    until: 2026-01-01T00:00:00Z\n    set: {temp: 1}",
            "until (2026-01-01T00:00:00+00:00) must be after since (2026-01-01T00:00:00+00:00)",
        ),
        ("partitions: [0]\n    offsets: [0, 1]\n    set: {}", "name at least one column"),
        ("partitions: [0]\n    offsets: [0, 1]\n    set: {id: 1}", "set.id: id is a sink key"),
        ("partitions: [0]\n    offsets: [0, 1]\n    set: {t: 1}", "produces no column t"),
    ],
)
def test_a_correction_needs_a_window_and_output_columns_that_are_no_key(window, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        config.parse(_CORRECTED + f"    {window}\n", "f.yaml", "p")


def test_a_corrections_times_are_utc_and_yaml_literals_are_sql():
    p = config.parse(
        _CORRECTED + "    since: 2026-11-03 14:00\n    until: 2026-11-03T16:00:00+01:00\n"
        "    set: {temp: null}\n",
        "f.yaml",
        "p",
    )
    (c,) = p.corrections
    assert (c.since.isoformat(), c.until.isoformat()) == (
        "2026-11-03T14:00:00+00:00",
        "2026-11-03T15:00:00+00:00",
    )
    assert c.set_ == {"temp": "NULL"}


def test_the_readme_lists_every_setting_with_its_default():
    """README "Configuration" is the list of TIDEMARK_* variables: every field of Settings is
    a row, and a row's default is the field's (one default each)."""
    import re
    from pathlib import Path

    from tidemark.core.settings import Settings

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(TIDEMARK_\w+)` \| ([^|]*) \|", readme, re.M))
    missing = [f"TIDEMARK_{n.upper()}" for n in Settings.model_fields]
    missing = [v for v in missing if v not in rows]
    assert not missing, f"README 'Configuration' lacks {missing}"
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, (str, int)) and not isinstance(default, bool) and default:
            shown = rows[f"TIDEMARK_{name.upper()}"].strip()
            assert shown == f"`{default}`", (
                f"README: TIDEMARK_{name.upper()} {shown}, not {default}"
            )


def test_a_sigterm_wrapped_by_py4j_is_still_found_as_terminated():
    from py4j.protocol import Py4JNetworkError

    from tidemark.core.errors import Terminated, terminated_in

    def py4j_call():  # what py4j's clientserver does when its recv is interrupted
        try:
            raise Terminated("SIGTERM before the decision: rolled back")
        except Exception as e:  # noqa: BLE001 - as py4j catches it
            raise Py4JNetworkError("Error while sending or receiving", e) from None

    with pytest.raises(Py4JNetworkError) as caught:
        py4j_call()
    found = terminated_in(caught.value)
    assert isinstance(found, Terminated) and found.exit_code == 143
    assert terminated_in(RuntimeError("other")) is None


def test_a_participant_target_is_parsed_once_and_spelled_back_the_same():
    from tidemark.core.participants import Target, TargetKind

    assert Target.parse("ledger") == Target.ledger()
    sink = Target.parse("sink:main:x")  # a sink's name may hold ':'
    assert (sink.kind, sink.name) == (TargetKind.SINK, "main:x")
    assert [str(t) for t in (Target.ledger(), sink)] == ["ledger", "sink:main:x"]
    for bad in ("sink", "sink:", "lake:x", ""):
        with pytest.raises(ValueError, match="participant target"):
            Target.parse(bad)


def test_core_resolves_connection_ids_through_the_lookup_a_higher_layer_registers(monkeypatch):
    """core/dsn.py knows no Airflow: without a lookup a connection id is its variable or one
    clear line; with one, the lookup's URI (normalized and remembered for masking)."""
    import ast
    from pathlib import Path

    import tidemark.core

    for path in Path(tidemark.core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                assert not any(n.split(".")[0] == "airflow" for n in names), path
    monkeypatch.delenv("AIRFLOW_CONN_WAREHOUSE", raising=False)
    monkeypatch.setattr(dsn, "_lookup", None)
    with pytest.raises(ConfigError, match="set AIRFLOW_CONN_WAREHOUSE"):
        dsn.resolve(None, "warehouse", "sink w")
    assert dsn.connection_if_defined("warehouse") is None

    class Fixed:
        def uri(self, conn_id: str, where: str) -> str:
            return f"postgres://u:Secret9x@h/{conn_id}"

        def uri_if_defined(self, conn_id: str) -> str | None:
            return None if conn_id == "none" else self.uri(conn_id, "")

    dsn.use_connections(Fixed())
    assert dsn.resolve(None, "warehouse", "sink w") == "postgresql://u:Secret9x@h/warehouse"
    assert dsn.connection_if_defined("none") is None
    assert dsn.mask("'Secret9x'") == "'***'"


def test_a_preview_as_the_last_run_is_no_failure_on_the_pipelines_page():
    from datetime import UTC, datetime

    from tidemark.ledger.history import LastRun, LastRunSink, State
    from tidemark.web.pipelines_pages import _badges

    def last(*states: str) -> State:
        sinks = [LastRunSink(f"s{i}", st, None) for i, st in enumerate(states)]
        at = datetime.now(UTC)
        return State("p", last_run=LastRun(1, "run", at, at, sinks))

    assert _badges(last("previewed", "previewed")) == [("info", "last run a preview")]
    assert _badges(last("previewed", "aborted")) == [("bad", "last run failed: s1")]
    assert _badges(last("committed")) == [("ok", "ok")]


def test_spark_connect_urls_name_a_shared_session_and_hide_their_token():
    """tidemark/engine/connect_session.py: the runs of one package and settings share a
    server session; a URL's parameters (a token) never reach a message or a pipeline file."""
    from tidemark.core import spark_settings
    from tidemark.engine.connect_session import masked, session_url

    a = session_url("sc://h:15002", {})
    assert a.startswith("sc://h:15002/;session_id=") and a == session_url("sc://h:15002", {})
    assert session_url("sc://h:15002", {"spark.sql.shuffle.partitions": "2"}) != a
    assert session_url("sc://h:443/;token=t", {}).startswith("sc://h:443/;token=t;session_id=")
    assert masked("sc://h:443/;token=secret;x=1") == "sc://h:443/;..."
    with pytest.raises(ValueError, match="spark.remote: Spark settings travel in the clear"):
        spark_settings.checked({"spark.remote": "sc://h:443/;token=secret"})
    assert spark_settings.checked({"spark.remote": "sc://h:15002"}) == {
        "spark.remote": "sc://h:15002"
    }
