"""The peer job of issue 37: what a competent data engineer writes in an afternoon instead of
Tidemark, to replay the flights log (dags/pipelines/flights.yaml) into PostgreSQL.

A plain PySpark job, nothing imported from tidemark: a small DataFrame of read tasks (each
source partition's offset range cut into sub-ranges of ``--task-records``, one Spark
partition each); each task reads its sub-range with ADBC's PostgreSQL driver (Arrow batches)
inside ``mapInArrow``; ``from_json`` decodes the payload into the fields the pipeline's select
needs; the pipeline's select, spelled out here; and each task's rows go out through
``mapInArrow``: pyarrow CSV, psycopg ``COPY`` into a table with the pipeline's key, one commit
per task. bench/replay_bench.py runs it as a fresh process next to a fresh ``tidemark run`` of
the same rows and checks that both tables hold the same rows.

    python bench/peer_job.py --source-dsn DSN --source-table bench.flights_log \\
        --sink-dsn DSN --sink-table bench.peer_2m --ranges 0:0:504857 1:0:504882 ...

Prints one JSON line: records, wall seconds of its steps, and task-seconds of the tasks'
phases (a few clock reads per batch, so that the bench can say where the time goes).

What it deliberately leaves out, all of which Tidemark does:

- Exactly once. Tasks commit on their own: a job failing half way leaves some sub-ranges
  committed, a task retried after its commit fails on the key, and nothing records what was
  delivered (the caller passes the offset ranges; no checkpoints, leases or run ledger).
- A dead-letter queue and row checks: ``from_json`` is permissive (a field that does not parse
  is NULL), and a record with a NULL key column fails its whole task at COPY.
- Upserts and versions: a key the table holds already fails the COPY (at-least-once into an
  empty table, as the bench runs it).
- The source's watermark: it reads the offsets it is given, without checking that their
  writers have committed or that offsets are dense.
- Schema evolution, a quality gate, metrics, and Tidemark's Spark tuning (its class archive,
  collector, Python worker daemon, codegen limit and Arrow batch size): Spark's defaults here,
  except what makes the comparison fair: the same master (2 cores) and driver memory (3g),
  loopback networking, and no UI.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

# The transform of dags/pipelines/flights.yaml, as an engineer would copy it into the job.
SELECT = {
    "flight_date": "make_date(year, month, day)",
    "carrier": "carrier",
    "flight": "flight",
    "origin": "origin",
    "copy": "copy",
    "dest": "dest",
    "tailnum": "tailnum",
    "sched_dep_time": "sched_dep_time",
    "dep_time": "dep_time",
    "dep_delay": "dep_delay",
    "sched_arr_time": "sched_arr_time",
    "arr_time": "arr_time",
    "arr_delay": "arr_delay",
    "air_time": "air_time",
    "distance": "distance",
    "scheduled_departure": "time_hour + make_interval(0, 0, 0, 0, 0, minute, 0)",
    "cancelled": "dep_time IS NULL",
    "avg_speed_mph": "cast(round(distance / (air_time / 60.0), 1) AS double)",
}
# The payload fields the select reads (not the log's `hour`).
FIELDS = (
    "year int, month int, day int, dep_time int, sched_dep_time int, dep_delay int, "
    "arr_time int, sched_arr_time int, arr_delay int, carrier string, flight int, "
    "tailnum string, origin string, dest string, air_time int, distance int, minute int, "
    "time_hour timestamp, copy int"
)
# The select's columns, then where each row came from (to trace a row back to its record).
COLUMNS = """flight_date date NOT NULL, carrier text NOT NULL, flight integer NOT NULL,
    origin text NOT NULL, copy integer NOT NULL, dest text, tailnum text,
    sched_dep_time integer, dep_time integer, dep_delay integer, sched_arr_time integer,
    arr_time integer, arr_delay integer, air_time integer, distance integer,
    scheduled_departure timestamptz, cancelled boolean, avg_speed_mph double precision,
    src_partition integer NOT NULL, src_offset bigint NOT NULL,
    PRIMARY KEY (flight_date, carrier, flight, origin, copy)"""
# --plain: every payload field as it is, no expressions (a pipeline the local engine runs too,
# bench/side_by_side.py), keyed as that pipeline is.
PLAIN_TYPES = {
    "year": "int", "month": "int", "day": "int", "dep_time": "int", "sched_dep_time": "int",
    "dep_delay": "int", "arr_time": "int", "sched_arr_time": "int", "arr_delay": "int",
    "carrier": "string", "flight": "int", "tailnum": "string", "origin": "string",
    "dest": "string", "air_time": "int", "distance": "int", "hour": "int", "minute": "int",
    "time_hour": "timestamp", "copy": "int",
}  # fmt: skip
PLAIN_KEY = ["year", "month", "day", "carrier", "flight", "origin", "copy"]
_PG = {"int": "integer", "string": "text", "timestamp": "timestamptz"}
PLAIN_COLUMNS = (
    ", ".join(
        f"{c} {_PG[t]}" + (" NOT NULL" if c in PLAIN_KEY else "") for c, t in PLAIN_TYPES.items()
    )
    + ", src_partition integer NOT NULL, src_offset bigint NOT NULL, "
    + f"PRIMARY KEY ({', '.join(PLAIN_KEY)})"
)
READ_SCHEMA = "src_partition int, src_offset bigint, payload binary"
PHASES = ("wait", "encode", "copy", "commit")  # of a write task; "read" is the reader's
STATS = "rows long, " + ", ".join(f"{p} double" for p in PHASES)


def quoted(name: str) -> str:
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


def sub_ranges(ranges: list[tuple[int, int, int]], size: int) -> list[tuple[int, int, int]]:
    """Each (partition, start, end) cut into equal pieces of at most ``size`` offsets."""
    out = []
    for p, s, e in ranges:
        step = -(-(e - s) // -(-(e - s) // size)) if e > s else 1
        out += [(p, a, min(a + step, e)) for a in range(s, e, step)]
    return out


def reader(source_dsn: str, table: str, tasks: list[tuple[int, int, int]], seconds):
    """Read task i: sub-range ``tasks[i]`` as ADBC's Arrow batches. ``seconds`` (an
    accumulator: the reader runs in a Python worker of its own) sums the time fetching."""
    query = (
        f'SELECT "partition" AS src_partition, "offset" AS src_offset, payload '
        f'FROM {quoted(table)} WHERE "partition" = {{}} AND "offset" >= {{}} AND "offset" < {{}}'
    )

    def read(ids):
        import adbc_driver_postgresql.dbapi as adbc

        spent = 0.0
        with adbc.connect(source_dsn, autocommit=True) as conn, conn.cursor() as cur:
            for batch in ids:
                for i in batch.column(0).to_pylist():
                    t = time.perf_counter()
                    cur.execute(query.format(*tasks[i]))
                    for b in cur.fetch_record_batch():
                        spent += time.perf_counter() - t
                        yield b
                        t = time.perf_counter()
        seconds.add(spent)

    return read


def writer(sink_dsn: str, table: str, columns: list[str]):
    """A write task: its rows as CSV into one COPY, one commit; yields its row count and
    task-seconds per phase ("wait": for Spark to hand it the next batch)."""
    copy_sql = f"COPY {quoted(table)} ({', '.join(columns)}) FROM STDIN (FORMAT csv)"

    def write(batches):
        import psycopg
        import pyarrow as pa
        import pyarrow.csv as pacsv

        rows, spent = 0, dict.fromkeys(PHASES, 0.0)
        options = pacsv.WriteOptions(include_header=False)
        with psycopg.connect(sink_dsn) as conn:
            with conn.cursor().copy(copy_sql) as cp:
                t = time.perf_counter()
                for b in batches:
                    t1 = time.perf_counter()
                    buf = io.BytesIO()
                    pacsv.write_csv(pa.Table.from_batches([b]), buf, options)
                    t2 = time.perf_counter()
                    cp.write(buf.getbuffer())
                    t3 = time.perf_counter()
                    spent["wait"] += t1 - t
                    spent["encode"] += t2 - t1
                    spent["copy"] += t3 - t2
                    rows += b.num_rows
                    t = t3
            t4 = time.perf_counter()  # the COPY's end waits for the server to take it all
            spent["copy"] += t4 - t
            conn.commit()
            spent["commit"] = time.perf_counter() - t4
        yield pa.RecordBatch.from_pylist([{"rows": rows, **spent}])

    return write


def parse_range(text: str) -> tuple[int, int, int]:
    p, a, e = (int(x) for x in text.split(":"))
    return p, a, e


def main() -> None:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--source-dsn", required=True)
    ap.add_argument("--source-table", required=True)
    ap.add_argument("--sink-dsn", required=True)
    ap.add_argument("--sink-table", required=True)
    ap.add_argument(
        "--ranges", nargs="+", type=parse_range, required=True, help="PARTITION:START:END ..."
    )
    ap.add_argument("--task-records", type=int, default=250_000, help="offsets per read task")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="3g")
    ap.add_argument(
        "--plain", action="store_true", help="every payload field as it is (no expressions)"
    )
    args = ap.parse_args()
    select = {c: c for c in PLAIN_TYPES} if args.plain else SELECT
    fields = ", ".join(f"{c} {t}" for c, t in PLAIN_TYPES.items()) if args.plain else FIELDS
    columns = PLAIN_COLUMNS if args.plain else COLUMNS

    import psycopg
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    with psycopg.connect(args.sink_dsn, autocommit=True) as c:
        if "." in args.sink_table:
            c.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted(args.sink_table.split('.')[0])}")
        c.execute(f"CREATE TABLE IF NOT EXISTS {quoted(args.sink_table)} ({columns})")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    t1 = time.perf_counter()
    spark = (
        SparkSession.builder.master(args.master)
        .appName("peer-job")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    t2 = time.perf_counter()

    tasks = sub_ranges(args.ranges, args.task_records)
    read_seconds = spark.sparkContext.accumulator(0.0)
    read = reader(args.source_dsn, args.source_table, tasks, read_seconds)
    raw = spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(read, READ_SCHEMA)
    decoded = raw.select(
        "src_partition",
        "src_offset",
        F.from_json(F.col("payload").cast("string"), fields).alias("r"),
    ).select("src_partition", "src_offset", "r.*")
    out = decoded.selectExpr(
        *(f"{expr} AS `{col}`" for col, expr in select.items()), "src_partition", "src_offset"
    )
    stats = out.mapInArrow(writer(args.sink_dsn, args.sink_table, out.columns), STATS).collect()
    t3 = time.perf_counter()
    spark.stop()
    print(
        json.dumps(
            {
                "records": sum(r["rows"] for r in stats),
                "tasks": len(tasks),
                "seconds": {
                    "start": round(t1 - t0, 3),
                    "session": round(t2 - t1, 3),
                    "job": round(t3 - t2, 3),
                    "stop": round(time.perf_counter() - t3, 3),
                },
                "task_seconds": {
                    "read": round(read_seconds.value, 3),
                    **{p: round(sum(r[p] for r in stats), 3) for p in PHASES},
                },
            }
        )
    )


if __name__ == "__main__":
    main()
