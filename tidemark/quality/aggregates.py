"""A suite's metrics as Spark aggregates that Tidemark computes in one Spark job, over a
domain of rows; Great Expectations then judges the values with its own expectations.

GX resolves a suite level by level, one Spark job per level (the row count, then the counts,
then the sample lists), so the demo's row checks and gate took 6 jobs. Here GX first validates
an empty frame of the same schema (no data, no job) while Tidemark notes every aggregate it
asks for; Tidemark builds each with its domain applied to the aggregate's input, and GX's
second validation of the empty frame is handed the values of the one job.

Only aggregates known exactly are taken: ``table.row_count``, the unexpected counts of map
expectations (on GX's own condition) and a column's mean, min, max or sum, each over the whole
table and each checked to be the very aggregate GX asked for. A suite that needs anything else
(a quantile, a sample list, a row condition) gets no :class:`Plan`, and GX computes it itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from tidemark.quality.expectations import lock as _lock
from tidemark.quality.validation import batch_definition, validate

# Metrics GX computes without reading a row: the schema, conditions, aggregate partials. The
# sample lists read rows, but none when no samples are asked for (see _reads_no_rows).
_SCHEMA = {"table.columns", "table.column_types"}
_PARTIALS = (".condition", ".aggregate_fn")
_SAMPLES = (
    ".unexpected_values",
    ".unexpected_index_list",
    ".unexpected_index_query",
    ".unexpected_rows",
    ".unexpected_value_counts",
)
_VALUES = "_spark_column_map_condition_values"  # GX's sample values of a column map check
_COLUMN_AGGREGATES: dict[str, Callable[[Column], Column]] = {
    "column.mean": F.mean,
    "column.min": F.min,
    "column.max": F.max,
    "column.sum": F.sum,
}
# Domain keys GX always sets; any other that is set (a row condition, a filter) narrows the
# rows in a way this module does not rebuild.
_WHOLE_TABLE = {"batch_id", "table"}


@dataclass
class Plan:
    """What one Spark job must compute for one suite, and how GX then judges it."""

    suite: Any
    result_format: dict
    empty: DataFrame
    columns: list[Column] = field(default_factory=list)  # aggregates, aliased
    ids: list = field(default_factory=list)  # their GX metric ids
    conditions: dict[str, Column] = field(default_factory=dict)  # key(expectation) -> unexpected
    order: list[str] = field(default_factory=list)  # key(expectation), as GX reports them


def plan(
    df: DataFrame,
    suite,
    result_format: dict,
    domain: Column | None,
    tag: str,
    conditions: bool = False,
) -> Plan | None:
    """The aggregates of ``suite`` over the rows of ``df`` where ``domain`` holds (all if
    None), aliased ``<tag><n>``; None when one of its metrics is not an aggregate known here.
    ``conditions``: also GX's unexpected condition of each of its (map) expectations, by
    :func:`key`."""
    empty = df.sparkSession.createDataFrame([], df.schema)
    bundles: dict = {}
    directs: list[str] = []
    partials: dict = {}  # a count's partial (its metric id) -> GX's unexpected condition

    def record(engine, bundle):
        for cfg in bundle:
            bundles[cfg.metric_configuration.id] = cfg
        return {cfg.metric_configuration.id: 0 for cfg in bundle}

    def seen(c):
        directs.append(c.metric_configuration.metric_name)
        cond = ((c.metric_provider_kwargs or {}).get("metrics") or {}).get("unexpected_condition")
        if isinstance(cond, tuple) and cond and isinstance(cond[0], Column):
            partials[c.metric_configuration.id] = cond[0]

    def condition(cfg) -> Column | None:
        dep = cfg.metric_configuration.metric_dependencies.get("metric_partial_fn")
        return partials.get(dep.id) if dep is not None else None

    with _hooked(record, seen) as engine:
        _, res = validate(empty, suite, result_format)
        if not res.success and any(
            (r.exception_info or {}).get("raised_exception") for r in res.results
        ):
            return None  # GX reports it properly when it computes the suite itself
        found = {}
        for e in suite.expectations if conditions else []:
            deps = e.get_validation_dependencies(
                execution_engine=engine, runtime_configuration={"result_format": result_format}
            )
            mc = deps.metric_configurations.get(
                f"{getattr(e, 'map_metric', None)}.unexpected_count"
            )
            same = [cfg for cfg in bundles.values() if mc is not None and _same(cfg, mc)]
            cond = condition(same[0]) if same else None
            if cond is not None:
                found[key(e.configuration)] = F.coalesce(cond, F.lit(False))
    if not all(_reads_no_rows(name, result_format) for name in directs):
        return None
    out = Plan(
        suite,
        result_format,
        empty,
        conditions=found,
        order=[key(r.expectation_config) for r in res.results],
    )
    for i, (mid, cfg) in enumerate(bundles.items()):
        agg = _aggregate(cfg, condition(cfg), domain)
        if agg is None:
            return None
        out.columns.append(agg.alias(f"{tag}{i}"))
        out.ids.append(mid)
    return out


def judge(p: Plan, row, tag: str):
    """GX's batch and validation result for ``p``'s suite from the job's ``row``."""
    from great_expectations.util import convert_to_json_serializable

    values = {
        mid: convert_to_json_serializable(data=row[f"{tag}{i}"]) for i, mid in enumerate(p.ids)
    }

    def given(engine, bundle):
        return {cfg.metric_configuration.id: values[cfg.metric_configuration.id] for cfg in bundle}

    with _hooked(given, lambda c: None):
        return validate(p.empty, p.suite, p.result_format)


@contextmanager
def _hooked(bundles: Callable, direct: Callable):
    """GX's Spark engine with its aggregate bundles answered by ``bundles`` (no Spark job) and
    every metric it computes directly (its computation) passed to ``direct``. Under GX's lock: the
    engine is the process's one."""
    with _lock:
        engine = batch_definition().data_asset.datasource.get_execution_engine()
        build = engine._build_direct_and_bundled_metric_computation_configurations

        def split(*args, **kwargs):
            plain, bundled = build(*args, **kwargs)
            for c in plain:
                direct(c)
            # The frame is empty, so are its sample values; asking Spark costs a query each.
            return [
                dataclasses.replace(c, metric_fn=_no_values)
                if getattr(c.metric_fn, "__name__", "") == _VALUES
                else c
                for c in plain
            ], bundled

        engine.resolve_metric_bundle = lambda metric_fn_bundle: bundles(
            engine, list(metric_fn_bundle)
        )
        engine._build_direct_and_bundled_metric_computation_configurations = split
        try:
            yield engine
        finally:
            del engine.resolve_metric_bundle
            del engine._build_direct_and_bundled_metric_computation_configurations


def key(config) -> str:
    """An expectation configuration's identity: GX's results come in an order of its own."""
    kwargs = {k: v for k, v in dict(config.kwargs).items() if k != "batch_id"}
    return json.dumps([config.type, kwargs], sort_keys=True, default=str)


def _same(cfg, mc) -> bool:
    """Whether the computed metric ``cfg`` is ``mc`` (GX adds the batch to the domain while
    it validates)."""
    a, b = cfg.metric_configuration, mc
    return (
        a.metric_name == b.metric_name
        and a.id.metric_value_kwargs_id == b.id.metric_value_kwargs_id
        and _domain(a) == _domain(b)
    )


def _domain(mc) -> dict:
    return {k: v for k, v in dict(mc.metric_domain_kwargs or {}).items() if k != "batch_id"}


def _no_values(**kwargs) -> list:
    return []


def _reads_no_rows(name: str, result_format: dict) -> bool:
    if name in _SCHEMA or name.endswith(_PARTIALS):
        return True
    return (
        name.endswith(_SAMPLES)
        and result_format.get("partial_unexpected_count") == 0
        and result_format.get("result_format") in ("BOOLEAN_ONLY", "BASIC", "SUMMARY")
        and not result_format.get("unexpected_index_column_names")
    )


def _aggregate(cfg, cond: Column | None, domain: Column | None) -> Column | None:
    """``cfg``'s aggregate with ``domain`` applied to its input, if it is one known here and
    exactly the one GX built (``cond``: a count's unexpected condition, as GX built it)."""
    name = cfg.metric_configuration.metric_name
    dom = dict(cfg.compute_domain_kwargs or {})
    if any(v for k, v in dom.items() if k not in _WHOLE_TABLE):
        return None

    def within(x: Column) -> Column:
        return x if domain is None else F.when(domain, x)

    asked = str(cfg.metric_fn)
    if name == "table.row_count":
        return F.count(within(F.lit(1))) if asked == str(F.count(F.lit(1))) else None
    if name.endswith(".unexpected_count"):
        if cond is None:
            return None
        hit = F.when(cond, 1).otherwise(0)
        return F.sum(within(hit)) if asked == str(F.sum(hit)) else None
    fn = _COLUMN_AGGREGATES.get(name)
    column = (cfg.accessor_domain_kwargs or {}).get("column")
    if fn is None or not isinstance(column, str):
        return None
    # GX sums an integral column as doubles on Spark 4 (a long could overflow).
    for x in (F.col(column), F.col(column).cast("double")):
        if asked == str(fn(x)):
            return fn(within(x))
    return None
