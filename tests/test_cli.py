"""The command line as a user meets it: one clear line and a non-zero exit on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from tests.conftest import free_port
from tidemark.devstack.localpg import Cluster


def tm(
    env_vars: dict[str, str],
    *args: str,
    cwd: Path | None = None,
    input_: str | None = None,
    timeout: float = 120,
) -> tuple[int, str, str]:
    """`tidemark ARGS` as a process: (exit code, stdout, stderr)."""
    if "PYTHONPATH" in os.environ:  # the code under test is the one pytest imports (a worktree)
        env_vars = {"PYTHONPATH": os.environ["PYTHONPATH"], **env_vars}
    # No terminal, and nothing to read but ``input_``: a command that would ask must say --yes
    # instead, or read its answer there.
    res = subprocess.run(
        [sys.executable, "-m", "tidemark", *args],
        env=env_vars,
        cwd=cwd,
        input=input_,
        stdin=subprocess.DEVNULL if input_ is None else None,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return res.returncode, res.stdout, res.stderr


def assert_one_clear_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], err


def test_wrong_password_is_one_masked_line(env):
    bad = env.ledger_dsn.replace("tidemark:tidemark@", "tidemark:s3cret-pw@")
    code, out, err = tm(env.cli_env(TIDEMARK_LEDGER_DSN=bad), "db", "upgrade")
    assert code == 1
    assert_one_clear_line(
        err, "cannot connect to ledger", "tidemark:***@", "password authentication failed"
    )
    assert "s3cret-pw" not in out + err


def test_unreachable_server_and_missing_ledger(env):
    dead = f"postgresql://u:pw@127.0.0.1:{free_port()}/x"
    code, _, err = tm(env.cli_env(TIDEMARK_LEDGER_DSN=dead), "status", "orders")
    assert code == 1
    assert_one_clear_line(err, "cannot connect to ledger", "Connection refused")
    environ = env.cli_env()
    del environ["TIDEMARK_LEDGER_DSN"]
    code, _, err = tm(environ, "recover", cwd=env.tmp)
    assert code == 1
    assert_one_clear_line(err, "TIDEMARK_LEDGER_DSN")


def test_a_server_without_prepared_transactions_is_refused():
    root = Path(tempfile.mkdtemp(prefix="tidemark-test-noprep-"))
    root.chmod(0o755)
    cluster = Cluster(
        root, free_port(), overrides={"max_prepared_transactions": "0", "fsync": "off"}
    )
    cluster.start()
    try:
        environ = {"PATH": "/usr/bin:/bin", "TIDEMARK_LEDGER_DSN": cluster.dsn()}
        code, _, err = tm(environ, "db", "upgrade")
        assert code == 1
        assert_one_clear_line(err, "max_prepared_transactions is 0")
    finally:
        cluster.destroy()


def test_db_upgrade_is_idempotent(env):
    from tidemark.ledger.migrations import available

    latest = [v for v, _, _ in available()]
    code, out, _ = tm(env.cli_env(), "db", "upgrade")
    assert code == 0 and f"schema version {latest[-1]}" in out and "applied" not in out
    assert env.ledger("SELECT version FROM tidemark.schema_version ORDER BY 1") == [
        (v,) for v in latest
    ]


_BASE = (
    "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
    "sinks: [{name: s, dsn: x, table: t, key: [a]}]\n"
)

BAD_FILES = {
    "notyaml": ("name: x\n  sinks: [", "line 2: not valid YAML"),
    "unknown": (
        "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
        "sinks: [{name: s, dsn: x, table: t, key: [a]}]\ncolour: red\n",
        "colour: Extra inputs are not permitted",
    ),
    "badtype": (
        "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: inty}}\n"
        "sinks: [{name: s, dsn: x, table: t, key: [a]}]\n",
        "decode.schema: field a: unsupported type 'inty'",
    ),
    "nokey": (
        "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
        "sinks: [{name: s, dsn: x, table: t, key: [b]}]\n",
        "sinks[0].key: key columns not produced by the transform: b",
    ),
    "twodsn": (
        "source: {type: postgres_log, dsn: x, conn_id: y, table: t}\n"
        "decode: {schema: {a: int}}\nsinks: [{name: s, dsn: x, table: t, key: [a]}]\n",
        "source: give exactly one of dsn or conn_id",
    ),
    "twosinks": (
        "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
        "sinks: [{name: s, dsn: x, table: t, key: [a]}, {name: s, dsn: y, table: u, "
        "key: [a]}]\n",
        "sinks[1].name: sink name 's' is used twice",
    ),
    "unknownexp": (
        _BASE + "quality:\n  rows:\n    - expect_column_values_to_be_in_sett: "
        "{column: a, value_set: [1]}\n",
        "quality.rows[0]: unknown expectation",
    ),
    "badexparg": (
        _BASE + "quality:\n  batch:\n    - expect_column_values_to_be_in_set: "
        "{column: a, valueset: [1]}\n",
        "quality.batch[0]: expect_column_values_to_be_in_set: bad arguments",
    ),
    "aggrows": (
        _BASE + "quality:\n  rows:\n    - expect_table_row_count_to_be_between: {min_value: 1}\n",
        "quality.rows[0]: expect_table_row_count_to_be_between checks the batch",
    ),
    "sinkexp": (
        _BASE.replace("key: [a]}", "key: [a], quality: {batch: [{nope: {}}]}}"),
        "sinks[0].quality.batch[0]: unknown expectation",
    ),
    "nosource": (
        "decode: {schema: {a: int}}\nsinks: [{name: s, dsn: x, table: t, key: [a]}]\n",
        "source: Field required",
    ),
    "badlimit": (
        "source: {type: postgres_log, dsn: x, table: t}\ndecode: {schema: {a: int}}\n"
        "sinks: [{name: s, dsn: x, table: t, key: [a]}]\n"
        "limits: {max_records_per_partition: 0}\n",
        "limits.max_records_per_partition: Input should be greater than 0",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_pipeline_files_name_the_file_the_field_and_the_problem(tmp_path, name):
    text, expected = BAD_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    code, out, err = tm({"PATH": "/usr/bin:/bin"}, "pipelines", "validate", str(path))
    assert code == 2, out + err
    assert f"invalid {path}: {expected}" in out, out
    assert_one_clear_line(err, "1 of 1 pipeline file(s) invalid")


def test_validate_lists_every_problem_of_a_broken_file(tmp_path):
    """A misspelt field is two problems, and the first alone hides the cause."""
    path = tmp_path / "refunds.yaml"
    path.write_text(_BASE.replace("table: t, key", "tabel: t, key"))
    code, out, err = tm({"PATH": "/usr/bin:/bin"}, "pipelines", "validate", str(path))
    assert code == 2, out + err
    assert out.splitlines() == [
        f"invalid {path}: sinks[0].table: Field required (and 1 more)",
        f"invalid {path}: sinks[0].tabel: Extra inputs are not permitted",
    ], out


def test_a_connection_airflow_keeps_names_its_user_and_the_variable_to_set(tmp_path):
    """Where Airflow is not configured the CLI cannot see the connections made in its UI or
    REST API: the error says which part of the pipeline names the connection, that Airflow
    has no metadata database here, and what to set instead."""
    path = tmp_path / "payments.yaml"
    path.write_text(
        "source: {type: postgres_log, conn_id: shop_log, table: t}\n"
        "decode: {schema: {a: int}}\n"
        "sinks: [{name: wh, conn_id: shop_wh, table: t, key: [a]}]\n"
    )
    env = {"PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(tmp_path / "airflow")}
    code, out, err = tm(env, "pipelines", "validate", str(path))
    assert code == 2, out + err
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line, (where, var) in zip(
        lines,
        [("source", "AIRFLOW_CONN_SHOP_LOG"), ("sink wh", "AIRFLOW_CONN_SHOP_WH")],
        strict=True,
    ):
        assert line.startswith(f"invalid {path}: pipeline payments: {where}: Airflow "), out
        assert "not found (" in line and f"outside Airflow, set {var} to its URI" in line, out
        # Its AIRFLOW_HOME has no metadata database, and asking made none.
        assert "Airflow is not configured here: no metadata database" in line, out
    assert not (tmp_path / "airflow" / "airflow.db").exists()


def test_a_broken_file_never_hides_the_good_ones(env):
    env.pipeline("good")
    (env.dir / "broken.yaml").write_text("sinks: [")
    code, out, _ = tm(env.cli_env(), "pipelines", "list")
    assert code == 2
    assert out.splitlines()[0].startswith("good")
    assert "INVALID" in out and "broken.yaml" in out


def test_unknown_pipeline_and_status_json(env):
    env.pipeline()
    code, _, err = tm(env.cli_env(), "run", "nope")
    assert code == 2
    assert_one_clear_line(err, "no pipeline named 'nope'", "known: orders")
    code, out, _ = tm(env.cli_env(), "status", "orders", "--json")
    assert code == 0
    assert json.loads(out)["known"] is False


def test_backfill_arguments_are_checked(env):
    env.pipeline()
    code, _, err = tm(
        env.cli_env(), "backfill", "orders", "--partition", "0", "--from", "9", "--to", "3"
    )
    assert code == 2
    assert "--to (3) must be greater than --from (9)" in err
    for args, says in [
        (["--partition", "0"], "--partition N needs --from and --to"),
        ([], "say what to backfill: --partition, or --since and --until"),
        (["--since", "2026-01-01"], "give both --since and --until"),
        (["--since", "2026-01-02", "--until", "2026-01-01"], "must be after --since"),
        (["--partition", "x"], "'x' is neither a partition number nor 'all'"),
        (["--since", "2026-01-01", "--until", "2026-01-02", "--from", "1"], "or offsets"),
    ]:
        code, _, err = tm(env.cli_env(), "backfill", "orders", *args)
        assert code == 2 and says in err and "Traceback" not in err, (args, err)


def test_dq_show_and_status_report_the_gate(env):
    env.pipeline()
    env.ledger("INSERT INTO tidemark.pipelines (name) VALUES ('orders') RETURNING 1")
    run_id = env.ledger("""INSERT INTO tidemark.runs (pipeline, mode, owner)
                           VALUES ('orders', 'run', 't:1') RETURNING run_id""")[0][0]
    env.ledger(
        """INSERT INTO tidemark.dq_results (run_id, scope, success, rows_failed, results,
                  docs_path) VALUES (%s, '', false, 3, %s, '/x/page.html') RETURNING 1""",
        (
            run_id,
            '[{"expectation": "expect_column_max_to_be_between", "success": false, '
            '"kwargs": {"column": "amount", "max_value": 1000}, "observed_value": 1e9}]',
        ),
    )
    code, out, _ = tm(env.cli_env(), "dq", "show", str(run_id))
    assert code == 0
    assert "(pipeline): FAILED, 3 rows quarantined" in out
    assert (
        "FAIL expect_column_max_to_be_between(column=amount, max_value=1000) observed "
        "1000000000" in out
    )
    assert "Data Docs: /x/page.html" in out
    code, out, _ = tm(env.cli_env(), "status", "orders")
    assert code == 0 and "data quality (last gate per scope)" in out
    assert "failed: expect_column_max_to_be_between" in out


def test_dq_docs_rebuilds_the_index_or_says_there_is_nothing(env, tmp_path):
    missing = tmp_path / "no-docs"
    code, out, err = tm(env.cli_env(TIDEMARK_DATA_DOCS_DIR=missing), "dq", "docs")
    assert code != 0 and "Traceback" not in err
    assert f"no Data Docs in {missing}" in err and len(err.strip().splitlines()) == 1
    docs = env.cli_env(TIDEMARK_DATA_DOCS_DIR=tmp_path / "docs")
    (tmp_path / "docs").mkdir()
    code, out, err = tm(docs, "dq", "docs")  # no pipeline has Data Docs yet
    assert code != 0 and "no Data Docs in" in err and "Traceback" not in err
    code, out, err = tm(docs, "dq", "docs", "../etc")
    assert code == 2 and "'../etc': not a pipeline name" in err
    code, out, err = tm(docs, "dq", "docs", "orders")  # each pipeline has its own site
    assert code == 0, err
    index = (
        tmp_path
        / "docs"
        / "orders"
        / "gx"
        / "uncommitted"
        / "data_docs"
        / "local_site"
        / "index.html"
    )
    assert out.strip() == f"orders: {index}: 0 validation(s)" and index.is_file()
    code, out, err = tm(docs, "dq", "docs")
    assert code == 0 and out.strip() == f"orders: {index}: 0 validation(s)", err


def test_an_up_to_date_run_is_cheap_and_a_bad_check_stops_a_due_one(env):
    """With nothing new, `tidemark run` settles recovery and asks the plan before loading Great
    Expectations or Spark; with records due, a bad expectation still stops it before any
    claim, naming the file and the field."""
    bad = {"rows": [{"expect_column_values_to_be_in_sett": {"column": "id", "value_set": [1]}}]}
    path = env.pipeline(quality=bad)
    code, out, err = tm(env.cli_env(), "run", "orders", cwd=env.tmp)
    assert (code, out.strip()) == (0, "orders: up to date: nothing to replay"), err
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tidemark", "run", "orders"],
        env=env.cli_env(),
        cwd=env.tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = {ln.rsplit("|", 1)[-1].strip() for ln in res.stderr.splitlines()}
    assert "great_expectations" not in loaded  # (no JVM either: bench/idle_bench.py times it)

    env.append_orders(range(4))
    code, out, err = tm(env.cli_env(), "run", "orders", cwd=env.tmp)
    assert code == 2, out + err
    assert_one_clear_line(err, f"{path}: quality.rows[0]: unknown expectation")
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]


def test_a_file_archive_segment_it_cannot_read_is_one_line_and_a_failed_run(env):
    """Issue 32: a segment the source cannot read (here an unknown extension) was skipped as
    a compaction gap with exit 0; now the run fails, naming the file, and claims nothing."""
    from tidemark.devstack.archive_writer import write_segment

    archive = env.tmp / "archive"
    recs = [
        {
            "partition": 0,
            "offset": o,
            "key": None,
            "payload": b'{"id": 1}',
            "headers": None,
            "ts": None,
        }
        for o in range(3)
    ]
    write_segment(str(archive), 0, recs, "parquet")
    bad = archive / "partition=0" / f"{3:020d}.avro"
    bad.write_bytes(b"Obj\x01")
    env.pipeline(source={"type": "file_archive", "uri": str(archive), "format": "parquet"})
    code, out, err = tm(env.cli_env(), "run", "orders", cwd=env.tmp)
    assert code == 1, out + err
    assert_one_clear_line(err, f"{bad}: unknown segment format (extension '.avro')")
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]
    assert env.checkpoints() == {}


def test_validate_checks_the_world_and_names_each_mismatch_with_its_fix(env):
    env.append_orders([1])  # the source log table exists
    good = env.pipeline("good")
    with psycopg.connect(env.sink2_dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE legacy (id int PRIMARY KEY, version int, amount numeric(6,2), "
            "_tm_partition int NOT NULL, _tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL)"
        )
    bad = env.pipeline(
        "bad",
        source={"type": "postgres_log", "dsn": env.ledger_dsn, "table": "src.nolog"},
        sinks=[
            {
                "name": "old",
                "dsn": env.sink2_dsn,
                "table": "public.legacy",
                "key": ["id", "version"],
            }
        ],
    )
    code, out, err = tm(env.cli_env(), "pipelines", "validate")
    assert code == 2, out + err
    assert f"ok      {good}" in out, out
    problems = [ln.removeprefix(f"invalid {bad}: ") for ln in out.splitlines() if str(bad) in ln]
    assert problems == [
        "source table src.nolog does not exist (docs/pipelines.md, 'Sources', names "
        "the columns it needs)",
        "sink old: table public.legacy: column amount is numeric(6,2), the transform writes "
        "double precision, which it cannot take whole; fix: ALTER TABLE public.legacy ALTER "
        "COLUMN amount TYPE double precision  (or cast amount to numeric(6,2) in the "
        "transform's select)",
        "sink old: table public.legacy allows NULL in key column(s) version; fix: ALTER TABLE "
        "public.legacy ALTER COLUMN version SET NOT NULL",
        "sink old: table public.legacy needs a unique index on exactly (id, version) for keyed "
        "upserts; fix: `tidemark sink rebuild bad old` (a new table with this key, from "
        "the source), or CREATE UNIQUE INDEX ON public.legacy (id, version)",
        "sink old: table public.legacy: unique index or constraint legacy_pkey on (id) is "
        "narrower than the key (id, version) and would refuse rows the key tells apart; fix: "
        "`tidemark sink rebuild bad old` makes the table again from the source with the "
        "new key, swapped in atomically (the old one kept); or by hand: ALTER TABLE "
        "public.legacy DROP CONSTRAINT legacy_pkey (DROP INDEX legacy_pkey if it is an index "
        "alone), then `tidemark backfill bad --partition all`",
    ], out
    assert_one_clear_line(err, "1 of 2 pipeline file(s) invalid")
    # The files alone are fine: --offline connects to nothing.
    code, out, err = tm(env.cli_env(), "pipelines", "validate", "--offline")
    assert code == 0, out + err
    assert f"ok      {bad}" in out, out


def test_dry_run_previews_a_backfill_and_a_redrive_and_commits_nothing(env, spark):
    """`--dry-run` says it was a preview and what each sink would get, exits 0, and leaves
    the sink and the dead letters as they were."""
    rule = "expect_column_values_to_be_between"
    docs = [{"id": i, "name": "x", "amount": a, "version": 1} for i, a in enumerate([50, 500])]
    env.append([(0, str(d["id"]).encode(), json.dumps(d).encode(), None, None) for d in docs])
    env.pipeline(quality={"rows": [{rule: {"column": "amount", "max_value": 300}}]})
    assert env.run(spark).ok
    env.pipeline(quality={"rows": [{rule: {"column": "amount", "max_value": 600}}]})
    rows = env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id")
    letters = env.ledger("SELECT id, status::text, attempts FROM tidemark.dlq")

    code, out, err = tm(
        env.cli_env(), "backfill", "orders", "--partition", "all", "--dry-run", cwd=env.tmp
    )
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("dry run: nothing was committed - run "), out
    assert lines[1:] == [
        "  sink main: commit",
        "    rows written (inserted or replaced): 2",
        "    rows removed (the range's, replaced by position): 1",
        "    keys falling back (older versions placed again): 0",
        "    records quarantined (new letters or live again): 0",
        "    dead letters resolved: 1",
    ], out

    (letter,) = [i for i, _, _ in letters]
    code, out, err = tm(
        env.cli_env(), "dlq", "redrive", "orders", str(letter), "--dry-run", "--json", cwd=env.tmp
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert report["dry_run"] is True and report["mode"] == "redrive"
    assert report["sinks"]["main"]["previewed"] is True
    assert (report["sinks"]["main"]["state"], report["sinks"]["main"]["error"]) == (
        "previewed",
        None,
    )
    assert (report["redrive"]["redriven"], report["redrive"]["failed_again"]) == (1, [])

    assert env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id") == rows
    assert env.ledger("SELECT id, status::text, attempts FROM tidemark.dlq") == letters


def test_a_dry_run_that_cannot_preview_says_so_in_one_line(env):
    env.pipeline(delivery="at_least_once")
    code, out, err = tm(
        env.cli_env(), "backfill", "orders", "--partition", "0", "--from", "0", "--to", "1",
        "--dry-run", cwd=env.tmp,
    )  # fmt: skip
    assert code == 2, out + err
    assert err.startswith("backfill of orders: partition 0 [0, 1)\n"), err
    assert_one_clear_line(
        err.split("\n", 1)[1], "dry run, nothing committed: orders", "needs delivery: exactly_once"
    )
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]


# Passwords a user writes raw (a ${VAR}, an AIRFLOW_CONN_<ID> set by hand): libpq cannot
# parse the first two as written and quotes what it could not read; the last two parse as a
# host or port no one meant. None of them may be read in anything the CLI prints or stores.
@pytest.mark.parametrize("raw", ["Ab%zzSecret9", "Ab Secret9", "Ab/Secret9", "Ab@Secret9"])
def test_a_raw_password_is_never_shown_nor_stored(env, raw):
    env.append_orders([1, 2, 3])
    port = env.sink_dsn.split("@", 1)[1].split("/", 1)[0]
    env.pipeline(sinks=[env.orders_sink(dsn="${TM_SINK_DSN}")])
    environ = env.cli_env(TM_SINK_DSN=f"postgresql://tidemark:{raw}@{port}/warehouse")
    seen = ""
    for args in (
        ["pipelines", "validate"],
        ["run", "orders"],
        ["status", "orders"],
        ["status", "orders", "--json"],
        ["recover"],
    ):
        code, out, err = tm(environ, *args)
        assert "Traceback" not in err, err
        seen += out + err
    assert "connection string does not parse" in seen, seen
    stored = env.ledger("SELECT coalesce(string_agg(error, ' '), '') FROM tidemark.run_sinks")
    for text in (seen, stored[0][0]):
        assert "Secret9" not in text and "Secret" not in text, text
