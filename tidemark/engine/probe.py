"""Executor side of a backfill's probe: which records have their own row in a sink
(tidemark/driver/fallback.py). One connection per sink per Spark task, one query per
partition of each batch."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.core.db import qualified

SINK, PARTITION, OFFSET = "_tm_sink", "_tm_partition", "_tm_offset"
PROBE_SCHEMA = f"{SINK} string, {PARTITION} int, {OFFSET} bigint"
_ARROW = pa.schema([(SINK, pa.string()), (PARTITION, pa.int32()), (OFFSET, pa.int64())])


def own_rows(tables: dict[str, tuple[str, str]]):
    """mapInArrow over ``(_tm_sink, _tm_partition, _tm_offset)``: the rows whose record has
    its own row in that sink's table. ``tables``: sink -> (dsn, table)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import psycopg
        from psycopg import sql

        conns: dict[str, psycopg.Connection] = {}
        try:
            for b in batches:
                for sink in pc.unique(b.column(SINK)).to_pylist():
                    mine = b.filter(pc.equal(b.column(SINK), sink))
                    dsn, table = tables[sink]
                    if sink not in conns:
                        conns[sink] = psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                                                      application_name="tidemark-probe")
                    query = sql.SQL("SELECT _tm_offset FROM {} WHERE _tm_partition = %s "
                                    "AND _tm_offset = ANY(%s)").format(sql.SQL(qualified(table)))
                    for part in pc.unique(mine.column(PARTITION)).to_pylist():
                        offs = mine.filter(pc.equal(mine.column(PARTITION), part)) \
                            .column(OFFSET).to_pylist()
                        found = [o for (o,) in conns[sink].execute(query, (part, offs))]
                        if found:
                            yield pa.RecordBatch.from_pydict(
                                {SINK: [sink] * len(found), PARTITION: [part] * len(found),
                                 OFFSET: found}, schema=_ARROW)
        finally:
            for c in conns.values():
                c.close()

    return run
