"""From source records to sink rows in Arrow, for the local task runner
(tidemark/driver/runners.py): the same columns and verdicts tidemark/engine/records.py makes
in Spark, for the pipelines whose decode and transform need no Spark SQL.

What it takes: a decode schema of simple types (json_arrow.TYPES) and a ``select`` whose every
expression names a column (as Spark resolves names: in any case, optionally in backquotes),
with its ``required`` columns. Anything else (an expression, a Python transform over a
DataFrame) is refused by :func:`refusal` before the run claims anything.

Records Arrow's JSON reader decodes are taken as they are (tidemark/sources/json_arrow.py);
each other record is read by Python's parser, with the verdict Spark gives it (an empty,
non-UTF-8 or non-object payload, a field of another type: tests/test_protocol.py's poison
records land in the same dead letters, with the same reasons, on both engines).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.config import Pipeline
from tidemark.engine.records import ERR_CLASS, ERR_REASON, META, TOMBSTONE, TOMBSTONE_REASON
from tidemark.sources import json_arrow

# Arrow type -> the Spark type name records.output_columns would see.
SPARK_NAMES = {
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.float64(): "double",
    pa.string(): "string",
    pa.bool_(): "boolean",
    pa.timestamp("us", tz="UTC"): "timestamp",
    pa.binary(): "binary",  # _tm_key, _tm_payload selected as they are
}
_NAME = re.compile(r"^\s*(?:`((?:[^`]|``)+)`|([A-Za-z_][A-Za-z0-9_]*))\s*$")
_INSTANT = re.compile(json_arrow.ISO_INSTANT)


def refusal(pipeline: Pipeline) -> str | None:
    """Why the local runner cannot decode and transform ``pipeline`` (None: it can)."""
    if json_arrow.fields(pipeline.decode.schema_) is None:
        return "its decode schema has a type other than " + ", ".join(sorted(json_arrow.TYPES))
    t = pipeline.transform
    if t.python:
        return f"its transform is a Python function over a Spark DataFrame ({t.python})"
    for col, expr in (t.select or {}).items():
        if _column(expr) is None:
            return f"transform.select {col}: {expr!r} is an expression, not a column name"
    if pipeline.corrections:  # SQL expressions over a window (engine/corrections.py)
        return f"it has corrections ({', '.join(c.name for c in pipeline.corrections)})"
    return None


def _column(expr: str) -> str | None:
    m = _NAME.match(expr)
    if m is None:
        return None
    return m.group(1).replace("``", "`") if m.group(1) is not None else m.group(2)


def rows(batch: pa.RecordBatch, pipeline: Pipeline) -> pa.RecordBatch:
    """A reader's batch (decoded by json_arrow where Arrow could) as the transformed rows."""
    return transform(decode(batch, pipeline), pipeline)


def decode(batch: pa.RecordBatch, pipeline: Pipeline) -> pa.RecordBatch:
    """META, the declared fields, ERR_CLASS and ERR_REASON, as records.decode makes them."""
    schema = json_arrow.fields(pipeline.decode.schema_)
    assert schema is not None  # refusal() said so before the run
    n = batch.num_rows
    ok_col = batch.column(json_arrow.OK) if json_arrow.OK in batch.schema.names else None
    if ok_col is not None and not ok_col.null_count and pc.all(ok_col).as_py():
        # Arrow decoded every record (the usual batch): its columns as they are, no Python
        # object per value (which was most of a large local run's time).
        arrays = [batch.column(c) for c in META]
        for i, t in enumerate(schema.values()):
            col = batch.column(json_arrow.column(i))
            arrays.append(col if col.type == json_arrow.TYPES[t] else col.cast(json_arrow.TYPES[t]))
        arrays += [pa.nulls(n, pa.string()), pa.nulls(n, pa.string())]
        return pa.RecordBatch.from_arrays(arrays, names=[*META, *schema, ERR_CLASS, ERR_REASON])
    if json_arrow.OK in batch.schema.names:
        ok = batch.column(json_arrow.OK).to_pylist()
        values = [batch.column(json_arrow.column(i)).to_pylist() for i in range(len(schema))]
    else:
        ok, values = [False] * n, [[None] * n for _ in schema]
    payloads = batch.column("_tm_payload").to_pylist()
    keys = batch.column("_tm_key").to_pylist()
    classes: list[str | None] = [None] * n
    reasons: list[str | None] = [None] * n
    for i in range(n):
        if ok[i]:
            continue
        got, reason = _decode_one(payloads[i], keys[i], schema)
        if reason == TOMBSTONE_REASON:
            classes[i] = TOMBSTONE
        elif reason is not None:
            classes[i] = "decode"
        reasons[i] = reason
        for j, v in enumerate(got):
            values[j][i] = v
    arrays = [batch.column(c) for c in META]
    arrays += [pa.array(values[j], json_arrow.TYPES[t]) for j, t in enumerate(schema.values())]
    arrays += [pa.array(classes, pa.string()), pa.array(reasons, pa.string())]
    return pa.RecordBatch.from_arrays(arrays, names=[*META, *schema, ERR_CLASS, ERR_REASON])


def _decode_one(
    payload: bytes | None, key: bytes | None, schema: dict[str, str]
) -> tuple[list[Any], str | None]:
    """One record's field values and verdict (None: decoded), as Spark's from_json reads it."""
    none: list[Any] = [None] * len(schema)
    if payload is None and key is not None:
        return none, TOMBSTONE_REASON
    if not payload:
        return none, "empty payload"
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return none, "payload is not valid UTF-8"
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return none, "payload is not a JSON object"
    if not isinstance(doc, dict):
        return none, "payload is not a JSON object"
    # Spark matches fields case-insensitively only in case of no exact match; exact here.
    out: list[Any] = []
    reason = None
    for name, typ in schema.items():
        raw = doc.get(name)
        value, fits = _coerce(raw, typ)
        out.append(value)
        if not fits and reason is None:
            shown = raw if isinstance(raw, str) else json.dumps(raw, separators=(",", ":"))
            reason = f"field {name}: cannot read '{shown[:60]}' as {typ}"
    if reason is not None:  # Spark's PERMISSIVE parse keeps no field of a corrupt record
        return none, reason
    return out, None


def _coerce(raw: Any, typ: str) -> tuple[Any, bool]:
    """(value, whether the raw JSON value reads as ``typ``); a missing or null field fits."""
    if raw is None:
        return None, True
    if typ in ("int", "integer", "bigint", "long"):
        bits = 31 if typ in ("int", "integer") else 63
        if isinstance(raw, int) and not isinstance(raw, bool) and -(2**bits) <= raw < 2**bits:
            return raw, True
        return None, False
    if typ == "double":
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw), True
        if isinstance(raw, str) and raw in ("NaN", "Infinity", "-Infinity"):
            return float(raw.replace("Infinity", "inf")), True
        return None, False
    if typ == "string":
        if isinstance(raw, str):
            return raw, True
        return json.dumps(raw, separators=(",", ":")), True  # Spark keeps the raw JSON text
    if typ == "boolean":
        return (raw, True) if isinstance(raw, bool) else (None, False)
    if typ == "timestamp":
        if isinstance(raw, str) and _INSTANT.match(raw):
            return datetime.fromisoformat(raw.replace("Z", "+00:00")).astimezone(UTC), True
        return None, False
    raise AssertionError(typ)


def transform(batch: pa.RecordBatch, pipeline: Pipeline) -> pa.RecordBatch:
    """The transform's ``select`` (column names only) and ``required``, as records.transform."""
    t = pipeline.transform
    if t.select is None:
        return batch
    by_lower = {name.lower(): name for name in batch.schema.names}
    outputs = {}
    for col, expr in t.select.items():
        name = _column(expr)
        assert name is not None  # refusal() said so before the run
        found = by_lower.get(name.lower())
        if found is None:
            from tidemark.core.errors import ConfigError

            raise ConfigError(
                f"pipeline {pipeline.name}: transform",
                f"invalid expression: no column {name}",
                "select",
            )
        outputs[col] = batch.column(found)
    classes = batch.column(ERR_CLASS)
    reasons = batch.column(ERR_REASON)
    if t.required and any(outputs[c].null_count for c in t.required):
        # In Arrow, not per row: the first required column that is NULL names the reason,
        # for a record no earlier step rejected.
        failing = pa.nulls(batch.num_rows, pa.string())
        for c in reversed(t.required):
            why = pa.scalar(f"required column {c} is NULL (from {t.select[c]})", pa.string())
            failing = pc.if_else(pc.is_null(outputs[c]), why, failing)
        fails = pc.and_(pc.is_null(classes), pc.is_valid(failing))
        classes = pc.if_else(fails, pa.scalar("transform", pa.string()), classes)
        reasons = pc.if_else(fails, failing, reasons)
    arrays = [*(batch.column(c) for c in META), classes, reasons, *outputs.values()]
    names = [*META, ERR_CLASS, ERR_REASON, *outputs]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def output_columns(schema: pa.Schema) -> list[tuple[str, str]]:
    """(name, PostgreSQL type) of the sink columns, as records.output_columns says them."""
    from tidemark.config import is_meta, pg_type

    return [(f.name, pg_type(SPARK_NAMES[f.type])) for f in schema if not is_meta(f.name)]
