"""JSON payloads decoded in the reader by Arrow's vectorized parser (C++), for the common case.

Spark's ``from_json`` parses every record in the JVM, row by row, and was the largest single
cost of a run after the read itself. When every declared field has a simple type (int,
bigint, double, string, boolean, timestamp), the reader parses a batch's payloads in one call to
``pyarrow.json`` and hands Spark the typed values with ``_tm_json_ok`` set. Whatever Arrow
does not read whole, a chunk of 512 records at a time, keeps ``_tm_json_ok`` false and Spark
decodes it as before (tidemark/engine/records.py): a payload that is not one line from `{` to
`}`, bad UTF-8, a value of another type, a repeated field, two objects on a line. Spark's
per-row verdicts stay the reference; Arrow only stands in where it reads exactly what Spark
would (tests/test_sources.py decodes payloads made to disagree both ways and compares).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from tidemark.core import arrow

TYPES = {
    "int": pa.int32(),
    "integer": pa.int32(),
    "bigint": pa.int64(),
    "long": pa.int64(),
    "double": pa.float64(),
    "string": pa.string(),
    "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}
# An instant as Arrow may read it: read as text, then only this form, with its zone, which
# means the same in every session time zone. Any other form falls back to Spark.
ISO_INSTANT = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$"
OK = "_tm_json_ok"
CHUNK = 512


def column(i: int) -> str:
    return f"_tm_json{i}"


def fields(schema: dict[str, str]) -> dict[str, str] | None:
    """The decode schema, if Arrow can read every field of it; else None (Spark decodes)."""
    if not schema or any(t.strip().lower() not in TYPES for t in schema.values()):
        return None
    return {name: t.strip().lower() for name, t in schema.items()}


def spark_columns(decoded: dict[str, str]) -> str:
    """The columns the reader adds, as Spark DDL."""
    cols = [f"{column(i)} {'int' if t == 'integer' else t}" for i, t in enumerate(decoded.values())]
    return ", ".join([*cols, f"{OK} boolean"])


def _parse(payload: pa.Array, want: pa.Schema) -> pa.Table | None:
    """The payloads as one table, one row each, or None if Arrow cannot read them all."""
    schema = pa.schema(
        [(f.name, pa.string() if pa.types.is_timestamp(f.type) else f.type) for f in want]
    )
    n = len(payload)
    if not n or payload.null_count:
        return None
    # Each payload one line that is one object: a payload spanning lines would shift every
    # row after it, and Arrow reads a bare `null` as a row of nulls (and crashes on one at
    # the start of its input), where Spark finds no object.
    if not (
        pc.all(pc.starts_with(payload, "{")).as_py() and pc.all(pc.ends_with(payload, "}")).as_py()
    ):
        return None
    buf = _lines(payload)
    text = np.frombuffer(buf, np.uint8)
    if np.count_nonzero(text == ord("\n")) != n or np.count_nonzero(text == ord("\r")):
        return None
    try:
        payload.cast(pa.string())  # Arrow's JSON reader does not check UTF-8 itself
        table = pj.read_json(
            pa.BufferReader(buf),
            read_options=pj.ReadOptions(use_threads=False, block_size=buf.size + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowException, UnicodeDecodeError, ValueError):
        return None
    # Two objects on one line read as two rows: only one row per payload is the same parse.
    if table.num_rows != n:
        return None
    for i, f in enumerate(want):
        if f.type != table.schema.field(i).type:  # an instant, read as text
            text = table.column(i)
            form = pc.match_substring_regex(text, ISO_INSTANT)
            if not pc.all(pc.or_kleene(pc.is_null(text), form)).as_py():
                return None
            try:
                table = table.set_column(i, f.name, pc.cast(text, f.type))
            except pa.ArrowException:
                return None
    return table


def _lines(payload: pa.Array) -> pa.Buffer:
    """The payloads one per line, as one buffer: each with a newline appended by Arrow's
    kernel, whose values are then the lines back to back (no Python object per row)."""
    nl = pa.scalar(b"\n", payload.type)
    return arrow.values(pc.binary_join_element_wise(payload, pa.scalar(b"", payload.type), nl))


def decode(batch: pa.RecordBatch, decoded: dict[str, str], trim: bool = False) -> pa.RecordBatch:
    """``batch`` with the decoded fields and ``_tm_json_ok`` appended; ``trim``: the source
    fields of the records decoded here set to NULL (tidemark.sources.payload_source)."""
    schema = pa.schema([(name, TYPES[t]) for name, t in decoded.items()])
    payload = batch.column("_tm_payload")
    whole = _parse(payload, schema)
    if whole is not None:
        parts, ok = [whole], [pa.array([True] * len(payload), pa.bool_())]
    else:
        parts, ok = [], []
        for at in range(0, len(payload), CHUNK):
            piece = payload.slice(at, CHUNK)
            got = _parse(piece, schema)
            ok.append(pa.array([got is not None] * len(piece), pa.bool_()))
            parts.append(
                got
                if got is not None
                else pa.table({f.name: pa.nulls(len(piece), f.type) for f in schema})
            )
    table = pa.concat_tables(parts).combine_chunks() if len(parts) > 1 else parts[0]
    flags = pa.concat_arrays(ok) if len(ok) > 1 else ok[0]
    cols = batch.columns
    if trim:
        from tidemark.sources.schema import LEFT_OUT

        cols = list(cols)
        for name in LEFT_OUT:
            at = batch.schema.get_field_index(name)
            cols[at] = pc.if_else(flags, pa.scalar(None, cols[at].type), cols[at])
    arrays = [*cols, *(table.column(i).combine_chunks() for i in range(len(schema))), flags]
    names = [*batch.schema.names, *(column(i) for i in range(len(schema))), OK]
    return pa.RecordBatch.from_arrays(arrays, names=names)
