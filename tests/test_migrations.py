"""Migrations against a real PostgreSQL: V005 moves the Airflow identity of old runs from
the external_id JSON into columns, and leaves other callers' ids alone; V007's letters from
before it get their source headers and timestamp from the source, or the reason why not."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime

import psycopg

from tidemark.ledger import migrations, runs


def _ledger_at(version: int, pg, monkeypatch) -> tuple[str, list]:
    """A new ledger database migrated up to ``version`` only, and every migration (to
    upgrade the rest with)."""
    db = f"mig_{uuid.uuid4().hex[:8]}"
    pg.create_database(db)
    dsn = pg.dsn(db)
    everything = migrations.available()
    monkeypatch.setattr(migrations, "available", lambda: [m for m in everything if m[0] <= version])
    assert migrations.upgrade(dsn)[0] == version
    return dsn, everything


def test_v005_moves_airflow_identity_into_columns(pg, monkeypatch):
    dsn, everything = _ledger_at(4, pg, monkeypatch)
    old = {
        "dag_id": "tidemark_orders",
        "run_id": "scheduled__2026-01-01",
        "task_id": "replay",
        "try": 3,
    }
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        ids = [
            c.execute(
                "INSERT INTO tidemark.runs (pipeline, mode, owner, external_id) "
                "VALUES ('orders', 'run', 'h:1', %s) RETURNING run_id",
                (ext,),
            ).fetchone()[0]
            for ext in (
                json.dumps(old),
                "{not json",
                "ticket-42",
                None,
                json.dumps({"dag_id": 7, "run_id": "x"}),
            )
        ]
    monkeypatch.setattr(migrations, "available", lambda: everything)
    assert migrations.upgrade(dsn)[0] == everything[-1][0]
    with psycopg.connect(dsn, autocommit=True) as c:
        got = [r.as_dict() for i in ids if (r := runs.get(c, i))]
        assert len(got) == len(ids)
        assert got[0]["airflow"] == {
            "dag_id": "tidemark_orders",
            "run_id": "scheduled__2026-01-01",
            "task_id": "replay",
            "try_number": 3,
        }
        assert got[0]["external_id"] is None
        assert [g["airflow"] for g in got[1:]] == [None] * 4
        assert [g["external_id"] for g in got[1:]] == [
            "{not json",
            "ticket-42",
            None,
            json.dumps({"dag_id": 7, "run_id": "x"}),
        ]
        found, sinks = runs.of_dag_run(c, "orders", "tidemark_orders", "scheduled__2026-01-01")
        assert found is not None and found.run_id == ids[0] and sinks == []


def test_the_ledger_enums_are_the_python_enums(env):
    """One list of run states (RunState), error classes and letter statuses: the ledger's
    enum types must hold exactly those, in order."""
    from tidemark.ledger.dlq import ErrorClass, LetterStatus
    from tidemark.ledger.state import RunState

    def labels(name: str) -> list[str]:
        return [
            r[0]
            for r in env.ledger(
                "SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid "
                "JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = 'tidemark' "
                "AND t.typname = %s ORDER BY e.enumsortorder",
                (name,),
            )
        ]

    assert labels("run_state") == [s.value for s in RunState]
    assert labels("error_class") == [c.value for c in ErrorClass]
    assert labels("dlq_status") == [s.value for s in LetterStatus]


def test_the_participant_outcomes_are_the_python_enum(env):
    """A participant's outcome is a CHECK on text, not an enum type: the values it allows
    must be exactly Outcome's."""
    from tidemark.ledger.runs import Outcome

    [(check,)] = env.ledger(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY(c.conkey) "
        "WHERE c.conrelid = 'tidemark.participants'::regclass AND c.contype = 'c' "
        "AND a.attname = 'outcome'"
    )
    assert re.findall(r"'([^']*)'::text", check) == [o.value for o in Outcome]


def test_v007_letters_from_before_it_get_the_source_fields_or_the_reason(pg, monkeypatch):
    """A letter written at V006 has no source headers or timestamp after V007 (not known
    yet). Filled from the source before a redrive reads it: the record's exact headers text
    and ts where the source holds it; where it does not, NULL and the reason on the letter.
    Only once: a second fill changes nothing."""
    from tidemark import config
    from tidemark.driver.redrive import fill_source_fields
    from tidemark.ledger import letters, redrives
    from tidemark.sources.postgres_log import append, create_log_table

    dsn, everything = _ledger_at(6, pg, monkeypatch)
    exact = '{"z": 1,  "a": "x\\u0000y"}'  # jsonb would reorder, respace, refuse \u0000
    ts = datetime(2026, 2, 3, 4, 5, 6, 7, tzinfo=UTC)
    with psycopg.connect(dsn, autocommit=True) as c:
        create_log_table(c, "src.log")
        c.execute("ALTER TABLE src.log ALTER COLUMN headers TYPE json")
        append(c, "src.log", [(0, b"k0", b"{}", exact, ts), (0, b"k1", b"{}", None, ts)])
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        c.execute(
            "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset) "
            "VALUES ('orders', 'main', 0, 3), ('orders', 'second', 0, 3)"
        )
        # As V006 wrote them: two sinks' letters for offset 0, one for the gone offset 2.
        old = [
            c.execute(
                "INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,"
                " key, payload, headers, error_class, reason) VALUES ('orders', %s, 1, 0, %s, "
                "'k', '{}', %s, 'validation', 'r') RETURNING id",
                (sink, off, headers),
            ).fetchone()[0]
            for sink, off, headers in (
                ("main", 0, '{"_tm_unstorable_headers_base64": "eA=="}'),
                ("second", 0, '{"_tm_unstorable_headers_base64": "eA=="}'),
                ("main", 2, '{"old": true}'),
            )
        ]
    monkeypatch.setattr(migrations, "available", lambda: everything)
    assert migrations.upgrade(dsn)[0] == everything[-1][0]

    def fields() -> list[tuple]:
        with psycopg.connect(dsn, autocommit=True) as c:
            return [
                (None if h is None else bytes(h).decode(), t, k, n)
                for h, t, k, n in c.execute(
                    "SELECT source_headers, source_ts, source_kept, source_note "
                    "FROM tidemark.dlq WHERE id = ANY(%s) ORDER BY id",
                    (old,),
                )
            ]

    assert fields() == [(None, None, None, None)] * 3
    pipeline = config.parse(
        json.dumps(
            {
                "name": "orders",
                "source": {"type": "postgres_log", "dsn": dsn, "table": "src.log"},
                "decode": {"schema": {"id": "int"}},
                "transform": {"select": {"id": "id"}},
                "sinks": [
                    {"name": s, "dsn": dsn, "table": "public.t", "key": ["id"]}
                    for s in ("main", "second")
                ],
            }
        ),
        "test",
        deep=False,
    )
    with psycopg.connect(dsn, autocommit=True) as c:
        req = redrives.create(c, "orders", "erin", ids=old)
    assert fill_source_fields(dsn, pipeline, req.request_id, ["main", "second"]) == 3
    assert fields() == [(exact, ts, True, None)] * 2 + [(None, None, False, letters.SOURCE_GONE)]
    assert fill_source_fields(dsn, pipeline, req.request_id, ["main", "second"]) == 0


def test_v014_masks_the_passwords_of_stored_pipeline_configs(pg, monkeypatch):
    before = max(m[0] for m in migrations.available() if m[0] < 14)
    dsn, everything = _ledger_at(before, pg, monkeypatch)
    config = {
        "source": {"dsn": "postgresql://u:Ab/Secret9@h:5432/src"},
        "sinks": [
            {"dsn": "postgresql://u@h/db?sslmode=require&password=Secret9"},
            {"dsn": "host=h password='Secret9 x' dbname=w"},
            {"conn_id": "plain", "dsn": "postgresql://h:5432/db"},
        ],
    }
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO tidemark.pipelines (name, config) VALUES ('p', %s)", (json.dumps(config),)
        )
    monkeypatch.setattr(migrations, "available", lambda: everything)
    migrations.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        (got,) = c.execute("SELECT config FROM tidemark.pipelines").fetchone()
    assert "Secret9" not in json.dumps(got)
    assert got["source"]["dsn"] == "postgresql://u:***@h:5432/src"
    assert got["sinks"][2] == config["sinks"][2]


def test_v009_fills_where_a_sink_began_only_where_the_ledger_proves_it(pg, monkeypatch):
    """Checkpoints from before V009 get where their sink began only where the ledger proves
    it: one never advanced began where it is; one seeded by the claim that created the
    pipeline's row began where that claim's run started it. Any other (a later run, perhaps
    after retention deleted the first) is NULL: the source's first record, as before, never
    a start too high for a rebuild. Status says both."""
    from tidemark.ledger.status import pipeline_status, render

    dsn, everything = _ledger_at(8, pg, monkeypatch)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO tidemark.pipelines (name, created_at) "
            "VALUES ('orders', '2026-01-01T00:00Z')"
        )
        first, later = (
            c.execute(
                "INSERT INTO tidemark.runs (pipeline, mode, owner, created_at) "
                "VALUES ('orders', 'run', 'h:1', %s) RETURNING run_id",
                (at,),
            ).fetchone()[0]
            for at in ("2026-01-01T00:00Z", "2026-01-02T00:00Z")
        )
        for run, sink, part, lo, hi in (
            (first, "main", 0, 3, 5),
            (later, "main", 0, 5, 9),
            (later, "main", 2, 7, 8),
            (later, "second", 0, 3, 9),
        ):
            c.execute(
                "INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch) "
                "VALUES (%s, %s, 'committed', 1) ON CONFLICT DO NOTHING",
                (run, sink),
            )
            c.execute(
                "INSERT INTO tidemark.run_ranges VALUES (%s, %s, %s, %s, %s)",
                (run, sink, part, lo, hi),
            )
        c.execute(
            "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset, "
            "updated_by) VALUES ('orders', 'main', 0, 9, %(l)s), ('orders', 'main', 1, 4, "
            "NULL), ('orders', 'main', 2, 8, %(l)s), ('orders', 'second', 0, 9, %(l)s)",
            {"l": later},
        )
    monkeypatch.setattr(migrations, "available", lambda: everything)
    assert migrations.upgrade(dsn)[0] == everything[-1][0]
    with psycopg.connect(dsn, autocommit=True) as c:
        st = pipeline_status(c, "orders")
    began = {(c.sink, c.partition): c.start_offset for c in st.checkpoints}
    assert began == {("main", 0): 3, ("main", 1): 4, ("main", 2): None, ("second", 0): None}
    text = render(st)
    assert "partition 0               9  began at 3" in text, text
    assert "partition 2               8  began at the source's first record" in text, text


def test_v019_makes_the_dry_runs_aborted_before_it_previewed(pg, monkeypatch):
    """A preview before V019 ended its sinks aborted with the error 'dry run: rolled back';
    after it they read previewed, without the error, and every other row stays as it was
    (an abort with any other error too). The open-run index still serves the open states."""
    before = max(m[0] for m in migrations.available() if m[0] < 19)
    dsn, everything = _ledger_at(before, pg, monkeypatch)
    rows = [
        ("a", "aborted", "dry run: rolled back"),
        ("b", "aborted", "Spark failed"),
        ("c", "committed", None),
        ("d", "lost", "gid x lost"),
        ("e", "writing", None),
    ]
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('p')")
        (rid,) = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES ('p', 'backfill', 'h:1') "
            "RETURNING run_id"
        ).fetchone()
        for sink, st, error in rows:
            c.execute(
                "INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch, error) "
                "VALUES (%s, %s, %s, 1, %s)",
                (rid, sink, st, error),
            )
    monkeypatch.setattr(migrations, "available", lambda: everything)
    assert migrations.upgrade(dsn)[0] == everything[-1][0]
    with psycopg.connect(dsn, autocommit=True) as c:
        got = c.execute(
            "SELECT sink, state::text, error FROM tidemark.run_sinks ORDER BY sink"
        ).fetchall()
        assert got == [("a", "previewed", None), *rows[1:]]
        (index,) = c.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'run_sinks_open'"
        ).fetchone()
        assert "writing" in index and "previewed" not in index
        # The column's default survives the new type.
        c.execute(
            "INSERT INTO tidemark.run_sinks (run_id, sink, lease_epoch) VALUES (%s, 'f', 1)", (rid,)
        )
        assert c.execute(
            "SELECT state::text FROM tidemark.run_sinks WHERE sink = 'f'"
        ).fetchone() == ("planned",)
