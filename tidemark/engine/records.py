"""From source records to sink rows, in Spark: decode (JSON) then transform.

Row-level failures never fail the job: a record that cannot be decoded or transformed keeps
its original bytes and gets ``_tm_error_class``/``_tm_reason`` set, and the writer sends it to
the dead-letter queue. ANSI mode is off, so an expression that cannot be evaluated yields
NULL; declare such columns ``required`` to quarantine the row instead of delivering a NULL.
"""

from __future__ import annotations

import importlib

from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DataType

from tidemark.config import Pipeline, is_meta, pg_type
from tidemark.core.errors import ConfigError
from tidemark.engine import corrections
from tidemark.engine.row_errors import ERR_CLASS as ERR_CLASS
from tidemark.engine.row_errors import ERR_REASON as ERR_REASON
from tidemark.sources import json_arrow

META = ["_tm_partition", "_tm_offset", "_tm_key", "_tm_payload", "_tm_headers", "_tm_ts"]
# A record with a key and no payload: not an error, but not a row either. Its class stays
# set through the transform and the checks (which judge rows only); each sink then deletes
# its key or keeps it as a dead letter (config.Tombstones, tidemark/engine/sink_task.py).
TOMBSTONE = "tombstone"
TOMBSTONE_REASON = "tombstone: a key and no payload"
TOMBSTONE_KEPT = (
    "tombstone (a key and no payload): this sink keeps tombstones as dead letters "
    "(tombstones: quarantine)"
)
_PARSED, _CORRUPT = "_tm_json", "_tm_corrupt"


def _ddl(schema: dict[str, str]) -> str:
    return ", ".join(f"`{k.replace('`', '``')}` {v}" for k, v in schema.items())


def decode(df: DataFrame, pipeline: Pipeline) -> DataFrame:
    """Payload JSON to the declared fields. Where the reader already decoded a record with
    Arrow (``_tm_json_ok``, tidemark/sources/json_arrow.py), its values are taken as they are
    and Spark's per-row parse is skipped; every other record is parsed here, with its verdict."""
    schema = pipeline.decode.schema_
    pre = json_arrow.OK in df.columns
    slow = ~F.col(json_arrow.OK) if pre else F.lit(True)
    text = F.col("_tm_payload").cast("string")
    parsed = F.from_json(
        text,
        _ddl(schema) + f", `{_CORRUPT}` string",
        {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT},
    )
    # CASE WHEN evaluates a branch only for the rows that take it.
    df = df.withColumn(_PARSED, F.when(slow, parsed) if pre else parsed)
    field = F.col(f"{_PARSED}.{_CORRUPT}")
    mismatch = _mismatch(text, schema)
    tombstone = slow & F.col("_tm_payload").isNull() & F.col("_tm_key").isNotNull()
    reason = (
        F.when(~slow, F.lit(None).cast("string"))
        .when(tombstone, F.lit(TOMBSTONE_REASON))
        .when(
            F.col("_tm_payload").isNull() | (F.length("_tm_payload") == 0), F.lit("empty payload")
        )
        .when(
            ~F.expr("is_valid_utf8(cast(_tm_payload as string))"),
            F.lit("payload is not valid UTF-8"),
        )
        .when(F.col(_PARSED).isNull(), F.lit("payload is not JSON"))
        .when(field.isNotNull(), mismatch)
    )
    fields = [
        (
            F.when(F.col(json_arrow.OK), F.col(json_arrow.column(i))).otherwise(
                F.col(_PARSED)[name]
            )
            if pre
            else F.col(_PARSED)[name]
        ).alias(name)
        for i, name in enumerate(schema)
    ]
    return df.select(
        *META,
        *fields,
        F.when(tombstone, F.lit(TOMBSTONE))
        .when(reason.isNotNull(), F.lit("decode"))
        .alias(ERR_CLASS),
        reason.alias(ERR_REASON),
    )


def _mismatch(text: Column, schema: dict[str, str]) -> Column:
    """Names the first field whose raw JSON value did not read as its declared type."""
    return F.coalesce(
        *[
            F.when(
                F.get_json_object(text, f"$['{name}']").isNotNull() & F.col(_PARSED)[name].isNull(),
                F.concat(
                    F.lit(f"field {name}: cannot read '"),
                    F.substring(F.get_json_object(text, f"$['{name}']"), 1, 60),
                    F.lit(f"' as {typ}"),
                ),
            )
            for name, typ in schema.items()
        ],
        F.lit("payload is not a JSON object"),
    )


def transform(df: DataFrame, pipeline: Pipeline) -> DataFrame:
    t = pipeline.transform
    where = f"pipeline {pipeline.name}: transform"
    carried = [*META, ERR_CLASS, ERR_REASON]
    if t.python:
        module, func = t.python.split(":")
        try:
            fn = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(where, f"cannot load {t.python}: {exc}", "python") from None
        out: DataFrame = fn(df)  # the pipeline's own function: DataFrame -> DataFrame
        # `_TM_ERROR`, `_Tm_Offset`: the same columns to Spark; named as Tidemark names them,
        # so that every check below (and the writer's) finds them.
        odd = {c: c.lower() for c in out.columns if is_meta(c) and c != c.lower()}
        if odd:
            out = out.withColumnsRenamed(odd)
        missing = [c for c in carried if c not in out.columns]
        if missing:
            raise ConfigError(
                where, f"{t.python} dropped columns it must keep: {', '.join(missing)}", "python"
            )
        if "_tm_error" in out.columns:  # the function's own row-level rejects
            bad = F.col(ERR_CLASS).isNull() & F.col("_tm_error").isNotNull()
            out = (
                out.withColumn(
                    ERR_REASON, F.when(bad, F.col("_tm_error")).otherwise(F.col(ERR_REASON))
                )
                .withColumn(ERR_CLASS, F.when(bad, F.lit("transform")).otherwise(F.col(ERR_CLASS)))
                .drop("_tm_error")
            )
        return out
    if t.select is None:
        return df
    try:
        outputs = [F.expr(expr).alias(col) for col, expr in t.select.items()]
        out = df.select(*carried, *outputs)
    # Spark's analysis or parse error: a pipeline bug. Only Spark's: a SIGTERM (Terminated)
    # while Spark analyses the select must stop the run, not read as a bad expression.
    except PySparkException as exc:
        raise ConfigError(
            where, f"invalid expression: {str(exc).splitlines()[0]}", "select"
        ) from None
    checks: list[Column] = [
        F.when(F.col(c).isNull(), F.lit(f"required column {c} is NULL (from {t.select[c]})"))
        for c in t.required
    ]
    if checks:
        failed = F.col(ERR_CLASS).isNull() & F.coalesce(*checks).isNotNull()
        out = out.select(
            *META,
            F.when(failed, F.lit("transform")).otherwise(F.col(ERR_CLASS)).alias(ERR_CLASS),
            F.when(failed, F.coalesce(*checks)).otherwise(F.col(ERR_REASON)).alias(ERR_REASON),
            *t.select,
        )
    return out


def rows(df: DataFrame, pipeline: Pipeline) -> DataFrame:
    """What the pipeline makes of source records: decoded, transformed, corrected. Every
    mode reads through here, so every delivery of a record makes the same row."""
    return corrections.apply(transform(decode(df, pipeline), pipeline), pipeline)


def output_columns(df: DataFrame) -> list[tuple[str, str]]:
    """(name, PostgreSQL type) of the sink columns the transformed frame carries."""
    cols = []
    for f in df.schema.fields:
        if is_meta(f.name):
            continue
        cols.append((f.name, spark_to_pg(f.dataType, f.name)))
    return cols


def spark_to_pg(dt: DataType, name: str) -> str:
    simple = dt.simpleString()
    simple = {"tinyint": "smallint"}.get(simple, simple)
    try:
        return pg_type(simple)
    except ValueError:
        raise ConfigError(
            "transform",
            f"column {name} has Spark type {simple}, which no sink column type matches; cast it",
        ) from None
