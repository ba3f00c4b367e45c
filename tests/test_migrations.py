"""Migrations against a real PostgreSQL: V005 moves the Airflow identity of old runs from
the external_id JSON into columns, and leaves other callers' ids alone."""

from __future__ import annotations

import json
import uuid

import psycopg

from tidemark.ledger import migrations, runs


def test_v005_moves_airflow_identity_into_columns(pg, monkeypatch):
    db = f"mig_{uuid.uuid4().hex[:8]}"
    pg.create_database(db)
    dsn = pg.dsn(db)
    everything = migrations.available()
    monkeypatch.setattr(migrations, "available", lambda: [m for m in everything if m[0] <= 4])
    assert migrations.upgrade(dsn)[0] == 4
    old = {"dag_id": "tidemark_orders", "run_id": "scheduled__2026-01-01", "task_id": "replay",
           "try": 3}
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        ids = [c.execute("INSERT INTO tidemark.runs (pipeline, mode, owner, external_id) "
                         "VALUES ('orders', 'run', 'h:1', %s) RETURNING run_id",
                         (ext,)).fetchone()[0]
               for ext in (json.dumps(old), "{not json", "ticket-42", None,
                           json.dumps({"dag_id": 7, "run_id": "x"}))]
    monkeypatch.setattr(migrations, "available", lambda: everything)
    assert migrations.upgrade(dsn)[0] == everything[-1][0]
    with psycopg.connect(dsn, autocommit=True) as c:
        got = [runs.get(c, i) for i in ids]
        assert got[0]["airflow"] == {"dag_id": "tidemark_orders",
                                     "run_id": "scheduled__2026-01-01", "task_id": "replay",
                                     "try_number": 3}
        assert got[0]["external_id"] is None
        assert [g["airflow"] for g in got[1:]] == [None] * 4
        assert [g["external_id"] for g in got[1:]] == [
            "{not json", "ticket-42", None, json.dumps({"dag_id": 7, "run_id": "x"})]
        found, sinks = runs.of_dag_run(c, "orders", "tidemark_orders", "scheduled__2026-01-01")
        assert found["run_id"] == ids[0] and sinks == []


def test_the_ledger_enums_are_the_python_enums(env):
    """One list of run states (RunState), error classes and letter statuses: the ledger's
    enum types must hold exactly those, in order."""
    from tidemark.ledger.dlq import ERROR_CLASSES, STATUSES
    from tidemark.ledger.state import RunState

    def labels(name: str) -> list[str]:
        return [r[0] for r in env.ledger(
            "SELECT e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid "
            "JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = 'tidemark' "
            "AND t.typname = %s ORDER BY e.enumsortorder", (name,))]

    assert labels("run_state") == [s.value for s in RunState]
    assert labels("error_class") == list(ERROR_CLASSES)
    assert labels("dlq_status") == list(STATUSES)
