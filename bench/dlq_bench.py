"""`make bench` (part 2): the Dead letters page's queries at 100,000+ dead letters.

Fills a scratch schema's copy of tidemark.dlq with N dead letters (3 pipelines, every error
class and status), then times what the page runs: the first page, a page deep in the list
(keyset cursor near the oldest rows), a filtered deep page, and the counts by class. Prints
milliseconds (median of --reps) and the deep/first ratio: keyset paging should keep it
near 1 however deep the page is.

With --export N: an export of N small letters plus --big letters of 10 MB, timed, with the
growth of this process's peak RSS: it should stay near the export's byte budget
(dlq.EXPORT_BYTES) plus one big letter however large N is.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

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
           FROM generate_series(1, %s) AS i""", (n,))
    conn.execute("ANALYZE tidemark.dlq")


def _export(conn: psycopg.Connection, n: int, big: int) -> None:
    print(f"filling {n:,} small and {big} 10 MB dead letters ...", flush=True)
    _fill(conn, n)
    conn.execute(
        """INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset,
                                     payload, error_class, reason, status)
           SELECT 'p0', 'big', 1, 0, i, convert_to(repeat(md5(i::text), 327680), 'UTF8'),
                  'decode', 'big', 'quarantined'
           FROM generate_series(1, %s) AS i""", (big,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t, lines, size = time.perf_counter(), 0, 0
    for line in dlq.export(conn, dlq.Filters.parse()):
        lines += 1
        size += len(line)
    secs = time.perf_counter() - t
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"export: {lines:,} letters, {size / 2**20:,.0f} MiB of JSON Lines in {secs:.1f}s "
          f"({lines / secs:,.0f} letters/s); peak RSS grew {grown:.0f} MiB "
          f"(budget {dlq.EXPORT_BYTES / 2**20:.0f} MiB + one 10 MB letter)")


def _ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--export", type=int, default=0, metavar="N",
                    help="instead: time an export of N letters (e.g. 1000000)")
    ap.add_argument("--big", type=int, default=20, help="10 MB letters in the export")
    args = ap.parse_args()
    dsn = os.environ["TIDEMARK_LEDGER_DSN"]
    scratch = dsn.rsplit("/", 1)[0] + "/tidemark_dlq_bench"
    with psycopg.connect(dsn, autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = 'tidemark_dlq_bench'"
                         ).fetchone():
            c.execute("CREATE DATABASE tidemark_dlq_bench")
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
        quarantined = dlq.Filters.parse(pipeline="p1", error_class="validation",
                                        status="quarantined")
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
