"""``file_archive``: segments archived from Kafka, in a directory or on a Hadoop-compatible store.

The contract writers follow:

* ``uri`` is anything :func:`pyarrow.fs.FileSystem.from_uri` accepts: a local path (made
  absolute against the working directory of each process, so give an absolute one), ``file://``,
  ``s3://``, ``gs://``, ``hdfs://``.
* Layout: ``<uri>/partition=<P>/<base offset, zero-padded to 20 digits>.<ext>``, ``ext`` being
  ``parquet`` or ``jsonl``; ``P`` is written in decimal without leading zeros. A segment is
  named after the offset of its first record, like Kafka's own segments, and holds at least
  one record. Each segment is read by its extension: a folder may mix the two formats. The
  source's ``format`` field is accepted for compatibility and changes nothing.
* Segments are immutable once present: write to a temporary name in the same folder (e.g.
  ``.<name>.tmp``) and rename (tidemark/devstack/archive_writer.py does). Segment *i* holds
  offsets ``[base_i, base_{i+1})``; the last one ends at its highest offset + 1. New segments
  must start above that end, and old ones may only be deleted once every checkpoint is past
  them. A segment that breaks this (one that appears inside a gap a run already stepped over)
  is reported by ``tidemark status``/``recover`` with the backfill that places it
  (tidemark/driver/late.py); a deleted one makes re-deliveries over it refuse without
  ``--accept-pruned`` (tidemark/protocol/pruned.py). One base offset, one segment (not a ``.parquet`` and a ``.jsonl`` both).
* Other files in a partition folder: hidden names (a leading ``.`` or ``_``: temporary files,
  ``.crc`` checksums, ``_SUCCESS``), names ending in ``.tmp``, ``.crc`` or ``._COPYING_``, and
  names that look like no segment (``README``) are ignored. A name that looks like one (it
  starts with a digit, or has a ``.parquet``/``.jsonl`` extension) but is not one
  (``<base>.avro``, ``<base>.json``, ``<base>.parquet.gz``, an unpadded base, a folder named
  like a segment) is an error naming it, as is a ``partition=`` folder whose value is not a
  partition number: skipping it would make its records look like a compaction gap.
* Each record has ``partition`` (int, equal to its folder's), ``offset`` (int64), ``key`` (bytes
  or null), ``payload`` (bytes, null for a tombstone), ``headers`` (a JSON object or null) and
  ``ts`` (a timestamp; naive means UTC). In parquet ``headers`` is a string column holding the
  JSON text. In JSON Lines, one object a line, ``key`` and ``payload`` are base64 strings (so
  bytes survive exactly), ``headers`` an object and ``ts`` ISO-8601 text or epoch milliseconds.
* Records are in strictly increasing offset order within a segment. Offsets may have gaps
  (compacted topics): an absent offset is not a record.

An offset no segment holds is a gap; anything the source cannot read is an error. Listing a
partition checks every name in it; a segment is checked when a range reads it (and the last
one whenever the archive's end is planned): a corrupt, empty or truncated file, a first
record that is not the base offset, a bad line, a record out of order or in the wrong folder
raise :class:`TidemarkError` naming the file, so the run stops rather than skip records.
A parquet file carries its footer, so any cut is caught; a JSON Lines file cut inside a line
is caught, but one cut exactly at a line's end cannot be told from a shorter segment.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tidemark.config import FileArchiveSource
from tidemark.core.dsn import mask
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range

FORMATS = ("parquet", "jsonl")
COLUMNS = ("partition", "offset", "key", "payload", "headers", "ts")
_SEGMENT = re.compile(r"^(\d{20})\.(parquet|jsonl)$")
# What a writer may have meant as a segment: a name that starts with a digit (a base offset)
# or has a segment format's extension. Such a name that is not a segment's stops the run.
_SEGMENT_LIKE = re.compile(r"^\d|\.(parquet|jsonl)(\.|$)", re.IGNORECASE)
_BASE_AND_EXT = re.compile(r"^(\d+)(.*)$")
# Never records: hidden names (a writer's .<name>.tmp-…, Hadoop's .<name>.crc), markers
# (_SUCCESS, _temporary) and files still being copied in.
_HIDDEN = (".", "_")
_SCRATCH = (".crc", ".tmp", "._COPYING_")
_PART_PREFIX = "partition="
_SECRET_PARAM = re.compile(
    r"((?:secret|token|password|key|signature|sig)[a-z_]*=)[^&\s]*", re.IGNORECASE
)
_TAIL_CHUNK = 64 * 1024  # bytes read from the end of a JSON Lines segment per step
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
IO_ERRORS = (OSError, pa.ArrowException)  # what a filesystem or Arrow raises on I/O


# --- locations ---------------------------------------------------------------------------------


def _hide(text: str) -> str:
    """``text`` with passwords (user:pw@) and secret query parameters masked."""
    return _SECRET_PARAM.sub(lambda m: f"{m[1]}***", mask(text))


class Archive:
    """A filesystem, the archive's root path in it, and how to name things in messages."""

    def __init__(self, uri: str):
        self.shown = _hide(uri.split("?", 1)[0]).rstrip("/") or "/"
        try:
            if "://" in uri:
                self.fs, root = pafs.FileSystem.from_uri(uri)
            else:
                self.fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        except (*IO_ERRORS, ValueError) as exc:
            raise TidemarkError(
                f"file archive {self.shown}: cannot open: {first_line(exc)}"
            ) from None
        self.root = root.rstrip("/")

    def part_dir(self, partition: int) -> str:
        return f"{self.root}/{_PART_PREFIX}{partition}"

    def show(self, path: str) -> str:
        """``path`` (inside the filesystem) as the user would spell it, from the uri."""
        rel = path[len(self.root) :] if path.startswith(self.root) else "/" + path
        return self.shown.rstrip("/") + rel

    def listdir(self, path: str, what: str) -> list[pafs.FileInfo] | None:
        """Entries of folder ``path``, or None when it does not exist."""
        try:
            info = self.fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                return None
            if info.type != pafs.FileType.Directory:
                raise TidemarkError(f"file archive {self.show(path)}: {what} is not a directory")
            return self.fs.get_file_info(pafs.FileSelector(path, recursive=False))
        except IO_ERRORS as exc:
            raise TidemarkError(
                f"file archive {self.show(path)}: cannot list {what}: {first_line(exc)}"
            ) from None

    def segments(self, partition: int) -> list[Segment]:
        """The partition's segments, of every format, by base (empty if no folder).

        The planner and the reader both list through here, so they agree on the segments. A
        name that looks like a segment but is not one (unknown extension, base offset not 20
        digits, a folder) raises, and so do two segments with one base: skipping them would
        make their records look like a compaction gap.
        """
        entries = self.listdir(self.part_dir(partition), f"partition {partition}") or []
        out: dict[int, Segment] = {}
        for e in entries:
            seg = self._segment(e)
            if seg is None:
                continue
            if seg.base in out:
                raise TidemarkError(
                    f"file archive {self.show(seg.path)}: base offset "
                    f"{seg.base} is also {out[seg.base].path.rsplit('/', 1)[-1]}"
                    f"'s: keep one segment per base offset"
                )
            out[seg.base] = seg
        return [out[b] for b in sorted(out)]

    def _segment(self, e: pafs.FileInfo) -> Segment | None:
        """The segment ``e`` is, or None for a file that is none (README, _SUCCESS, a
        temporary file); raises for a name that looks like a segment but is not one."""
        name = e.base_name
        if name.startswith(_HIDDEN) or name.endswith(_SCRATCH):
            return None
        m = _SEGMENT.match(name)
        if m is None and not _SEGMENT_LIKE.search(name):
            return None
        if m is None:
            raise TidemarkError(
                f"file archive {self.show(e.path)}: {_not_a_segment(name)} "
                f"(rename it, or hide it behind a leading '.' or '_')"
            )
        if e.type != pafs.FileType.File:
            raise TidemarkError(
                f"file archive {self.show(e.path)}: named like a segment but not a file"
            )
        return Segment(int(m[1]), e.path, m[2])


class Segment(NamedTuple):
    base: int  # the offset of its first record, from its name
    path: str
    fmt: str  # its extension: parquet or jsonl


def _not_a_segment(name: str) -> str:
    m = _BASE_AND_EXT.match(name)
    if m and len(m[1]) == 20:
        ext = m[2] or "none"
        return (
            f"unknown segment format (extension {ext!r}): a segment is "
            f"<base offset>.parquet or <base offset>.jsonl"
        )
    return (
        "not a segment name: a segment is <base offset, zero-padded to 20 digits>.parquet or .jsonl"
    )


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, secrets masked: for an error naming a file."""
    text = str(exc).strip().splitlines()
    return _hide(text[0]) if text else type(exc).__name__


# --- planner -----------------------------------------------------------------------------------


class FileArchivePlanner:
    """Driver side: lists the archive once per instance and reads only footers / tails."""

    def __init__(self, src: FileArchiveSource):
        self.src = src
        self.archive = Archive(src.uri)
        self._parts: list[int] | None = None
        self._segments: dict[int, list[Segment]] = {}
        self._ends: dict[int, int] = {}

    def close(self) -> None:
        self._parts = None
        self._segments.clear()
        self._ends.clear()

    def partitions(self) -> list[int]:
        if self._parts is None:
            a = self.archive
            entries = a.listdir(a.root, "archive folder")
            if entries is None:
                raise TidemarkError(f"file archive {a.shown}: does not exist")
            parts: dict[int, str] = {}
            for e in entries:
                if e.type != pafs.FileType.Directory or not e.base_name.startswith(_PART_PREFIX):
                    continue
                value = e.base_name[len(_PART_PREFIX) :]
                if not value.isascii() or not value.isdigit() or str(int(value)) != value:
                    raise TidemarkError(
                        f"file archive {a.show(e.path)}: folder name must be "
                        f"partition=<non-negative integer without leading "
                        f"zeros>, not {e.base_name!r}"
                    )
                parts[int(value)] = e.path
            self._parts = sorted(parts)
        return list(self._parts)

    def _segs(self, partition: int) -> list[Segment]:
        if partition not in self._segments:
            self._segments[partition] = self.archive.segments(partition)
        return self._segments[partition]

    def earliest(self, partition: int) -> int | None:
        segs = self._segs(partition)
        return segs[0].base if segs else None

    def latest(self, partition: int) -> int | None:
        return self.end(partition) if self._segs(partition) else None

    def window(
        self, partition: int, since: datetime, until: datetime, end: int
    ) -> tuple[int, int] | None:
        """Reads the records' times from the partition's first offset to ``end``: an archive
        has no index by time."""
        first = self.earliest(partition)
        if first is None or first >= end:
            return None
        lo = hi = None
        for b in read_range(self.src, Range(partition, first, end)):
            ts, off = b.column("_tm_ts"), b.column("_tm_offset")
            inside = pc.and_(pc.greater_equal(ts, since), pc.less(ts, until))
            picked = pc.filter(off, inside)
            if len(picked):
                lo = pc.min(picked).as_py() if lo is None else lo
                hi = pc.max(picked).as_py()
        return None if lo is None or hi is None else (lo, hi + 1)

    def held(self, partition: int, start: int, end: int) -> list[tuple[int, int]]:
        """Each segment meeting [start, end) holds [base, its highest offset + 1): reads the
        footer or tail of those segments only. What lies between one segment's end and the
        next one's base is a gap: a segment deleted since, or offsets no segment ever held
        (where a late segment may yet appear, docs/design.md, invariant 2)."""
        segs = self._segs(partition)
        out: list[tuple[int, int]] = []
        for i, seg in enumerate(segs):
            nxt = segs[i + 1].base if i + 1 < len(segs) else None
            if seg.base >= end or (nxt is not None and nxt <= start):
                continue
            lo, hi = max(seg.base, start), min(_segment_end(self.archive, seg), end)
            if lo >= hi:
                continue
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        return out

    def record_time(self, partition: int, offset: int) -> None:
        return None  # it would mean reading a segment: the lag alert uses the record count

    def end(self, partition: int) -> int:
        """Exclusive end of the archive's partition (0 when it has no segment)."""
        if partition not in self._ends:
            segs = self._segs(partition)
            self._ends[partition] = _segment_end(self.archive, segs[-1]) if segs else 0
        return self._ends[partition]

    def safe_end(self, partition: int, start: int, limit: int) -> int:
        """Every segment present is complete, so: min(start + limit, end of the archive).

        A ``start`` below the first segment means the records from there were deleted from
        the archive (retention ran ahead of the checkpoint): an error, never a silent skip.
        """
        segs = self._segs(partition)
        if not segs:
            return start
        if start < segs[0].base:
            raise TidemarkError(
                f"file archive {self.archive.shown} partition {partition}: reading from offset "
                f"{start} but the first segment starts at {segs[0].base}: offsets "
                f"[{start}, {segs[0].base}) are no longer in the archive"
            )
        return max(start, min(start + limit, self.end(partition)))

    def safe_ends(self, starts: dict[int, int], limit: int) -> dict[int, int]:
        return {p: self.safe_end(p, start, limit) for p, start in starts.items()}


def _segment_end(a: Archive, seg: Segment) -> int:
    """Highest offset in the segment + 1, reading as little as possible: a parquet footer's
    statistics (else its offset column), a JSON Lines tail."""
    shown = a.show(seg.path)
    top: int | None
    try:
        if seg.fmt == "parquet":
            with a.fs.open_input_file(seg.path) as f:
                pf = pq.ParquetFile(f)
                _check_columns(pf.schema_arrow.names, shown)
                top = _parquet_bounds(pf, seg.base, shown)[1]
        else:
            top = _jsonl_last_offset(a, seg.path, shown)
    except IO_ERRORS as exc:
        raise TidemarkError(f"file archive {shown}: cannot read: {first_line(exc)}") from None
    if top is None:  # a JSON Lines segment without a line
        raise _empty(shown)
    if top < seg.base:
        raise TidemarkError(
            f"file archive {shown}: highest offset {top} is below the "
            f"segment's base offset {seg.base}"
        )
    return top + 1


def _empty(shown: str) -> TidemarkError:
    # A writer keeping the contract never makes one: a segment is named after its first record.
    # An empty file is most often a copy that failed.
    return TidemarkError(f"file archive {shown}: holds no record (empty or truncated segment)")


def _check_base(first: int, base: int, shown: str) -> None:
    if first != base:
        raise TidemarkError(
            f"file archive {shown}: first record has offset {first}, not the "
            f"base offset {base} the name gives (a segment is named after "
            f"its first record)"
        )


_NO_STATS = object()


def _offset_column_index(pf: pq.ParquetFile) -> int | None:
    md = pf.metadata
    if md.num_row_groups == 0:
        return None
    rg = md.row_group(0)
    for j in range(rg.num_columns):
        if rg.column(j).path_in_schema == "offset":
            return j
    return None


def _rg_stats(pf: pq.ParquetFile, j: int | None, i: int) -> tuple[int, int] | None:
    """(min, max) offset of row group ``i`` from its statistics, when present."""
    if j is None:
        return None
    st = pf.metadata.row_group(i).column(j).statistics
    if (
        st is None
        or not st.has_min_max
        or isinstance(st.min, bool)
        or not isinstance(st.min, int)
        or not isinstance(st.max, int)
    ):
        return None
    return st.min, st.max


def _stats_bounds(pf: pq.ParquetFile):
    """(lowest, highest) offset from the row groups' statistics, None if it has no row,
    _NO_STATS if a row group has none."""
    j = _offset_column_index(pf)
    lo = hi = None
    for i in range(pf.metadata.num_row_groups):
        if pf.metadata.row_group(i).num_rows == 0:
            continue
        st = _rg_stats(pf, j, i)
        if st is None:
            return _NO_STATS
        lo = st[0] if lo is None else min(lo, st[0])
        hi = st[1] if hi is None else max(hi, st[1])
    return None if lo is None else (lo, hi)


def _parquet_bounds(pf: pq.ParquetFile, base: int, shown: str) -> tuple[int, int]:
    """(lowest, highest) offset of a parquet segment: from the statistics when every row
    group has them, else the offset column. Raises if it has no row or does not start at
    ``base``."""
    bounds = _stats_bounds(pf)
    if bounds is _NO_STATS:
        col = pf.read(columns=["offset"], use_threads=False).column("offset")
        bounds = (pc.min(col).as_py(), pc.max(col).as_py()) if len(col) else None
    if bounds is None:
        raise _empty(shown)
    _check_base(bounds[0], base, shown)
    return bounds


def _jsonl_last_offset(a: Archive, path: str, shown: str) -> int | None:
    with a.fs.open_input_file(path) as f:
        pos = f.size()
        tail = b""
        while pos > 0:
            n = min(_TAIL_CHUNK, pos)
            pos -= n
            f.seek(pos)
            tail = f.read(n) + tail
            lines = tail.split(b"\n")
            whole = lines if pos == 0 else lines[1:]  # lines[0] may be cut when pos > 0
            for i in reversed(range(len(whole))):
                if whole[i].strip():
                    # read from the start: its number is known, as the reader would name it
                    at = f"line {i + 1}" if pos == 0 else "last line"
                    rec = _json_line(whole[i], shown, at)
                    return _int_field(rec, "offset", shown, at)
    return None


# --- reader ------------------------------------------------------------------------------------


def read_range(src: FileArchiveSource, r: Range) -> Iterator[pa.RecordBatch]:
    """Executor side: the records of ``r`` as batches of :data:`tidemark.sources.SCHEMA`.

    Opens only the segments whose ``[base, next base)`` meets ``[r.start, r.end)`` (plus the
    last segment's footer or tail, when the range reaches it, to check the range ends inside
    the archive). Yields rows in offset order, at most ``BATCH_ROWS`` a batch.
    """
    from tidemark.sources.schema import BATCH_ROWS, SCHEMA

    if r.size <= 0:
        return
    a = Archive(src.uri)
    segs = a.segments(r.partition)
    where = f"file archive {a.shown} partition {r.partition}"
    if not segs or r.start < segs[0].base:
        first = f"the first segment starts at {segs[0].base}" if segs else "it has no segment"
        raise TidemarkError(
            f"{where}: range [{r.start}, {r.end}) cannot be read: {first} "
            f"(segments deleted or rewritten inside a planned range)"
        )
    picked: list[tuple[Segment, int | None]] = []
    for i, seg in enumerate(segs):
        nxt = segs[i + 1].base if i + 1 < len(segs) else None
        if seg.base < r.end and (nxt is None or nxt > r.start):
            picked.append((seg, nxt))
    if picked[-1][1] is None:  # the range reaches the last segment: it must end inside it
        last = picked[-1][0]
        end = _segment_end(a, last)
        if r.end > end:
            raise TidemarkError(
                f"{where}: range [{r.start}, {r.end}) goes past the end of "
                f"the archive ({end}): segment {a.show(last.path)} rewritten "
                f"or truncated"
            )
    out = _Batcher(SCHEMA, BATCH_ROWS)
    for seg, nxt in picked:
        read = _read_parquet if seg.fmt == "parquet" else _read_jsonl
        for batch in read(a, seg.path, r, seg.base, nxt, BATCH_ROWS):
            yield from out.add(batch)
    yield from out.flush()


class _Batcher:
    """Re-chunks filtered batches (of any size) into batches of at most ``rows`` rows."""

    def __init__(self, schema: pa.Schema, rows: int):
        self.schema, self.rows = schema, rows
        self.buf: list[pa.RecordBatch] = []
        self.n = 0

    def add(self, batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
        if batch.num_rows == 0:
            return
        self.buf.append(batch)
        self.n += batch.num_rows
        if self.n >= self.rows:
            table = pa.Table.from_batches(self.buf, self.schema).combine_chunks()
            full = (self.n // self.rows) * self.rows
            yield from table.slice(0, full).to_batches(max_chunksize=self.rows)
            rest = table.slice(full)
            self.buf = rest.to_batches() if rest.num_rows else []
            self.n = rest.num_rows

    def flush(self) -> Iterator[pa.RecordBatch]:
        if self.n:
            table = pa.Table.from_batches(self.buf, self.schema).combine_chunks()
            yield from table.to_batches(max_chunksize=self.rows)
        self.buf, self.n = [], 0


class _Order:
    """Checks that the offsets read from one segment increase and stay in its interval."""

    def __init__(self, shown: str, base: int, nxt: int | None):
        self.shown, self.base, self.nxt = shown, base, nxt
        self.prev: int | None = None

    def check(self, offsets: list[int], where: str = "") -> None:
        if not offsets:
            return
        prev = self.prev
        for o in offsets:
            if prev is not None and o <= prev:
                raise TidemarkError(
                    f"file archive {self.shown}{where}: offset {o} after "
                    f"{prev}: records must be in strictly increasing offset "
                    f"order"
                )
            prev = o
        lo, hi = offsets[0], offsets[-1]
        if lo < self.base or (self.nxt is not None and hi >= self.nxt):
            bad = lo if lo < self.base else hi
            upper = "" if self.nxt is None else f", {self.nxt}"
            raise TidemarkError(
                f"file archive {self.shown}{where}: offset {bad} outside the "
                f"segment's interval [{self.base}{upper})"
            )
        self.prev = prev


def _check_columns(names: list[str], shown: str) -> None:
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise TidemarkError(
            f"file archive {shown}: missing column(s) {', '.join(missing)} "
            f"(a segment has {', '.join(COLUMNS)})"
        )


def _read_parquet(
    a: Archive, path: str, r: Range, base: int, nxt: int | None, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    shown = a.show(path)
    order = _Order(shown, base, nxt)
    try:
        with a.fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            _check_columns(pf.schema_arrow.names, shown)
            _parquet_bounds(pf, base, shown)  # it starts at its base, wherever r starts
            j = _offset_column_index(pf)
            groups = []
            for i in range(pf.metadata.num_row_groups):
                st = _rg_stats(pf, j, i)
                if st is None or (st[1] >= r.start and st[0] < r.end):
                    groups.append(i)
            if not groups:
                return
            for raw in pf.iter_batches(
                batch_size=batch_rows, row_groups=groups, columns=list(COLUMNS), use_threads=False
            ):
                batch = _conform(raw, shown, r.partition)
                off = batch.column(1)
                keep = pc.and_(pc.greater_equal(off, r.start), pc.less(off, r.end))
                batch = batch.filter(keep)
                order.check(batch.column(1).to_pylist())
                _check_headers(batch.column(4), batch.column(1), shown)
                yield batch
    except IO_ERRORS as exc:
        raise TidemarkError(f"file archive {shown}: cannot read: {first_line(exc)}") from None


def _conform(raw: pa.RecordBatch, shown: str, partition: int) -> pa.RecordBatch:
    """A parquet batch (archive column names, any compatible types) as SCHEMA."""
    from tidemark.sources.schema import SCHEMA

    cols = []
    for name, target in zip(COLUMNS, SCHEMA.types, strict=True):
        col = raw.column(name)
        t = col.type
        ok = {
            "partition": pa.types.is_integer(t),
            "offset": pa.types.is_integer(t),
            "key": _bytes_like(t),
            "payload": _bytes_like(t),
            "headers": pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t),
            "ts": pa.types.is_timestamp(t) or pa.types.is_null(t),
        }[name]
        if not ok:
            raise TidemarkError(
                f"file archive {shown}: column {name} has type {t}, expected {target}"
            )
        if name in ("partition", "offset") and col.null_count:
            raise TidemarkError(f"file archive {shown}: column {name} has nulls")
        try:
            col = pc.cast(col, options=pc.CastOptions(target, allow_time_truncate=True))
        except pa.ArrowException as exc:
            raise TidemarkError(f"file archive {shown}: column {name}: {first_line(exc)}") from None
        cols.append(col)
    if len(cols[0]) and not pc.all(pc.equal(cols[0], partition)).as_py():
        bad = pc.filter(cols[0], pc.not_equal(cols[0], partition))[0].as_py()
        raise TidemarkError(
            f"file archive {shown}: record of partition {bad} in the folder "
            f"of partition {partition}"
        )
    return pa.RecordBatch.from_arrays(cols, schema=SCHEMA)


def _bytes_like(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_null(t)
    )


def _check_headers(headers: pa.Array, offsets: pa.Array, shown: str) -> None:
    if headers.null_count == len(headers):
        return
    for h, o in zip(headers.to_pylist(), offsets.to_pylist(), strict=True):
        if h is None:
            continue
        try:
            ok = isinstance(json.loads(h), dict)
        except ValueError:
            ok = False
        if not ok:
            raise TidemarkError(f"file archive {shown}: offset {o}: headers is not a JSON object")


def _read_jsonl(
    a: Archive, path: str, r: Range, base: int, nxt: int | None, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    from tidemark.sources.schema import SCHEMA

    shown = a.show(path)
    order = _Order(shown, base, nxt)
    buf: list[list] = [[], [], [], [], []]

    def batch() -> pa.RecordBatch:
        n = len(buf[0])
        return pa.RecordBatch.from_arrays(
            [
                pa.array([r.partition] * n, pa.int32()),
                pa.array(buf[0], pa.int64()),
                pa.array(buf[1], pa.binary()),
                pa.array(buf[2], pa.binary()),
                pa.array(buf[3], pa.string()),
                pa.array(buf[4], pa.timestamp("us", tz="UTC")),
            ],
            schema=SCHEMA,
        )

    try:
        with a.fs.open_input_stream(path) as raw:
            for lineno, line in enumerate(io.BufferedReader(raw, 1 << 20), 1):
                if not line.strip():
                    continue
                at = f"line {lineno}"
                rec = _json_line(line, shown, at)
                offset = _int_field(rec, "offset", shown, at)
                if order.prev is None:  # the first record: lines are read from the first
                    _check_base(offset, base, shown)
                order.check([offset], f" {at}")
                if offset >= r.end:
                    break
                part = _int_field(rec, "partition", shown, at)
                if part != r.partition:
                    raise TidemarkError(
                        f"file archive {shown} {at}: record of partition "
                        f"{part} in the folder of partition {r.partition}"
                    )
                if offset < r.start:
                    continue
                buf[0].append(offset)
                buf[1].append(_b64(rec, "key", shown, at))
                buf[2].append(_b64(rec, "payload", shown, at))
                buf[3].append(_headers_text(rec, shown, at))
                buf[4].append(_ts_micros(rec, shown, at))
                if len(buf[0]) >= batch_rows:
                    yield batch()
                    buf = [[], [], [], [], []]
    except IO_ERRORS as exc:
        raise TidemarkError(f"file archive {shown}: cannot read: {first_line(exc)}") from None
    if order.prev is None:
        raise _empty(shown)
    if buf[0]:
        yield batch()


def _json_line(line: bytes, shown: str, at: str) -> dict:
    try:
        rec = json.loads(line.decode("utf-8"))  # JSON Lines are UTF-8 (json would guess)
    except ValueError as exc:
        raise TidemarkError(f"file archive {shown} {at}: not JSON: {exc}") from None
    if not isinstance(rec, dict):
        raise TidemarkError(f"file archive {shown} {at}: not a JSON object")
    missing = [c for c in COLUMNS if c not in rec]
    if missing:
        raise TidemarkError(f"file archive {shown} {at}: missing field(s) {', '.join(missing)}")
    return rec


def _int_field(rec: dict, name: str, shown: str, at: str) -> int:
    v = rec.get(name)
    if not isinstance(v, int) or isinstance(v, bool):
        raise TidemarkError(f"file archive {shown} {at}: {name} must be an integer, not {v!r}")
    return v


def _b64(rec: dict, name: str, shown: str, at: str) -> bytes | None:
    v = rec[name]
    if v is None:
        return None
    if not isinstance(v, str):
        raise TidemarkError(f"file archive {shown} {at}: {name} must be a base64 string or null")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TidemarkError(
            f"file archive {shown} {at}: {name} is not valid base64: {exc}"
        ) from None


def _headers_text(rec: dict, shown: str, at: str) -> str | None:
    v = rec["headers"]
    if v is None:
        return None
    if not isinstance(v, dict):
        raise TidemarkError(f"file archive {shown} {at}: headers must be a JSON object or null")
    return json.dumps(v, ensure_ascii=False)


def _ts_micros(rec: dict, shown: str, at: str) -> int | None:
    v = rec["ts"]
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v * 1000
    if isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v)
        except ValueError:
            pass
        else:
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
            return (dt - _EPOCH) // _US
    raise TidemarkError(
        f"file archive {shown} {at}: ts must be ISO-8601 text or epoch milliseconds, not {v!r}"
    )


# --- writer ------------------------------------------------------------------------------------


__all__ = ["FileArchivePlanner", "read_range"]
