"""Data quality checks with Great Expectations 1.x over a Spark DataFrame.

* :func:`first_passes` computes what both need from one Spark job, GX judging the values
  (quality/aggregates.py), when every metric they need is one it knows;
* :func:`row_failures` runs the *row-level* (column map) expectations as one suite and
  returns the failing rows keyed by ``(_tm_partition, _tm_offset)``;
* :func:`gate` runs any expectations as one suite and optionally renders Data Docs
  (quality/docs.py).

The ephemeral context used for validation is created once per process (quality/validation.py);
no cloud mode is ever used.
"""

from __future__ import annotations

import datetime
import functools
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any

from tidemark.core.errors import TidemarkError
from tidemark.core.text import clamp
from tidemark.quality import aggregates
from tidemark.quality.docs import _render_docs, _safe_name
from tidemark.quality.expectations import is_row_level
from tidemark.quality.reasons import INDEX_COLS as _INDEX_COLS
from tidemark.quality.reasons import OFFSET_COL, PARTITION_COL, columns_of, domain, reason
from tidemark.quality.validation import suite, validate


def _gx_error(result) -> str | None:
    """Why GX could not evaluate an expectation, as one line, or None. GX reports an error of
    the expectation itself at the top of ``exception_info`` and an error of one of its metrics
    (a missing column, a bad regex, a type Spark cannot compare) under that metric's id."""
    info = result.exception_info or {}
    for err in [info, *(v for v in info.values() if isinstance(v, dict))]:
        if err.get("raised_exception"):
            return clamp(_cause(str(err.get("exception_message") or "")), 300)
    return None


def _cause(message: str) -> str:
    """The innermost exception of a message: a failed Spark job's comes wrapped by py4j and
    by Spark's job abort, on one line ("...: java.util.regex.PatternSyntaxException: ...")."""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    if lines and lines[0].startswith("An error occurred while calling"):
        lines = lines[1:]
    if not lines:
        return "no message"
    starts = [m.start() for m in re.finditer(r"[\w$]+(?:Exception|Error): ", lines[0])]
    return lines[0][starts[-1] :] if starts else lines[0].removeprefix("Error: ")


def _evaluated(result) -> None:
    """Raises when GX could not evaluate the expectation of ``result``: an expectation that
    cannot run is a pipeline error, never a verdict on the data (a row check that failed to
    run must not pass every row)."""
    err = _gx_error(result)
    if err is not None:
        cfg = result.expectation_config
        raise TidemarkError(
            f"{cfg.type}({domain(dict(cfg.kwargs))}): GX could not evaluate it: {err}"
        )


def _json_safe(value):
    """Convert GX/Spark/numpy values to plain JSON types (falls back to ``str``)."""
    try:
        return json.loads(json.dumps(value, default=_json_default))
    except (TypeError, ValueError):
        return str(value)


def _json_default(obj):
    if isinstance(obj, (datetime.date, datetime.datetime)):
        return obj.isoformat()
    if hasattr(obj, "item"):  # numpy scalars
        try:
            return obj.item()
        except Exception:  # noqa: BLE001 - any item() that fails: try the encodings below
            pass
    if hasattr(obj, "to_json_dict"):
        return obj.to_json_dict()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


# Both suites' first pass: the counts and observed values, no sample values (a Spark job each).
FIRST = {"result_format": "SUMMARY", "partial_unexpected_count": 0}


MAX_FAILURES = 100_000  # failing rows a run may quarantine; more is a wrong check or bad data


def row_failures(
    df, expectations: list, max_failures: int = MAX_FAILURES, first: FirstPasses | None = None
) -> dict[tuple[int, int], str]:
    """Failing rows of the row-level expectations: ``{(partition, offset): reason}``.

    All row-level expectations run as one GX suite on ``df``; failing rows are those GX finds
    unexpected. A row's reason is its first failing expectation's, in the order GX reports them.
    Raises :class:`TidemarkError` when more than ``max_failures`` rows fail. ``first``: the
    suite's first pass and conditions, if :func:`first_passes` computed them.
    """
    row_level = [e for e in expectations if is_row_level(e)]
    if not row_level:
        return {}
    # Pass 1, SUMMARY: the counts of every expectation. Only the expectations that failed pay
    # for pass 2, which lists their failing rows; the limit is checked before any row index
    # reaches the driver.
    if first is not None and first.rows is not None:
        res, conditions = first.rows, first.conditions
    else:
        _, res = validate(df, suite("tidemark-rows", row_level), FIRST)
        conditions = {}
    failing = []
    for r in res.results:
        cfg = r.expectation_config
        _evaluated(r)
        if r.success:
            continue
        count = (r.result or {}).get("unexpected_count") or 0
        if count > max_failures:
            raise TidemarkError(
                f"{cfg.type}({domain(dict(cfg.kwargs))}): {count} rows fail, more than the "
                f"{max_failures} allowed for quarantine"
            )
        failing.append(cfg)
    if not failing:
        return {}
    if conditions:
        return _listed(df, failing, [conditions[aggregates.key(c)] for c in failing], max_failures)
    result_format = {
        "result_format": "COMPLETE",
        "unexpected_index_column_names": list(_INDEX_COLS),
        "return_unexpected_index_query": False,
        "partial_unexpected_count": 0,
    }
    _, res = validate(
        df, suite("tidemark-rows-failing", [c.to_domain_obj() for c in failing]), result_format
    )
    failures: dict[tuple[int, int], str] = {}
    for r in res.results:  # pass 1 already checked per-expectation counts
        _evaluated(r)
        cfg = r.expectation_config
        etype, kwargs = cfg.type, dict(cfg.kwargs)
        for row in (r.result or {}).get("unexpected_index_list") or []:
            key = (int(row[PARTITION_COL]), int(row[OFFSET_COL]))
            if key not in failures:
                failures[key] = reason(etype, kwargs, row)
        _limit(len(failures), max_failures)
    return failures


def _listed(df, configs: list, conditions: list, max_failures: int) -> dict[tuple[int, int], str]:
    """Pass 2 on GX's own conditions: the failing rows of every failing expectation in one
    Spark job, each with its first expectation's reason (as GX's unexpected index lists)."""
    from pyspark.sql import functions as F

    read = [columns_of(dict(c.kwargs)) for c in configs]
    columns = list(dict.fromkeys(c for cols in read for c in cols))
    hit = conditions[0]
    for c in conditions[1:]:
        hit = hit | c
    flags = [c.alias(f"_tm_unexpected{k}") for k, c in enumerate(conditions)]
    rows = (
        df.where(hit)
        .select(*_INDEX_COLS, *[F.col(c) for c in columns], *flags)
        .limit(max_failures + 1)
        .collect()
    )
    _limit(len(rows), max_failures, "+")
    failures: dict[tuple[int, int], str] = {}
    for row in rows:
        k = next(k for k in range(len(configs)) if row[f"_tm_unexpected{k}"])
        values = {c: row[c] for c in (*_INDEX_COLS, *read[k])}
        failures[(int(row[PARTITION_COL]), int(row[OFFSET_COL]))] = reason(
            configs[k].type, dict(configs[k].kwargs), values
        )
    return failures


def _limit(failed: int, max_failures: int, more: str = "") -> None:
    if failed > max_failures:
        raise TidemarkError(
            f"{failed}{more} rows fail row-level expectations, more than the "
            f"{max_failures} allowed for quarantine"
        )


@dataclass
class GateOutcome:
    """Outcome of a batch-level gate: per-expectation results, GX's raw result, Data Docs page."""

    success: bool
    results: list[dict] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    docs_path: str | None = None

    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["success"]]


def gate(df, expectations: list, docs_dir: str | None, label: str, first=None) -> GateOutcome:
    """Run the batch-level expectations as one GX suite over ``df``; optionally render Data Docs.
    ``first``: the suite and its first (batch, result), if :func:`evaluate` computed them."""
    if not expectations:
        return GateOutcome(success=True)
    # No sample values at first: listing them takes a Spark job per expectation, and a gate
    # that passes is not read value by value. A failed one is: it runs again with them, for
    # its results and its Data Docs page.
    if first is None:
        gate_suite = suite(_safe_name(label), expectations)
        batch, res = validate(df, gate_suite, FIRST)
    else:
        gate_suite, (batch, res) = first
    for r in res.results:
        _evaluated(r)  # first: an expectation GX cannot run is not worth a second validation
    if not res.success:
        batch, res = validate(df, gate_suite, {"result_format": "SUMMARY"})
    results = []
    for r in res.results:
        _evaluated(r)
        cfg = r.expectation_config
        result = r.result or {}
        item: dict[str, Any] = {
            "expectation": cfg.type,
            "kwargs": _json_safe({k: v for k, v in cfg.kwargs.items() if k != "batch_id"}),
            "success": bool(r.success),
            "observed_value": _json_safe(result.get("observed_value")),
        }
        # A column map expectation has no observed value: its counts and GX's sample of the
        # unexpected values (a failed gate's; up to 20) say what it saw (quality/outcomes.py).
        for k in (
            "element_count",
            "missing_count",
            "unexpected_count",
            "unexpected_percent",
            "partial_unexpected_list",
        ):
            if k in result:
                item[k] = _json_safe(result[k])
        results.append(item)
    docs_path = _render_docs(docs_dir, label, batch.id, res) if docs_dir else None
    return GateOutcome(
        success=bool(res.success),
        results=results,
        raw=_json_safe(res.to_json_dict()),
        docs_path=docs_path,
    )


@dataclass
class FirstPasses:
    """What :func:`first_passes` computed: the row suite's first pass with GX's unexpected
    condition of each of its expectations, and the gate's suite with its first (batch,
    result)."""

    rows: Any = None
    conditions: dict = field(default_factory=dict)
    gate: tuple | None = None


def first_passes(df, rows: list, batch: list, label: str) -> FirstPasses | None:
    """The first passes of the row-level expectations over ``df`` and of the batch gate over
    the rows none of them finds unexpected, from one Spark job (tidemark/quality/aggregates.py),
    for :func:`row_failures` and :func:`gate`. None when a metric is not an aggregate known
    there: GX then computes each suite itself (and the gate alone when a row expectation
    passes with unexpected rows)."""
    rows = [e for e in rows if is_row_level(e)]
    if not rows and not batch:
        return None
    row_suite = suite("tidemark-rows", rows) if rows else None
    gate_suite = suite(_safe_name(label), batch) if batch else None
    row_plan = aggregates.plan(df, row_suite, FIRST, None, "r", conditions=True) if rows else None
    if rows and (
        row_plan is None
        or any(aggregates.key(e.configuration) not in row_plan.conditions for e in rows)
    ):
        return None
    kept = None
    if row_plan is not None:
        # every row expectation has its condition (checked above), so there is at least one
        kept = ~functools.reduce(operator.or_, row_plan.conditions.values())
    gate_plan = aggregates.plan(df, gate_suite, FIRST, kept, "g") if batch else None
    if batch and gate_plan is None:
        return None
    columns = [*(row_plan.columns if row_plan else []), *(gate_plan.columns if gate_plan else [])]
    try:
        row = df.agg(*columns).first()
    except TidemarkError:  # SIGTERM (Terminated) and the like: never swallowed
        raise
    except Exception:  # noqa: BLE001 - GX, computing it itself, says which expectation and why
        return None
    out = FirstPasses()
    if row_plan is not None:
        out.rows, out.conditions = aggregates.judge(row_plan, row, "r")[1], row_plan.conditions
    # A row expectation that finds unexpected rows yet passes (`mostly`) quarantines none:
    # they stay in the gate's batch, which the job left them out of.
    tolerated = out.rows is not None and any(
        r.success and (r.result or {}).get("unexpected_count") for r in out.rows.results
    )
    if gate_plan is not None and not tolerated:
        out.gate = (gate_suite, aggregates.judge(gate_plan, row, "g"))
    for res in (out.rows, out.gate[1][1] if out.gate else None):
        if res is not None and any(_gx_error(r) for r in res.results):
            return None
    return out


@dataclass
class OnePass:
    """The row checks and the gate computed by the job that writes the batch: each record's
    first failing row check as a column, and the aggregates both suites need, to be observed
    by that job (``observed``). Great Expectations judges them once it is done
    (:meth:`judged`)."""

    checks: list  # the row checks' configs, in the order GX reports them
    check: Any  # Column: index in ``checks`` of a record's first failure
    observed: list  # Columns: the aggregates, aliased
    rows: aggregates.Plan | None
    gate: aggregates.Plan | None
    gate_suite: Any


@dataclass
class Judged:
    """Whether what the write job did stands, and if not why; if it does, the rows the row
    checks quarantined and the gate's (suite, (batch, result)) for :func:`gate`."""

    stands: bool
    why: str = ""
    failed: int = 0
    gate: tuple | None = None


_ALL, _FAILED = "_tm_records", "_tm_failed"


def one_pass(df, rows: list, batch: list, label: str, domain, check_as: str) -> OnePass | None:
    """The row checks over the rows of ``df`` where ``domain`` holds, and the gate over those
    that no row check finds unexpected, as one job computes them while it writes the batch:
    a record's first failing row check is quarantined by the writer, the gate is judged
    after. None when a metric is not an aggregate known here (the run checks a cached batch
    first instead, tidemark/driver/gate.py).

    ``check`` is to be added to ``df`` as column ``check_as`` before the aggregates are
    observed: they read it rather than evaluate every row check again in each of them."""
    from pyspark.sql import functions as F

    rows = [e for e in rows if is_row_level(e)]
    if not rows and not batch:
        return None
    row_plan = (
        aggregates.plan(df, suite("tidemark-rows", rows), FIRST, domain, "r", conditions=True)
        if rows
        else None
    )
    if rows and (row_plan is None or set(row_plan.order) != set(row_plan.conditions)):
        return None
    gate_suite = suite(_safe_name(label), batch) if batch else None
    kept, check, failed = domain, None, F.lit(None)
    if row_plan is not None:
        for i, k in enumerate(row_plan.order):
            cond = row_plan.conditions[k]
            check = F.when(cond, F.lit(i)) if check is None else check.when(cond, F.lit(i))
        # Null outside the domain and where every row check passes.
        check, failed = F.when(domain, check), F.col(check_as)
        kept = domain & failed.isNull()
    gate_plan = aggregates.plan(df, gate_suite, FIRST, kept, "g") if batch else None
    if batch and gate_plan is None:
        return None
    observed = [
        *(row_plan.columns if row_plan else []),
        *(gate_plan.columns if gate_plan else []),
        F.count(F.lit(1)).alias(_ALL),
        F.count(failed).alias(_FAILED),
    ]
    by_key = {aggregates.key(e.configuration): e.configuration for e in rows}
    return OnePass(
        [by_key[k] for k in (row_plan.order if row_plan else [])],
        check,
        observed,
        row_plan,
        gate_plan,
        gate_suite,
    )


def judged(p: OnePass, values, records: int, max_failures: int = MAX_FAILURES) -> Judged:
    """GX's verdicts on the values the write job observed (``values``; it read ``records``
    records). The write stands only if it did what checking first would have done: every row
    check that finds a row fails (so each such row is quarantined), none beyond the limit, and
    the gate passes. Otherwise (or if GX cannot evaluate an expectation) the run checks a
    cached batch and writes again."""
    if values[_ALL] != records:  # a stage ran twice and counted its rows twice
        return Judged(False, f"the checks counted {values[_ALL]:,} records, the writes {records:,}")
    out = Judged(True, failed=values[_FAILED])
    if p.rows is not None:
        res = aggregates.judge(p.rows, values, "r")[1]
        if [aggregates.key(r.expectation_config) for r in res.results] != p.rows.order:
            return Judged(False, "GX reported the row checks in another order")
        for r in res.results:
            count = (r.result or {}).get("unexpected_count") or 0
            if _gx_error(r):
                return Judged(False, "GX could not evaluate a row check")
            if r.success and count:
                return Judged(
                    False,
                    f"a row check passes with {count:,} unexpected rows "
                    f"(`mostly`): they stay in the batch",
                )
            if count > max_failures:
                return Judged(False, f"{count:,} rows fail a row check")
        if out.failed > max_failures:
            return Judged(False, f"{out.failed:,} rows fail the row checks")
    if p.gate is not None:
        out.gate = (p.gate_suite, aggregates.judge(p.gate, values, "g"))
        res = out.gate[1][1]
        if any(_gx_error(r) for r in res.results):
            return Judged(False, "GX could not evaluate a gate expectation")
        if not res.success:
            return Judged(False, "the gate failed")
    return out
