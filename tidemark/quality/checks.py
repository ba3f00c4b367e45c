"""Data quality checks with Great Expectations 1.x over a Spark DataFrame.

* :func:`row_failures` runs the *row-level* (column map) expectations as one suite and
  returns the failing rows keyed by ``(_tm_partition, _tm_offset)``;
* :func:`gate` runs any expectations as one suite and optionally renders Data Docs
  (quality/docs.py).

The ephemeral context used for validation is created once per process; no cloud mode is
ever used.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tidemark.core.errors import TidemarkError
from tidemark.core.text import clamp, shown
from tidemark.quality.docs import _render_docs, _safe_name
from tidemark.quality.expectations import VALUE_REPR_MAX as _VALUE_REPR_MAX
from tidemark.quality.expectations import _gx, is_row_level
from tidemark.quality.expectations import lock as _lock

PARTITION_COL = "_tm_partition"
OFFSET_COL = "_tm_offset"
_INDEX_COLS = [PARTITION_COL, OFFSET_COL]
_state: dict[str, Any] = {}


def _batch_definition():
    """The process-wide ephemeral context's Spark whole-dataframe batch definition."""
    with _lock:
        bd = _state.get("batch_definition")
        if bd is None:
            gx = _gx()
            from great_expectations.data_context.types.base import ProgressBarsConfig

            ctx = gx.get_context(mode="ephemeral")
            ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
            # persist=False: the caller caches the DataFrame; GX must not persist (and leak) it.
            ds = ctx.data_sources.add_spark(name="tidemark", persist=False)
            asset = ds.add_dataframe_asset(name="records")
            bd = asset.add_batch_definition_whole_dataframe("whole")
            _state["context"] = ctx
            _state["batch_definition"] = bd
        return bd


def _suite(name: str, expectations: list):
    """A fresh ExpectationSuite holding copies of the expectations (caller's objects untouched)."""
    _batch_definition()  # the suite resolves GX's current context; make sure it exists
    gx = _gx()
    copies = [exp.copy(deep=True, update={"id": None}) for exp in expectations]
    suite = gx.ExpectationSuite(name=name, expectations=copies)
    if len(suite.expectations) != len(copies):
        raise TidemarkError(f"GX rejected an expectation of suite {name!r} (see the log)")
    return suite


def _validate(df, suite, result_format):
    batch = _batch_definition().get_batch(batch_parameters={"dataframe": df})
    return batch, batch.validate(suite, result_format=result_format)


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
    return lines[0][starts[-1]:] if starts else lines[0].removeprefix("Error: ")


def _evaluated(result) -> None:
    """Raises when GX could not evaluate the expectation of ``result``: an expectation that
    cannot run is a pipeline error, never a verdict on the data (a row check that failed to
    run must not pass every row)."""
    err = _gx_error(result)
    if err is not None:
        cfg = result.expectation_config
        raise TidemarkError(f"{cfg.type}({_domain(dict(cfg.kwargs))}): GX could not evaluate "
                            f"it: {err}")


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
        except Exception:
            pass
    if hasattr(obj, "to_json_dict"):
        return obj.to_json_dict()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def _domain(kwargs: dict) -> str:
    if "column" in kwargs:
        return f"column={kwargs['column']}"
    if "column_A" in kwargs:
        return f"column_A={kwargs['column_A']}, column_B={kwargs.get('column_B')}"
    if "column_list" in kwargs:
        return f"column_list={','.join(map(str, kwargs['column_list']))}"
    return ""


def _reason(etype: str, kwargs: dict, row: dict) -> str:
    head = f"{etype}({_domain(kwargs)})"
    if "column" in kwargs:
        value = row.get(kwargs["column"])
        seen = shown(value, _VALUE_REPR_MAX)
        if etype == "expect_column_values_to_be_in_set":
            return f"{head}: {seen} not in set"
        if etype == "expect_column_values_to_not_be_in_set":
            return f"{head}: {seen} in forbidden set"
        if etype == "expect_column_values_to_not_be_null":
            return f"{head}: null value"
        return f"{head}: unexpected value {seen}"
    values = {k: v for k, v in row.items() if k not in _INDEX_COLS}
    return f"{head}: unexpected values {shown(values, _VALUE_REPR_MAX)}"


def row_failures(df, expectations: list, max_failures: int = 100_000) -> dict[tuple[int, int], str]:
    """Failing rows of the row-level expectations: ``{(partition, offset): reason}``.

    All row-level expectations run as one GX suite on ``df``; failing rows are identified by GX's
    ``unexpected_index_column_names``.  The first failing expectation (in the given order) gives a
    row's reason.  Raises :class:`TidemarkError` when more than ``max_failures`` rows fail.
    """
    row_level = [e for e in expectations if is_row_level(e)]
    if not row_level:
        return {}
    # Pass 1, SUMMARY: GX bundles the counts of every expectation into few Spark jobs. Only
    # the expectations that failed pay for pass 2, which lists their failing rows; the limit
    # is checked before any row index reaches the driver.
    _, first = _validate(df, _suite("tidemark-rows", row_level),
                         {"result_format": "SUMMARY", "partial_unexpected_count": 0})
    failing = []
    for r in first.results:
        cfg = r.expectation_config
        _evaluated(r)
        if r.success:
            continue
        count = (r.result or {}).get("unexpected_count") or 0
        if count > max_failures:
            raise TidemarkError(
                f"{cfg.type}({_domain(dict(cfg.kwargs))}): {count} rows fail, more than the "
                f"{max_failures} allowed for quarantine"
            )
        failing.append(cfg.to_domain_obj())
    if not failing:
        return {}
    result_format = {
        "result_format": "COMPLETE",
        "unexpected_index_column_names": list(_INDEX_COLS),
        "return_unexpected_index_query": False,
        "partial_unexpected_count": 0,
    }
    _, res = _validate(df, _suite("tidemark-rows-failing", failing), result_format)
    failures: dict[tuple[int, int], str] = {}
    for r in res.results:  # pass 1 already checked per-expectation counts
        _evaluated(r)
        cfg = r.expectation_config
        etype, kwargs = cfg.type, dict(cfg.kwargs)
        for row in (r.result or {}).get("unexpected_index_list") or []:
            key = (int(row[PARTITION_COL]), int(row[OFFSET_COL]))
            if key not in failures:
                failures[key] = _reason(etype, kwargs, row)
        if len(failures) > max_failures:
            raise TidemarkError(
                f"{len(failures)} rows fail row-level expectations, more than the "
                f"{max_failures} allowed for quarantine"
            )
    return failures


@dataclass
class GateOutcome:
    """Outcome of a batch-level gate: per-expectation results, GX's raw result, Data Docs page."""

    success: bool
    results: list[dict] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    docs_path: str | None = None

    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["success"]]


def gate(df, expectations: list, docs_dir: str | None, label: str) -> GateOutcome:
    """Run the batch-level expectations as one GX suite over ``df``; optionally render Data Docs."""
    if not expectations:
        return GateOutcome(success=True)
    suite = _suite(_safe_name(label), expectations)
    # No sample values at first: listing them takes a Spark job per expectation, and a gate
    # that passes is not read value by value. A failed one is: it runs again with them, for
    # its results and its Data Docs page.
    batch, res = _validate(df, suite, {"result_format": "SUMMARY", "partial_unexpected_count": 0})
    for r in res.results:
        _evaluated(r)  # first: an expectation GX cannot run is not worth a second validation
    if not res.success:
        batch, res = _validate(df, suite, {"result_format": "SUMMARY"})
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
        for k in ("unexpected_count", "unexpected_percent"):
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
