"""Sources: where records come from, read in parallel Spark tasks, one task per range.

Driver side, a source plans: which partitions exist, where each starts, and how far it is
safe to read. Executor side, it reads exactly one range into Arrow batches. Nothing but
offsets ever reaches the driver.

May import: protocol, ledger, config, quality, core.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from tidemark.config import FileArchiveSource, Pipeline, PostgresLogSource, Source
from tidemark.core.clock import Phases
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

from tidemark.sources.schema import BATCH_ROWS, LEFT_OUT, SCHEMA, SPARK_SCHEMA

# Wanted offsets closer than this are read again as one range (PayloadReader.records).
REFETCH_GAP = 4096


class Planner(Protocol):
    def partitions(self) -> list[int]: ...
    # The first settled offset (None: nothing settled yet, so nothing to start from).
    def earliest(self, partition: int) -> int | None: ...
    # The end of what is settled now, for ``start: latest`` (None: nothing settled yet).
    def latest(self, partition: int) -> int | None: ...
    def safe_end(self, partition: int, start: int, limit: int) -> int: ...
    # safe_end of every partition in ``starts`` (partition -> start), in as few passes over
    # the source as it can: a claim measures every partition at once.
    def safe_ends(self, starts: dict[int, int], limit: int) -> dict[int, int]: ...
    # When the record at ``offset`` was appended (None: no such record, or the source cannot
    # tell cheaply): the age of the oldest undelivered record (tidemark/driver/lag.py).
    def record_time(self, partition: int, offset: int) -> datetime | None: ...
    # The smallest [first, last + 1) of offsets below ``end`` holding every record of the
    # partition whose time is in [since, until) (None: no such record), both UTC instants
    # (driver/windows.py). Records out of time order inside it are re-delivered too:
    # offsets, not times, are what a range can say.
    def window(
        self, partition: int, since: datetime, until: datetime, end: int
    ) -> tuple[int, int] | None: ...
    # Where in [start, end) the source holds records now: sorted, disjoint [lo, hi) spans,
    # outside which no record can be read (retention, a deleted segment, a gap between
    # segments). Inside a span an offset may still hold no record (a compaction gap inside a
    # segment): a record can never appear there later without the reader failing loudly.
    def held(self, partition: int, start: int, end: int) -> list[tuple[int, int]]: ...
    def close(self) -> None: ...


def first_offset(pipeline: Pipeline, src: Planner, partition: int) -> int | None:
    """Where a sink with no checkpoint in ``partition`` begins (the pipeline's ``start``);
    None: not yet (nothing settled, or the source has not reached the start offset). An
    offset below the source's first record begins at that record: nothing below is held."""
    start = pipeline.start_at(partition)
    if start == "earliest":
        return src.earliest(partition)
    if start == "latest":
        return src.latest(partition)
    end = src.latest(partition)
    if end is None or end < start:
        return None
    first = src.earliest(partition)
    return start if first is None else max(start, first)


def planner(pipeline: Pipeline) -> Planner:
    src = pipeline.source
    if isinstance(src, PostgresLogSource):
        from tidemark.sources.postgres_log import PostgresLogPlanner

        return PostgresLogPlanner(src, pipeline.source_dsn())
    from tidemark.sources.file_archive import FileArchivePlanner

    return FileArchivePlanner(src)


class ReadJob(BaseModel):
    """What the driver hands the Spark reader: the source (its DSN resolved on the driver, so
    executors need no Airflow connection) and the ranges, one Spark partition each."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: Source
    ranges: list[tuple[int, int, int]]  # (partition, start, end)
    decoded: dict[str, str] | None = None  # JSON fields the reader decodes (json_arrow)
    trim: bool = False  # leave out what letters read again (LEFT_OUT; see payload_source)

    def spark_schema(self) -> str:
        if self.decoded is None:
            return SPARK_SCHEMA
        from tidemark.sources import json_arrow

        return f"{SPARK_SCHEMA}, {json_arrow.spark_columns(self.decoded)}"

    def batches(self, r: Range, phases: Phases | None = None, conn=None):
        """The records of ``r``; ``phases`` gets the reader's time: ``read`` (waiting for the
        source's next batch) and ``decode`` (Arrow's JSON parse). ``conn``: a postgres_log
        source's reader connection (postgres_log.connect_reader) to read over, else one of
        its own."""
        phases = phases or Phases()
        read = phases.waiting("read", read_range(self.source, r, meta=not self.trim, conn=conn))
        if self.decoded is None:
            yield from read
            return
        from tidemark.sources import json_arrow

        for batch in read:
            with phases("decode"):
                decoded = json_arrow.decode(batch, self.decoded, trim=self.trim)
            yield decoded


def reader_source(pipeline: Pipeline) -> PostgresLogSource | FileArchiveSource:
    """The pipeline's source as an executor reads it: a connection resolved to its DSN."""
    src = pipeline.source
    if isinstance(src, PostgresLogSource):
        return src.model_copy(update={"dsn": pipeline.source_dsn(), "conn_id": None})
    return src


def payload_source(pipeline: Pipeline) -> PostgresLogSource | FileArchiveSource | None:
    """Where a task reads again the source fields (LEFT_OUT) of a record it quarantines, or
    None if the batch carries them all.

    A record the reader decoded has its values in the batch: carrying its bytes, key, headers
    and time too, through Spark and on to the writer, cost about a tenth of a run (a fifth of
    the JVM's work), and only a dead letter needs them. So the reader leaves them out, unless
    something may read them: a Python transform, or a pipeline whose settings name one of
    them anywhere (an expression, an expectation) as Spark resolves names, in any case (a
    settings' text is searched lower-cased: ``_TM_TS``, `` `_Tm_Ts` ``), or take every column
    with a star (``struct(*)``, ``t.*``), or correct a window of record times (``_tm_ts``).
    A record that fails to decode keeps its bytes and key in the batch (Spark decodes it; a
    tombstone is told by its key), and a
    postgres_log reader reads no record's headers and time: the letters read them.
    """
    from tidemark.sources import json_arrow

    t = pipeline.transform
    # Lower-cased: Spark resolves column names case-insensitively (spark.sql.caseSensitive
    # is off by default; on, a name in another case would not resolve at all).
    named = pipeline.model_dump_json(exclude={"source", "decode"}).lower()
    if (
        json_arrow.fields(pipeline.decode.schema_) is None
        or t.python
        or any(c in named for c in LEFT_OUT)
        or any(c.since is not None for c in pipeline.corrections)  # a window by _tm_ts
        or any(_STAR.search(e) for e in (t.select or {}).values())
    ):
        return None
    return reader_source(pipeline)


# A star that stands for columns, not a product: first, or after "(", "," or "." (``*``,
# ``struct(*)``, ``f(a, *)``, ``t.*``). count(*) matches too, which only costs speed.
_STAR = re.compile(r"(?:^|[(,.])\s*\*")


class PayloadReader:
    """Executor side: the stored payloads of chosen records, read again from the source, so
    that their dead letters keep them byte for byte (see :func:`payload_source`). A task keeps
    one reader, and its one connection, for all its letters; close it at the end."""

    def __init__(self, source: PostgresLogSource | FileArchiveSource):
        self.source = source
        self.conn = None

    def _read(self, r: Range):
        if not isinstance(self.source, PostgresLogSource):
            return read_range(self.source, r)
        from tidemark.sources import postgres_log

        if self.conn is None:
            self.conn = postgres_log.connect_reader(self.source)
        return postgres_log.read_range(self.source, r, self.conn)

    def records(self, wanted: dict[int, list[int]]) -> dict[tuple[int, int], dict[str, Any]]:
        """``{(partition, offset): {column: value}}`` of ``wanted`` (partition -> offsets),
        the columns the reader leaves out (LEFT_OUT). Offsets close together are read as one
        range. A record the source no longer holds fails the task: its letter could not keep
        its bytes."""
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for part, offs in wanted.items():
            offs = sorted(set(offs))
            first = 0
            for i in range(1, len(offs) + 1):
                if i < len(offs) and offs[i] - offs[i - 1] <= REFETCH_GAP:
                    continue
                need = pa.array(offs[first:i], pa.int64())
                try:
                    for batch in self._read(Range(part, offs[first], offs[i - 1] + 1)):
                        hit = batch.filter(pc.is_in(batch.column("_tm_offset"), need))
                        for r in hit.select(["_tm_offset", *LEFT_OUT]).to_pylist():
                            out[(part, r.pop("_tm_offset"))] = r
                except TidemarkError as exc:
                    raise TidemarkError(
                        f"cannot read quarantined records' payloads again: {exc}"
                    ) from None
                first = i
        gone = sorted((p, o) for p, offs in wanted.items() for o in offs if (p, o) not in out)
        if gone:
            more = f" and {len(gone) - 1:,} more" if len(gone) > 1 else ""
            raise TidemarkError(
                f"source record {gone[0][0]}/{gone[0][1]}{more} is gone from "
                f"the source: its dead letter cannot keep its bytes"
            )
        return out

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> PayloadReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_together(offsets: list[int]) -> Iterator[list[int]]:
    """Sorted ``offsets`` in runs no more than REFETCH_GAP apart: each is read as one range."""
    first = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] - offsets[i - 1] > REFETCH_GAP:
            yield offsets[first:i]
            first = i


def headers_and_ts(
    pipeline: Pipeline, wanted: dict[int, list[int]]
) -> dict[tuple[int, int], tuple[str | None, datetime | None]]:
    """Driver side: ``{(partition, offset): (headers text, ts)}`` of the ``wanted`` records
    (partition -> offsets) the source still holds, as a delivery reads them. A position left
    out is one the source no longer holds (retention, compaction); a source that cannot be
    read raises. For dead letters from before V007, which kept neither."""
    src = reader_source(pipeline)
    if isinstance(src, PostgresLogSource):
        from tidemark.sources.postgres_log import headers_and_ts as by_offset

        return by_offset(src, wanted)
    out: dict[tuple[int, int], tuple[str | None, datetime | None]] = {}
    plan = planner(pipeline)
    try:
        for part, offs in wanted.items():
            first = plan.earliest(part)
            # below the archive's first segment: deleted by retention
            held = sorted(o for o in set(offs) if first is not None and o >= first)
            for group in _close_together(held):
                need = pa.array(group, pa.int64())
                for batch in read_range(src, Range(part, group[0], group[-1] + 1)):
                    hit = batch.filter(pc.is_in(batch.column("_tm_offset"), need))
                    for off, h, ts in zip(
                        *(
                            hit.column(c).to_pylist()
                            for c in ("_tm_offset", "_tm_headers", "_tm_ts")
                        ),
                        strict=True,
                    ):
                        out[(part, off)] = (h, ts)
    finally:
        plan.close()
    return out


def read_range(
    source: PostgresLogSource | FileArchiveSource, r: Range, *, meta: bool = True, conn=None
) -> Iterator[pa.RecordBatch]:
    """The records of ``r``; without ``meta``, a source that can (postgres_log) leaves their
    headers and time NULL, for a reader whose letters read them again (payload_source).
    ``conn``: a postgres_log reader connection to read over (else one of its own)."""
    if isinstance(source, PostgresLogSource):
        from tidemark.sources import postgres_log

        yield from postgres_log.read_range(source, r, conn, meta=meta)
    else:
        from tidemark.sources import file_archive

        yield from file_archive.read_range(source, r)


class RangeReader:
    """Executor side of :func:`dataframe`: reads the ranges whose indexes arrive as its input
    (one per Spark partition). A class, so Spark ships it by name and the job as JSON."""

    def __init__(self, job: ReadJob, clock=None):
        self.job = job.model_dump_json()
        self.clock = clock  # read_clock.clock's accumulator: the reader's phases, summed

    def __call__(self, indexes):
        job = ReadJob.model_validate_json(self.job)
        phases = Phases()
        try:
            for batch in indexes:
                for i in batch.column(0).to_pylist():
                    yield from job.batches(Range(*job.ranges[i]), phases)
        finally:
            if self.clock is not None:
                self.clock.add(phases.seconds)


def read_job(pipeline: Pipeline, ranges: list[Range]) -> ReadJob:
    """The reading of ``ranges``: with the payloads' JSON fields already decoded where Arrow
    can (json_arrow), and those records' payloads left out where :func:`payload_source`
    allows. Spark's reader (:func:`dataframe`) and the local runner's read it alike."""
    from tidemark.sources import json_arrow

    return ReadJob(
        source=reader_source(pipeline),
        ranges=[(r.partition, r.start, r.end) for r in ranges],
        decoded=json_arrow.fields(pipeline.decode.schema_),
        trim=payload_source(pipeline) is not None,
    )


def dataframe(spark: SparkSession, pipeline: Pipeline, ranges: list[Range]) -> DataFrame:
    """The source records of ``ranges`` as a DataFrame, one Spark partition per range; with
    the payloads' JSON fields already decoded where Arrow can (json_arrow), and those
    records' payloads left out where :func:`payload_source` allows."""
    job = read_job(pipeline, ranges)
    # Partition i of the range holds the one index i, so Spark partition i reads range i.
    # Spark's Python data source API would plan the same partitions in a Python process of
    # its own, started afresh by every run: about 3 s of a run's fixed cost (bench).
    from tidemark.sources import read_clock

    n = len(job.ranges)
    # A Spark Connect session has no SparkContext, so no accumulator: no reader's clock.
    connect = type(spark).__module__.startswith("pyspark.sql.connect")
    reader = RangeReader(job, None if connect else read_clock.clock(spark.sparkContext))
    return spark.range(0, n, 1, max(n, 1)).mapInArrow(reader, job.spark_schema())


__all__ = [
    "BATCH_ROWS",
    "LEFT_OUT",
    "SCHEMA",
    "SPARK_SCHEMA",
    "FileArchiveSource",
    "PostgresLogSource",
    "ReadJob",
    "PayloadReader",
    "RangeReader",
    "dataframe",
    "headers_and_ts",
    "payload_source",
    "planner",
    "read_job",
    "read_range",
]
