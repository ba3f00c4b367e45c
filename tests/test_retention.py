"""Retention on a real PostgreSQL ledger: `tidemark prune` deletes what has outlived the
retention settings and keeps what is live or what recovery needs; `tidemark pipelines retire`
deletes one pipeline's rows and Data Docs, and refuses while recovery still needs them; the
maintenance DAG's prune task (tests/test_dags.py checks its place in the DAG).

Rows are inserted directly, with old timestamps, so every kind and every protection is
present in one small ledger."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psycopg
import psycopg.sql
import pytest

from tests.test_cli import assert_one_clear_line, tm
from tidemark.ledger import markers
from tidemark.protocol.prune import Policy, prune

FINAL, OLD, RECENT = ("committed",), 200, 1


def _run(
    c, pipeline: str, states=FINAL, days: int = OLD, mode: str = "run", finished: bool = True
) -> int:
    """A run of ``days`` ago with one sink per state, each with a range, a participant and a
    metric."""
    rid = c.execute(
        """INSERT INTO tidemark.runs (pipeline, mode, owner, created_at, finished_at)
                       VALUES (%s, %s, 'h:1', now() - make_interval(days => %s),
                               CASE WHEN %s THEN now() - make_interval(days => %s) END)
                       RETURNING run_id""",
        (pipeline, mode, days, finished, days),
    ).fetchone()[0]
    for i, st in enumerate(states):
        sink = f"s{i}"
        c.execute(
            """INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch, updated_at)
                     VALUES (%s, %s, %s, 1, now() - make_interval(days => %s))""",
            (rid, sink, st, days),
        )
        c.execute("INSERT INTO tidemark.run_ranges VALUES (%s, %s, 0, 0, 10)", (rid, sink))
        c.execute(
            "INSERT INTO tidemark.participants (run_id, sink, gid, target, task, rows) "
            "VALUES (%s, %s, %s, %s, 0, 10)",
            (rid, sink, f"tm:{rid}:s.{sink}:0:0", f"sink:{sink}"),
        )
        c.execute("INSERT INTO tidemark.run_metrics VALUES (%s, %s, 'rows', 10)", (rid, sink))
    return rid


def _page(root: Path, pipeline: str, label: str, size: int) -> tuple[Path, Path]:
    """A rendered validation page and its stored result, laid out as Great Expectations
    does (tidemark/quality/docs.py)."""
    rel = Path(label, label, "20260101T000000.000000Z", "tidemark-records")
    gx = root / pipeline / "gx" / "uncommitted"
    page = gx / "data_docs" / "local_site" / "validations" / rel.with_suffix(".html")
    result = gx / "validations" / rel.with_suffix(".json")
    for f in (page, result):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * size)
    return page, result


def _dq(c, rid: int, page: Path | str | None) -> None:
    c.execute(
        "INSERT INTO tidemark.dq_results (run_id, success, docs_path) VALUES (%s, true, %s)",
        (rid, str(page) if page else None),
    )


def _letter(c, pipeline: str, rid: int, status: str, days: int, offset: int) -> int:
    return c.execute(
        """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
               payload, error_class, reason, status, first_seen, last_seen, resolved_at)
           VALUES (%s, 's0', %s, 0, %s, 'x', 'decode', 'not JSON', %s,
                   now() - interval '400 days', now() - interval '400 days',
                   CASE WHEN %s <> 'quarantined' THEN now() - make_interval(days => %s) END)
           RETURNING id""",
        (pipeline, rid, offset, status, status, days),
    ).fetchone()[0]


def _request(c, pipeline: str, days: int, letters: list[int]) -> int:
    rid = c.execute(
        """INSERT INTO tidemark.redrive_requests (pipeline, requested_by,
                           requested_at, selection, letters)
                       VALUES (%s, 'alice', now() - make_interval(days => %s), '{}', %s)
                       RETURNING request_id""",
        (pipeline, days, len(letters)),
    ).fetchone()[0]
    for lid in letters:
        c.execute("INSERT INTO tidemark.redrive_letters VALUES (%s, %s)", (rid, lid))
    return rid


def _world(env, docs: Path) -> dict:
    """Old and live rows of every kind, for pipelines orders and other."""
    w = {}
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders'), ('other')")
        w["old"] = _run(c, "orders", ("committed", "aborted"))
        w["old_page"] = _page(docs, "orders", f"orders-run-{w['old']}", 1000)
        _dq(c, w["old"], w["old_page"][0])
        # A driver that died: recovery aborted its sink, nobody set finished_at.
        w["crashed"] = _run(c, "orders", ("aborted",), finished=False)
        w["outside"] = env.tmp / "elsewhere.html"
        w["outside"].write_text("not under the Data Docs folder")
        _dq(c, w["crashed"], w["outside"])
        w["live_letter_run"] = _run(c, "orders", ("committed",))
        w["open"] = _run(c, "orders", ("committed", "prepared"))
        w["dq_failed"] = _run(c, "orders", ("dq_failed",))
        w["resolved_letter_run"] = _run(c, "orders", ("committed",))
        w["recent"] = _run(c, "orders", ("committed",), days=RECENT)
        w["recent_page"] = _page(docs, "orders", f"orders-run-{w['recent']}", 500)
        _dq(c, w["recent"], w["recent_page"][0])
        w["newest_orders"] = _run(c, "orders", ("committed",))
        w["other_old"] = _run(c, "other", ("committed",))
        w["newest"] = _run(c, "other", ("aborted",))  # the recovery sweep's horizon
        w["redriven"] = _letter(c, "orders", w["old"], "redriven", 40, 1)
        w["discarded"] = _letter(c, "orders", w["resolved_letter_run"], "discarded", 40, 2)
        w["recently_discarded"] = _letter(c, "orders", w["recent"], "discarded", 5, 3)
        w["quarantined"] = _letter(c, "orders", w["live_letter_run"], "quarantined", 0, 4)
        w["other_letter"] = _letter(c, "other", w["other_old"], "discarded", 40, 5)
        w["old_request"] = _request(c, "orders", 40, [w["redriven"], 9, 10])
        w["recent_request"] = _request(c, "orders", 5, [w["quarantined"]])
        w["other_request"] = _request(c, "other", 40, [w["other_letter"]])
    return w


def _ids(env, table: str, col: str) -> set[int]:
    return {r[0] for r in env.ledger(f"SELECT {col} FROM tidemark.{table}")}


def _run_ids(env) -> set[int]:
    return _ids(env, "runs", "run_id")


def test_prune_deletes_what_outlived_retention_and_keeps_what_is_live(env):
    docs = env.tmp / "docs"
    w = _world(env, docs)
    before = _run_ids(env)
    lines: list[str] = []
    s = prune(env.ledger_dsn, Policy(), docs, progress=lines.append)

    gone = {w["old"], w["crashed"], w["resolved_letter_run"], w["dq_failed"], w["other_old"]}
    assert _run_ids(env) == before - gone
    kept = _run_ids(env)
    # Each protection: a live letter's run, an open run, a recent one, the newest of a
    # pipeline, the newest of all (the recovery sweep's horizon).
    for k in ("live_letter_run", "open", "recent", "newest_orders", "newest"):
        assert w[k] in kept, k
    # An open run keeps its participants: recovery commits or rolls them back from them.
    assert env.ledger(
        "SELECT count(*) FROM tidemark.participants WHERE run_id = %s", (w["open"],)
    ) == [(2,)]
    for t in ("run_sinks", "run_ranges", "participants", "run_metrics", "dq_results"):
        assert not env.ledger(
            f"SELECT 1 FROM tidemark.{t} WHERE run_id = ANY(%s)", (list(gone),)
        ), t
    # A discarded letter is its record's one place: its row stays, its payload goes.
    assert _ids(env, "dlq", "id") == {
        w["recently_discarded"],
        w["quarantined"],
        w["discarded"],
        w["other_letter"],
    }
    assert env.ledger(
        "SELECT id, payload IS NULL, pruned_at IS NOT NULL FROM tidemark.dlq ORDER BY id"
    ) == sorted(
        (w[k], k in ("discarded", "other_letter"), k in ("discarded", "other_letter"))
        for k in ("discarded", "recently_discarded", "quarantined", "other_letter")
    )
    assert _ids(env, "redrive_requests", "request_id") == {w["recent_request"]}
    assert env.ledger("SELECT request_id FROM tidemark.redrive_letters") == [(w["recent_request"],)]
    # The Data Docs of the deleted run: page and stored result; the recent run's stay, and a
    # page the ledger places outside the Data Docs folder is never deleted.
    assert not any(p.exists() for p in w["old_page"])
    assert not (
        docs / "orders" / "gx" / "uncommitted" / "validations" / f"orders-run-{w['old']}"
    ).exists()
    assert all(p.exists() for p in w["recent_page"]) and w["outside"].exists()
    assert s.docs_files == 2 and s.docs_bytes == 2000
    assert s.outside == [str(w["outside"])]
    assert s.rows == {
        "dlq": 1,
        "dlq_payloads": 2,
        "participants": 6,
        "run_ranges": 6,
        "run_metrics": 6,
        "dq_results": 2,
        "run_sinks": 6,
        "runs": 5,
        "redrive_letters": 4,
        "redrive_requests": 2,
    }
    assert "redriven dead letters: deleted 1" in lines and "finished runs: deleted 5" in lines
    assert "discarded dead letters' payloads: deleted 2" in lines
    # Nothing left to delete: a second prune deletes nothing.
    again = prune(env.ledger_dsn, Policy(), docs)
    assert not any(again.rows.values()) and again.docs_files == 0


def test_prune_keeps_what_the_settings_say(env):
    """Longer keeping times keep everything; 0 days deletes every resolved letter, and any
    finished run nothing else protects."""
    docs = env.tmp / "docs"
    w = _world(env, docs)
    before = _run_ids(env)
    s = prune(env.ledger_dsn, Policy(letters_days=365, runs_days=365, requests_days=365), docs)
    assert not any(s.rows.values()) and _run_ids(env) == before
    prune(env.ledger_dsn, Policy(0, 0, 0), docs)
    assert w["recent"] not in _run_ids(env) and w["live_letter_run"] in _run_ids(env)
    assert _ids(env, "dlq", "id") == {
        w[k] for k in ("quarantined", "discarded", "recently_discarded", "other_letter")
    }


def test_prune_dry_run_and_pipeline_option_on_the_command_line(env):
    docs = env.tmp / "docs"
    w = _world(env, docs)
    before = {
        t: env.ledger(f"SELECT count(*) FROM tidemark.{t}")[0][0]
        for t in ("runs", "run_sinks", "dlq", "redrive_requests")
    }
    environ = env.cli_env(TIDEMARK_DATA_DOCS_DIR=docs)
    code, out, err = tm(environ, "prune", "--dry-run")
    assert code == 0, err
    assert "dry run, nothing deleted" in out and "would delete:" in out
    counts = {ln[:26].strip(): ln[26:].split()[0] for ln in out.splitlines()[2:]}
    assert counts["dead letters"] == "1" and counts["runs"] == "5"
    assert counts["discarded payloads"] == "2" and "their rows stay" in out
    assert counts["redrive requests"] == "2" and counts["Data Docs files"] == "2"
    assert "(2.0 KB)" in out
    assert {t: env.ledger(f"SELECT count(*) FROM tidemark.{t}")[0][0] for t in before} == before
    assert all(p.exists() for p in w["old_page"])

    code, out, err = tm(environ, "prune", "--pipeline", "other", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["rows"]["runs"] == 1 and got["rows"]["dlq_payloads"] == 1 and not got["dry_run"]
    assert "dlq" not in got["rows"] and "their rows stay" in got["notes"][0]
    assert w["other_old"] not in _run_ids(env) and w["old"] in _run_ids(env)
    assert "finished runs: deleted 1" in err

    code, _, err = tm(environ, "prune", "--pipeline", "../etc")
    assert code == 2
    assert_one_clear_line(err, "not a pipeline name")


def test_prune_deletes_in_small_batches_and_skips_locked_rows(env):
    docs = env.tmp / "docs"
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        runs = [_run(c, "orders") for _ in range(6)]
        letters = [_letter(c, "orders", runs[-1], "discarded", 40, i) for i in range(7)]
    code, out, err = tm(
        env.cli_env(TIDEMARK_RETENTION_BATCH_SIZE=2, TIDEMARK_DATA_DOCS_DIR=docs), "prune"
    )
    assert code == 0, err
    progress = [ln for ln in err.splitlines() if ln.startswith("discarded dead letters")]
    assert progress == [f"discarded dead letters' payloads: deleted {n}" for n in (2, 4, 6, 7)]
    runs_progress = [ln for ln in err.splitlines() if ln.startswith("finished runs")]
    assert runs_progress == [f"finished runs: deleted {n}" for n in (2, 4, 5)]
    assert _run_ids(env) == {runs[-1]}

    # A row another transaction holds is skipped, never waited for.
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        more = [_letter(c, "orders", runs[-1], "redriven", 40, 100 + i) for i in range(3)]
    holder = psycopg.connect(env.ledger_dsn)
    try:
        holder.execute("SELECT 1 FROM tidemark.dlq WHERE id = %s FOR UPDATE", (more[1],))
        done = threading.Event()
        result = {}

        def go():
            result["s"] = prune(env.ledger_dsn, Policy(batch_size=1), docs)
            done.set()

        threading.Thread(target=go, daemon=True).start()
        assert done.wait(30), "prune waited for a locked row"
        assert result["s"].rows["dlq"] == 2
        assert _ids(env, "dlq", "id") == {more[1], *letters}
    finally:
        holder.rollback()
        holder.close()
    assert env.ledger(
        "SELECT count(*) FROM tidemark.dlq WHERE id = ANY(%s) AND payload IS NULL", (letters,)
    ) == [(7,)]


def test_two_prunes_never_run_at_once(env):
    from tidemark.core.errors import TidemarkError
    from tidemark.protocol.prune import LOCK_KEY

    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        with pytest.raises(TidemarkError, match="another `tidemark prune`"):
            prune(env.ledger_dsn, Policy(), env.tmp)


# -- retiring a pipeline ----------------------------------------------------------------------
def _counts(env, pipeline: str) -> dict[str, int]:
    q = {
        "pipelines": "name = %(p)s",
        "checkpoints": "pipeline = %(p)s",
        "leases": "pipeline = %(p)s",
        "runs": "pipeline = %(p)s",
        "dlq": "pipeline = %(p)s",
        "redrive_requests": "pipeline = %(p)s",
        "lag_samples": "pipeline = %(p)s",
        "run_sinks": "run_id IN (SELECT run_id FROM tidemark.runs WHERE pipeline = %(p)s)",
        "dq_results": "run_id IN (SELECT run_id FROM tidemark.runs WHERE pipeline = %(p)s)",
        "run_metrics": "run_id IN (SELECT run_id FROM tidemark.runs WHERE pipeline = %(p)s)",
    }
    return {
        t: env.ledger(f"SELECT count(*) FROM tidemark.{t} WHERE {w}", {"p": pipeline})[0][0]
        for t, w in q.items()
    }


def _retire_world(env, docs: Path) -> dict:
    w = _world(env, docs)
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        for p in ("orders", "other"):
            c.execute(
                "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset) "
                "VALUES (%s, 's0', 0, 10)",
                (p,),
            )
            c.execute(
                "INSERT INTO tidemark.leases (pipeline, sink, epoch) VALUES (%s, 's0', 3)", (p,)
            )
            c.execute(
                "INSERT INTO tidemark.lag_samples (pipeline, sink, partition, checkpoint, head) "
                "VALUES (%s, 's0', 0, 10, 12)",
                (p,),
            )
        # The open run of the world settled, as recovery would.
        c.execute("UPDATE tidemark.run_sinks SET state = 'aborted' WHERE state = 'prepared'")
        markers.ensure(c)
        for rid in (w["old"], w["other_old"]):
            markers.record(c, f"tm:{rid}:d.s0:0:0", rid)
    return w


def test_retire_asks_then_deletes_every_row_of_the_pipeline_and_its_data_docs(env):
    docs = env.tmp / "docs"
    w = _retire_world(env, docs)
    other = _counts(env, "orders"), _counts(env, "other")
    environ = env.cli_env(TIDEMARK_DATA_DOCS_DIR=docs)

    code, out, err = tm(environ, "pipelines", "retire", "orders", input_="n\n")
    assert code == 130, err
    assert "dead letters                      4  (2 discarded, 1 quarantined, 1 redriven)" in out, (
        out
    )
    assert "runs                              8" in out
    assert "and its Data Docs: 4 files, 2.9 KB" in out
    assert "Its sink tables are left as they are" in out
    assert (_counts(env, "orders"), _counts(env, "other")) == other  # nothing deleted
    assert (docs / "orders").exists()

    code, out, err = tm(environ, "pipelines", "retire", "orders", input_="y\n")
    assert code == 0, err
    assert "pipeline orders retired" in out
    assert not any(_counts(env, "orders").values())
    assert _counts(env, "other") == other[1]
    assert env.ledger("SELECT count(*) FROM tidemark.redrive_letters") == [(1,)]
    assert not (docs / "orders").exists()
    # Its runs' commit markers went with them; another pipeline's stay.
    assert env.ledger("SELECT run_id FROM tidemark.commits") == [(w["other_old"],)]
    # Nothing left: a second retire says so.
    code, _, err = tm(environ, "pipelines", "retire", "orders", "--yes")
    assert code == 2
    assert_one_clear_line(err, "pipeline orders: nothing to retire")


def test_retire_with_yes_and_a_pipeline_file(env):
    docs = env.tmp / "docs"
    _retire_world(env, docs)
    env.pipeline("orders")
    code, out, err = tm(
        env.cli_env(TIDEMARK_DATA_DOCS_DIR=docs, TIDEMARK_RETENTION_BATCH_SIZE=3),
        "pipelines",
        "retire",
        "orders",
        "--yes",
    )
    assert code == 0, err
    assert "Its sink tables are left as they are (main: public.orders)." in out
    assert "its pipeline file" in out and "still exists" in out
    assert "runs: deleted 3" in err and "runs: deleted 8" in err
    assert not any(_counts(env, "orders").values())


def test_retire_refuses_while_a_run_is_open_or_a_transaction_prepared(env):
    docs = env.tmp / "docs"
    w = _world(env, docs)  # its run w["open"] has a sink still prepared
    env.pipeline("orders")  # its sink database is scanned for prepared transactions
    environ = env.cli_env(TIDEMARK_DATA_DOCS_DIR=docs)
    before = _counts(env, "orders")
    code, out, err = tm(environ, "pipelines", "retire", "orders", "--yes")
    assert code == 1
    assert_one_clear_line(
        err,
        "pipeline orders cannot be retired yet",
        f"run(s) {w['open']} not settled",
        "run `tidemark recover` first",
    )
    assert _counts(env, "orders") == before and (docs / "orders").exists()

    # Settled, but a prepared transaction of one of its runs is left on a sink database.
    env.ledger(
        "UPDATE tidemark.run_sinks SET state = 'aborted' WHERE state = 'prepared' RETURNING 1"
    )
    gid = f"tm:{w['crashed']}:s.main:0:0"
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE t (x int)")
        c.execute("BEGIN")
        c.execute("INSERT INTO t VALUES (1)")
        c.execute(psycopg.sql.SQL("PREPARE TRANSACTION {}").format(psycopg.sql.Literal(gid)))
    try:
        code, out, err = tm(environ, "pipelines", "retire", "orders", "--yes")
        assert code == 1
        assert_one_clear_line(
            err, f"prepared transaction {gid} of its run {w['crashed']}", "tidemark recover"
        )
        assert _counts(env, "orders") == before
        # Another pipeline's prepared transaction does not hold this one back.
        code, out, err = tm(environ, "pipelines", "retire", "other", "--yes")
        assert code == 0, err
    finally:
        with psycopg.connect(env.sink_dsn, autocommit=True) as c:
            c.execute(f"ROLLBACK PREPARED '{gid}'")
    code, out, err = tm(environ, "pipelines", "retire", "orders", "--yes")
    assert code == 0, err


def test_the_maintenance_task_prunes(env, monkeypatch):
    from tidemark.airflow import tasks
    from tidemark.core.settings import get_settings

    docs = env.tmp / "docs"
    w = _world(env, docs)
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    monkeypatch.setenv("TIDEMARK_DATA_DOCS_DIR", str(docs))
    monkeypatch.setenv("TIDEMARK_RETENTION_RUNS_DAYS", "1000")
    get_settings.cache_clear()
    try:
        got = tasks.prune()
    finally:
        get_settings.cache_clear()
    assert got["rows"]["dlq"] == 1 and got["rows"].get("runs", 0) == 0
    assert got["rows"]["dlq_payloads"] == 2
    assert w["old"] in _run_ids(env)


def test_prune_keeps_a_request_a_run_was_just_triggered_for(env):
    """ "Redrive these" on an old preview triggers a DAG run for its request; until that run
    claims the pipeline no open run protects the request, so the trigger marks it queued
    and prune keeps it (a day at least, whatever the retention)."""
    from tidemark.ledger import redrives

    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        queued, idle = _request(c, "orders", 40, []), _request(c, "orders", 40, [])
        stale = _request(c, "orders", 40, [])
        assert redrives.queue(c, queued) and redrives.queue(c, stale)
        c.execute(
            "UPDATE tidemark.redrive_requests SET queued_at = now() - interval '35 days' "
            "WHERE request_id = %s",
            (stale,),
        )
    prune(env.ledger_dsn, Policy(requests_days=0), env.tmp / "docs")
    assert _ids(env, "redrive_requests", "request_id") == {queued}
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        assert not redrives.queue(c, idle)  # gone: the trigger says so instead of queueing


def test_a_pipelines_own_retention_overrides_the_settings_for_it_only_and_is_read_each_time(
    env, monkeypatch
):
    """`retention:` in a pipeline file (issue 48): its keeping times replace the global ones
    for that pipeline only, and the maintenance task reads the file on every run, so a change
    needs no restart."""
    from tidemark import config
    from tidemark.airflow import tasks
    from tidemark.core.settings import get_settings

    docs = env.tmp / "docs"
    w = _world(env, docs)
    env.pipeline("orders", retention={"runs_days": 1000, "letters_days": 1000})
    env.pipeline("other")
    files = config.load_all(env.dir, deep=False)[0]
    s = prune(env.ledger_dsn, Policy(), docs, pipelines=files)
    # orders keeps its old runs and its redriven letter (1000 days); other goes by the
    # settings (90 days: its old run goes).
    assert w["old"] in _run_ids(env) and w["redriven"] in _ids(env, "dlq", "id")
    assert w["other_old"] not in _run_ids(env)
    assert s.policies == {
        "orders": "resolved dead letters 1000 days (a discarded one's payload; its row stays), "
        "finished runs 1000 days, redrive requests 30 days, retired tables kept"
    }
    assert s.lines()[:2] == ["retention of its own:", f"  pipeline orders: its own retention: "
                             f"{s.policies['orders']}"]  # fmt: skip

    # The file changes; the next maintenance run reads it (no restart, no setting).
    env.pipeline("orders", retention={"runs_days": 30, "letters_days": 30})
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    monkeypatch.setenv("TIDEMARK_DATA_DOCS_DIR", str(docs))
    get_settings.cache_clear()
    try:
        got = tasks.prune(str(env.dir))
    finally:
        get_settings.cache_clear()
    assert got["rows"]["dlq"] == 1 and got["rows"]["runs"] >= 1
    assert w["old"] not in _run_ids(env) and w["redriven"] not in _ids(env, "dlq", "id")
    assert w["newest_orders"] in _run_ids(env) and w["live_letter_run"] in _run_ids(env)


def test_retired_tables_go_after_their_retention_saying_which(env):
    """A rebuild's retired `<table>_<YYYYMMDD>_run<N>` tables (and their tombstone tables)
    are dropped once older than the pipeline's retired_tables_days; a younger one, a table
    only named like one, and one a view depends on are kept (the last said so)."""
    from datetime import UTC, datetime

    from tidemark import config
    from tidemark.protocol.sinks import tombstone_name

    docs = env.tmp / "docs"
    today = f"{datetime.now(UTC):%Y%m%d}"
    old, viewed, young, decoy = (
        "orders_20200101_run5",
        "orders_20200102_run6",
        f"orders_{today}_run7",
        "orders_x_20200101_run8",
    )
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        for t in ("orders", old, viewed, young, decoy):
            c.execute(f"CREATE TABLE public.{t} (id int PRIMARY KEY)")
        c.execute(f"CREATE VIEW public.keeps AS SELECT * FROM public.{viewed}")
        c.execute("CREATE SCHEMA IF NOT EXISTS tidemark")
        tomb = tombstone_name(f"public.{old}")
        c.execute(f"CREATE TABLE tidemark.{tomb} (id int)")
    env.pipeline(retention={"retired_tables_days": 30})
    files = config.load_all(env.dir, deep=False)[0]

    def tables() -> set[str]:
        return {
            r[0]
            for r in env.q(
                env.sink_dsn,
                "SELECT tablename FROM pg_tables WHERE schemaname IN ('public', 'tidemark')",
            )
        }

    before = tables()
    dry = prune(env.ledger_dsn, Policy(), docs, pipelines=files, dry_run=True)
    assert tables() == before
    assert [t.split(" (")[0] for t in dry.tables] == [
        f"would drop retired table public.{old}",
        f"would drop retired table public.{viewed}",
    ]
    s = prune(env.ledger_dsn, Policy(), docs, pipelines=files)
    assert tables() == before - {old, tomb}
    assert s.rows["retired_tables"] == 1
    (line,) = s.tables
    assert line.startswith(
        f"dropped retired table public.{old} (pipeline orders sink main; rebuild run 5, "
        f"retired 2020-01-01, "
    ) and line.endswith("days ago; kept 30 days)")
    assert any(n.startswith(f"kept retired table public.{viewed}") and "depend" in n for n in
               s.notes), s.notes  # fmt: skip
    assert f"  {line}" in s.lines()
    # Without retired_tables_days (the default) retired tables are kept.
    env.pipeline()
    files = config.load_all(env.dir, deep=False)[0]
    assert prune(env.ledger_dsn, Policy(), docs, pipelines=files).tables == []
