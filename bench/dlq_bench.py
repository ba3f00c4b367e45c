"""`make bench` (part 2): the Dead letters page's queries at 100,000+ dead letters.

Fills a scratch schema's copy of tidemark.dlq with N dead letters (3 pipelines, every error
class and status), then times what the page runs: the first page, a page deep in the list
(keyset cursor near the oldest rows), a filtered deep page, and the counts by class. Prints
milliseconds (median of --reps) and the deep/first ratio: keyset paging should keep it
near 1 however deep the page is.

With --export N: an export of N small letters plus --big letters of 10 MB, timed, with the
growth of this process's peak RSS: it should stay near the export's byte budget
(dlq.EXPORT_BYTES) plus one big letter however large N is.

``--redrive N`` instead times a redrive of N letters as a user runs it after a bad deploy:
N records in a source log, each quarantined as ``validation`` for one sink, then
``tidemark dlq redrive bench --class validation --all`` as a fresh process (Spark start-up
included), on scratch databases. Prints its wall time and the run's phases.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from tidemark.ledger import dlq, migrations


def _fill(conn: psycopg.Connection, n: int) -> None:
    conn.execute("TRUNCATE tidemark.dlq")
    conn.execute(
        """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
                                     key, payload, error_class, reason, status)
           SELECT 'p' || (i %% 3), CASE WHEN i %% 4 = 0 THEN 'archive' ELSE 'main' END, 1, i %% 8, i,
                  convert_to(i::text, 'UTF8'),
                  convert_to('{"id": ' || i || ', "amount": ' || (i * 1.25) || '}', 'UTF8'),
                  (ARRAY['decode','transform','validation','dq_gate','sink_write'])[1 + i %% 5]
                      ::tidemark.error_class,
                  'reason ' || i,
                  (ARRAY['quarantined','quarantined','redriven','discarded'])[1 + i %% 4]
                      ::tidemark.dlq_status
           FROM generate_series(1, %s) AS i""",
        (n,),
    )
    conn.execute("ANALYZE tidemark.dlq")


def _export(conn: psycopg.Connection, n: int, big: int) -> None:
    print(f"filling {n:,} small and {big} 10 MB dead letters ...", flush=True)
    _fill(conn, n)
    conn.execute(
        """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
                                     payload, error_class, reason, status)
           SELECT 'p0', 'big', 1, 0, i, convert_to(repeat(md5(i::text), 327680), 'UTF8'),
                  'decode', 'big', 'quarantined'
           FROM generate_series(1, %s) AS i""",
        (big,),
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t, lines, size = time.perf_counter(), 0, 0
    for line in dlq.export(conn, dlq.Filters.parse()):
        lines += 1
        size += len(line)
    secs = time.perf_counter() - t
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(
        f"export: {lines:,} letters, {size / 2**20:,.0f} MiB of JSON Lines in {secs:.1f}s "
        f"({lines / secs:,.0f} letters/s); peak RSS grew {grown:.0f} MiB "
        f"(budget {dlq.EXPORT_BYTES / 2**20:.0f} MiB + one 10 MB letter)"
    )


def _ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _scratch(dsn: str, name: str, fresh: bool = False) -> str:
    with psycopg.connect(dsn, autocommit=True) as c:
        if fresh:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            c.execute(f'CREATE DATABASE "{name}"')
    return dsn.rsplit("/", 1)[0] + "/" + name


def redrive(dsn: str, n: int) -> None:
    """A redrive of ``n`` validation letters by the CLI, timed from outside."""
    from tidemark.sources.postgres_log import append, create_log_table

    ledger = _scratch(dsn, "tidemark_redrive_bench", fresh=True)
    sink = _scratch(dsn, "tidemark_redrive_bench_sink", fresh=True)
    migrations.upgrade(ledger)
    with psycopg.connect(ledger, autocommit=True) as c:
        create_log_table(c, "src.log")
        append(
            c,
            "src.log",
            (
                (
                    i % 2,
                    str(i).encode(),
                    json.dumps(
                        {"id": i, "name": f"order-{i}", "amount": i * 1.25, "version": 1}
                    ).encode(),
                    '{"v": 1}',
                    None,
                )
                for i in range(n)
            ),
        )
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('bench')")
        c.execute("""INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset)
                     SELECT 'bench', 'main', "partition", max("offset") + 1 FROM src.log
                     GROUP BY 3""")
        # As a task writes letters (with the source headers and ts since ledger V007): else
        # the redrive would first read them from the source, and time that too.
        c.execute("""INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
                         source_offset, key, payload, headers, error_class, reason,
                         source_headers, source_ts, source_kept)
                     SELECT 'bench', 'main', 1, "partition", "offset", key, payload, headers,
                            'validation', 'amount: expect_column_values_to_be_between',
                            convert_to(headers::text, 'UTF8'), ts, true
                     FROM src.log""")
        c.execute("ANALYZE")
    folder = Path(tempfile.mkdtemp(prefix="tidemark-redrive-bench-"))
    (folder / "bench.yaml").write_text(
        json.dumps(
            {
                "name": "bench",
                "source": {"type": "postgres_log", "dsn": ledger, "table": "src.log"},
                "decode": {
                    "schema": {"id": "int", "name": "string", "amount": "double", "version": "int"}
                },
                "transform": {
                    "select": {
                        "id": "id",
                        "name": "name",
                        "amount": "amount",
                        "version": "version",
                    },
                    "required": ["id"],
                },
                "sinks": [{"name": "main", "dsn": sink, "table": "public.orders", "key": ["id"]}],
                "quality": {
                    "rows": [
                        {"expect_column_values_to_be_between": {"column": "amount", "min_value": 0}}
                    ]
                },
            }
        )
    )
    env = {
        **os.environ,
        "TIDEMARK_LEDGER_DSN": ledger,
        "TIDEMARK_PIPELINES_DIR": str(folder),
        "TIDEMARK_SPARK_MASTER": os.environ.get("TIDEMARK_SPARK_MASTER", "local[2,4]"),
    }
    argv = [
        sys.executable,
        "-m",
        "tidemark",
        "dlq",
        "redrive",
        "bench",
        "--class",
        "validation",
        "--all",
        "--yes",
        "--by",
        "bench",
        "--json",
    ]
    print(f"redriving {n:,} validation letters: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    rep = json.loads(out.stdout)
    with psycopg.connect(ledger, autocommit=True) as c:
        left = c.execute("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1").fetchall()
    with psycopg.connect(sink, autocommit=True) as c:
        rows = c.execute("SELECT count(*) FROM public.orders").fetchone()[0]
    print(
        f"wall {wall:.1f}s (process, Spark start-up included); run {rep['run_id']} "
        f"{rep['seconds']:.1f}s; redriven {rep['redrive']['redriven']:,}; sink rows "
        f"{rows:,}; letters {dict(left)}"
    )
    print("phases: " + ", ".join(f"{k} {v}" for k, v in rep["phases"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--export",
        type=int,
        default=0,
        metavar="N",
        help="instead: time an export of N letters (e.g. 1000000)",
    )
    ap.add_argument("--big", type=int, default=20, help="10 MB letters in the export")
    ap.add_argument(
        "--redrive", type=int, metavar="N", help="time a redrive of N letters by the CLI instead"
    )
    args = ap.parse_args()
    dsn = os.environ["TIDEMARK_LEDGER_DSN"]
    if args.redrive:
        redrive(dsn, args.redrive)
        return
    scratch = _scratch(dsn, "tidemark_dlq_bench")
    migrations.upgrade(scratch)
    with psycopg.connect(scratch, autocommit=True) as conn:
        if args.export:
            _export(conn, args.export, args.big)
            return
        print(f"filling {args.rows:,} dead letters ...", flush=True)
        _fill(conn, args.rows)
        oldest = conn.execute("SELECT min(id) FROM tidemark.dlq").fetchone()[0]
        deep = oldest + 200  # a cursor near the end of the list
        everything = dlq.Filters.parse()
        quarantined = dlq.Filters.parse(
            pipeline="p1", error_class="validation", status="quarantined"
        )
        rows = [
            ("first page, all statuses", lambda: dlq.page(conn, everything)),
            ("deep page, all statuses", lambda: dlq.page(conn, everything, before=deep)),
            ("first page, filtered", lambda: dlq.page(conn, quarantined)),
            ("deep page, filtered", lambda: dlq.page(conn, quarantined, before=deep)),
            ("counts by class, filtered", lambda: dlq.counts(conn, quarantined)),
            ("counts by pipeline", lambda: dlq.counts_by_pipeline(conn)),
        ]
        print(f"\n{'query':<28} {'ms (median of ' + str(args.reps) + ')':>22}")
        got = {}
        for name, fn in rows:
            got[name] = _ms(fn, args.reps)
            print(f"{name:<28} {got[name]:>22.2f}")
        ratio_all = got["deep page, all statuses"] / got["first page, all statuses"]
        ratio_filtered = got["deep page, filtered"] / got["first page, filtered"]
        print(f"\ndeep/first page ratio: all {ratio_all:.2f}, filtered {ratio_filtered:.2f}")


if __name__ == "__main__":
    main()
