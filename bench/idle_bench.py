"""`make bench`: what a scheduled run costs when there is nothing new (issue 15).

On a scratch database of the local server: a 2-partition log of 1,000 records and a pipeline
with row and batch expectations (Great Expectations), committed once by a first `tidemark run`.
Then, with nothing new:

1. ``tidemark run`` as users run it, a fresh process each time: wall time (it settles recovery
   and asks the plan before it would load Great Expectations or start Spark);
2. unless ``--no-dag``: a local Airflow (the devstack's, own metadata database, free port)
   with the pipeline's DAG, triggered ``--runs`` times: each DAG run's wall time, start to end
   (its first task finds nothing new and skips the Spark task).

Prints the times; the machine is shared and noisy, so it prints the median, min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psycopg
import yaml
from psycopg.conninfo import make_conninfo

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dotenv import load_dotenv  # noqa: E402

from tidemark.devstack.airflow_stack import Stack, free_port  # noqa: E402
from tidemark.ledger import migrations  # noqa: E402
from tidemark.sources.postgres_log import append, create_log_table  # noqa: E402

DB = "bench_idle"
RECORDS = 1000


def _db_dsn(server_dsn: str, db: str) -> str:
    return make_conninfo(server_dsn, dbname=db)


def setup(server_dsn: str, folder: Path) -> str:
    with psycopg.connect(server_dsn, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{DB}"')
    dsn = _db_dsn(server_dsn, DB)
    migrations.upgrade(dsn)
    with psycopg.connect(dsn) as c:
        create_log_table(c, "src.log")
        append(
            c,
            "src.log",
            [
                (
                    i % 2,
                    str(i).encode(),
                    json.dumps({"id": i, "name": f"order-{i}", "amount": i * 1.25}).encode(),
                    "{}",
                    None,
                )
                for i in range(RECORDS)
            ],
        )
    (folder / "idle.yaml").write_text(
        yaml.safe_dump(
            {
                "source": {"type": "postgres_log", "dsn": dsn, "table": "src.log"},
                "decode": {"schema": {"id": "int", "name": "string", "amount": "double"}},
                "sinks": [{"name": "main", "dsn": dsn, "table": "public.orders", "key": ["id"]}],
                "quality": {
                    "rows": [
                        {"expect_column_values_to_be_between": {"column": "amount", "min_value": 0}}
                    ],
                    "batch": [
                        {
                            "expect_table_row_count_to_be_between": {
                                "min_value": 1,
                                "max_value": 10 * RECORDS,
                            }
                        }
                    ],
                },
                "airflow": {"retries": 0, "driver_memory": "1g"},
            },
            sort_keys=False,
        )
    )
    return dsn


def cli_run(dsn: str, folder: Path) -> tuple[float, str]:
    env = {
        **os.environ,
        "TIDEMARK_LEDGER_DSN": dsn,
        "TIDEMARK_PIPELINES_DIR": str(folder),
        "TIDEMARK_SPARK_MASTER": "local[2]",
    }
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "tidemark", "run", "idle"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.monotonic() - t0
    if res.returncode != 0:
        sys.exit(f"tidemark run failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    return took, res.stdout.strip().splitlines()[-1]


def _stats(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):.2f} s, min {min(values):.2f} s, "
        f"max {max(values):.2f} s ({len(values)} runs)"
    )


def dag_runs(dsn: str, server_dsn: str, tmp: Path, folder: Path, runs: int) -> list[float]:
    dags = tmp / "dags"
    dags.mkdir()
    shutil.move(folder, dags / "pipelines")
    shutil.copy(REPO / "dags" / "tidemark_pipelines.py", dags)
    stack = Stack(
        home=tmp / "airflow",
        ledger_dsn=dsn,
        port=free_port(),
        dags_folder=dags,
        metadata_db="airflow_bench_idle",
        env_extra={"TIDEMARK_PIPELINES_DIR": str(dags / "pipelines")},
    )
    walls = []
    try:
        stack.start()
        stack.unpause("tidemark_idle")
        with stack.api() as api:
            for _ in range(runs):
                r = api.post("/dags/tidemark_idle/dagRuns", json={"logical_date": None})
                r.raise_for_status()
                run_id = r.json()["dag_run_id"]
                while True:
                    dr = api.get(f"/dags/tidemark_idle/dagRuns/{run_id}").json()
                    if dr["state"] in ("success", "failed"):
                        break
                    time.sleep(0.5)  # polling the REST API: Airflow offers no finished event
                tis = {
                    t["task_id"]: t["state"]
                    for t in api.get(f"/dags/tidemark_idle/dagRuns/{run_id}/taskInstances").json()[
                        "task_instances"
                    ]
                }
                if dr["state"] != "success" or tis.get("replay") != "skipped":
                    log = api.get(
                        f"/dags/tidemark_idle/dagRuns/{run_id}/taskInstances/recover/logs/1",
                        headers={"Accept": "application/json"},
                    )
                    sys.exit(
                        f"idle DAG run {run_id}: {dr['state']}, tasks {tis}; recover "
                        f"said: {log.text[-3000:]}"
                    )
                walls.append(
                    (
                        datetime.fromisoformat(dr["end_date"])
                        - datetime.fromisoformat(dr["start_date"])
                    ).total_seconds()
                )
    finally:
        stack.stop()
        with psycopg.connect(server_dsn, autocommit=True) as c:
            c.execute('DROP DATABASE IF EXISTS "airflow_bench_idle" WITH (FORCE)')
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="idle runs of each kind")
    ap.add_argument("--no-dag", action="store_true", help="skip the Airflow DAG runs")
    args = ap.parse_args()
    load_dotenv(REPO / ".tidemark" / "env", override=False)
    server = os.environ.get("TIDEMARK_LEDGER_DSN")
    if not server:
        sys.exit("set TIDEMARK_LEDGER_DSN (make pg writes it to .tidemark/env)")
    tmp = Path(tempfile.mkdtemp(prefix="tidemark-idle-bench-"))
    folder = tmp / "pipelines"
    folder.mkdir()
    try:
        dsn = setup(server, folder)
        took, line = cli_run(dsn, folder)
        print(f"first run, {RECORDS:,} records (Spark, Great Expectations): {took:.1f} s")
        walls = []
        for _ in range(args.runs):
            took, line = cli_run(dsn, folder)
            assert "up to date" in line, line
            walls.append(took)
        print(f"idle `tidemark run` (fresh process): {_stats(walls)}")
        if not args.no_dag:
            walls = dag_runs(dsn, server, tmp, folder, args.runs)
            print(f"idle DAG run (start to end, replay skipped): {_stats(walls)}")
    finally:
        with psycopg.connect(server, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
