"""Corrections: values the pipeline corrects in a window of records (config.Correction,
docs/pipelines.md "Corrections"), applied to the transformed batch.

Every mode reads its records through records.rows, so a run, a backfill, a rebuild, a redrive
and a backfill's fallback all make the same rows of a record: re-delivering the window
places corrected values, and re-delivering it again (or rebuilding) keeps them corrected.
Only rows that passed are corrected; a record on its way to the dead-letter queue keeps its
verdict. Each result is cast to the column's type, so a correction never changes a sink's
table.
"""

from __future__ import annotations

from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from tidemark.config import Correction, Pipeline
from tidemark.core.errors import ConfigError
from tidemark.engine.row_errors import ERR_CLASS, ERR_REASON


def window(c: Correction) -> Column:
    """The rows of the correction's window: every condition it gives."""
    cond = F.col(ERR_CLASS).isNull()
    if c.partitions:
        cond = cond & F.col("_tm_partition").isin(c.partitions)
    if c.offsets is not None:
        cond = cond & (F.col("_tm_offset") >= c.offsets[0]) & (F.col("_tm_offset") < c.offsets[1])
    if c.since is not None and c.until is not None:
        # Aware datetimes: Spark compares instants, whatever its session time zone.
        cond = cond & (F.col("_tm_ts") >= F.lit(c.since)) & (F.col("_tm_ts") < F.lit(c.until))
    # A record without a time is in no time window (NULL is not true).
    return F.coalesce(cond, F.lit(False))


def apply(df: DataFrame, pipeline: Pipeline) -> DataFrame:
    """``df`` (transformed) with each correction applied in the order listed, a later one
    seeing what an earlier one set; a ``required`` column a correction makes NULL
    quarantines its row (class transform), as the transform's own would."""
    if not pipeline.corrections:
        return df
    where = f"pipeline {pipeline.name}"
    types = {f.name: f.dataType for f in df.schema.fields}
    required = set(pipeline.transform.required)
    for i, c in enumerate(pipeline.corrections):
        field = f"corrections[{i}].set"
        inside = window(c)
        values = {}
        for col, expr in c.set_.items():
            if col not in types:
                raise ConfigError(
                    where, f"the transform produces no column {col}", f"{field}.{col}"
                )
            try:
                values[col] = F.expr(expr).cast(types[col])
                # Analysed now, so a bad expression fails the run before any task starts.
                df.select(values[col]).schema  # noqa: B018
            except PySparkException as exc:
                raise ConfigError(
                    where, f"invalid expression: {str(exc).splitlines()[0]}", f"{field}.{col}"
                ) from None
        df = df.withColumns(
            {col: F.when(inside, v).otherwise(F.col(col)) for col, v in values.items()}
        )
        nulls = [
            F.when(
                inside & F.col(col).isNull(),
                F.lit(f"required column {col} is NULL (from correction {c.name})"),
            )
            for col in c.set_
            if col in required
        ]
        if nulls:
            why = F.coalesce(*nulls)
            failed = F.col(ERR_CLASS).isNull() & why.isNotNull()
            df = df.withColumns(
                {
                    ERR_REASON: F.when(failed, why).otherwise(F.col(ERR_REASON)),
                    ERR_CLASS: F.when(failed, F.lit("transform")).otherwise(F.col(ERR_CLASS)),
                }
            )
    return df
