"""The peer job (bench/peer_job.py) beside Tidemark's fresh runs, for bench/replay_bench.py:
run it as users would, a fresh process timed by the wall clock; check that it wrote exactly
the rows Tidemark wrote (a comparison of different outputs would be worthless); and read
those rows back as CSV, the raw COPY ceiling's input."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import cpu_split
import psycopg

PEER_JOB = Path(__file__).with_name("peer_job.py")
KEY = ["flight_date", "carrier", "flight", "origin", "copy"]
VALUES = [
    "dest",
    "tailnum",
    "sched_dep_time",
    "dep_time",
    "dep_delay",
    "sched_arr_time",
    "arr_time",
    "arr_delay",
    "air_time",
    "distance",
    "scheduled_departure",
    "cancelled",
    "avg_speed_mph",
]
SAMPLE = 101  # the rows compared one by one: every record whose offset is a multiple of it


def run(
    source_dsn: str,
    source_table: str,
    sink_dsn: str,
    sink_table: str,
    ranges: list[tuple[int, int, int]],
    env: dict[str, str],
    databases: dict[str, str],
    extra: tuple[str, ...] = (),
) -> dict:
    """One run of the peer job in a fresh process: its wall time, its own report and where
    its CPU went (cpu_split; ``databases`` says what each database is)."""
    cmd = [
        sys.executable,
        str(PEER_JOB),
        "--source-dsn",
        source_dsn,
        "--source-table",
        source_table,
        "--sink-dsn",
        sink_dsn,
        "--sink-table",
        sink_table,
        "--ranges",
        *(f"{p}:{a}:{e}" for p, a, e in ranges),
        *extra,
    ]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu = cpu_split.CpuSplit(proc.pid, databases)
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    split = cpu.stop()
    if proc.returncode != 0:
        tail = "\n".join(err.strip().splitlines()[-15:])
        raise SystemExit(f"peer job into {sink_table} failed (exit {proc.returncode}):\n{tail}")
    return {"wall": wall, "cpu": split, **json.loads(out.strip().splitlines()[-1])}


def _fingerprint(partition: str, offset: str) -> dict[str, str]:
    """Aggregates over a whole table, by name, equal for two tables holding the same rows;
    the last binds each row's key to the source record it came from."""
    return {
        "rows": "count(*)",
        "distance": "sum(distance::bigint)",
        "dep_delay": "sum(dep_delay::bigint)",
        "arr_delay": "sum(arr_delay::bigint)",
        "avg_speed_mph": "sum(avg_speed_mph::numeric)",
        "cancelled": "count(*) FILTER (WHERE cancelled)",
        "tailnum": "count(tailnum)",
        "texts": "sum(hashtext(concat_ws('/', carrier, origin, dest, tailnum))::bigint)",
        "times": "sum(extract(epoch FROM scheduled_departure)::bigint)",
        "others": "sum(hashtext(concat_ws('/', sched_dep_time, dep_time, sched_arr_time, "
        "arr_time, air_time))::bigint)",
        "key_at_record": f"sum(hashtext(concat_ws('/', {partition}, {offset}, flight_date, "
        f"carrier, flight, origin, copy))::bigint)",
    }


def verify(sink_dsn: str, tidemark_table: str, peer_table: str, expected: int) -> int:
    """Fails loudly unless both tables hold ``expected`` rows, the same whole-table aggregates,
    and, row by row for a sample, the same values from the same source record. Returns how
    many rows it compared one by one."""
    bad = (
        "p.src_offset IS NULL OR t._tm_partition <> p.src_partition OR "
        "t._tm_offset <> p.src_offset OR "
        + " OR ".join(f"t.{c} IS DISTINCT FROM p.{c}" for c in VALUES)
    )
    with psycopg.connect(sink_dsn) as c:
        tm, peer = (
            c.execute(
                "SELECT " + ", ".join(_fingerprint(*where).values()) + f" FROM {table}"
            ).fetchone()
            or ()
            for table, where in (
                (tidemark_table, ("_tm_partition", "_tm_offset")),
                (peer_table, ("src_partition", "src_offset")),
            )
        )
        if not tm[0] == peer[0] == expected:
            raise SystemExit(
                f"bench: {tidemark_table} has {tm[0]:,} rows, {peer_table} {peer[0]:,}, "
                f"expected {expected:,}: the runs did not write the same records"
            )
        differ = [k for k, a, b in zip(_fingerprint("", ""), tm, peer, strict=True) if a != b]
        if differ:
            raise SystemExit(
                f"bench: {tidemark_table} and {peer_table} hold different rows (their "
                f"whole-table aggregates differ: {', '.join(differ)})"
            )
        sampled, wrong, example = c.execute(
            f"""SELECT count(*), count(*) FILTER (WHERE {bad}),
                min(t._tm_partition || '/' || t._tm_offset) FILTER (WHERE {bad})
            FROM {tidemark_table} t LEFT JOIN {peer_table} p USING ({", ".join(KEY)})
            WHERE t._tm_offset % {SAMPLE} = 0"""
        ).fetchone() or (0, 0, None)
    if not sampled or wrong:
        raise SystemExit(
            f"bench: of {sampled:,} sampled rows of {tidemark_table}, {wrong:,} differ in "
            f"{peer_table} or are missing there (first: record {example})"
        )
    return int(sampled)


def table_csv(sink_dsn: str, table: str, chunk: int = 4 << 20) -> tuple[list, list[str]]:
    """Every row of ``table`` as COPY csv in chunks of whole lines (about ``chunk`` bytes
    each, with their row counts), and its columns: what raw_copy takes. Untimed."""
    chunks: list[tuple[bytes, int]] = []
    with psycopg.connect(sink_dsn) as c:
        cur = c.execute(f"SELECT * FROM {table} LIMIT 0")
        columns = [d.name for d in cur.description or []]
        buf = bytearray()
        with c.cursor().copy(f"COPY {table} TO STDOUT (FORMAT csv)") as cp:
            for data in cp:
                buf += data
                if len(buf) >= chunk:
                    cut = buf.rindex(b"\n") + 1
                    chunks.append((bytes(buf[:cut]), buf.count(b"\n", 0, cut)))
                    del buf[:cut]
        if buf:
            chunks.append((bytes(buf), buf.count(b"\n")))
    return chunks, columns


def prewarm(source_dsn: str, table: str) -> None:
    """Reads the whole source table once, untimed, so that the first of two runs does not
    pay for reading it from disk and the second not."""
    with psycopg.connect(source_dsn) as c:
        c.execute(f"SELECT sum(length(payload)) FROM {table}").fetchone()
