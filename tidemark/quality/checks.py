"""Data quality with Great Expectations 1.x: row-level quarantine and batch-level gates.

Expectations come from a pipeline YAML as ``{snake_case_gx_name: {kwargs}}`` items and are turned
into real GX expectation objects (:func:`parse_expectations`).  Two uses:

* :func:`row_failures` runs the *row-level* (column map) expectations as one suite over a Spark
  DataFrame and returns the failing rows keyed by ``(_tm_partition, _tm_offset)``;
* :func:`gate` runs any expectations as one suite over the DataFrame and optionally renders GX
  Data Docs (HTML) for the validation into a file-system GX project rooted at ``docs_dir``.

GX is imported lazily (importing it costs seconds) and never phones home: analytics are switched
off through the environment before the first import, and no cloud mode is ever used.  The
ephemeral context used for validation is created once per process, as is each docs context.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tidemark.core.errors import ConfigError, TidemarkError

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

PARTITION_COL = "_tm_partition"
OFFSET_COL = "_tm_offset"
_INDEX_COLS = [PARTITION_COL, OFFSET_COL]
_VALUE_REPR_MAX = 60

_lock = threading.RLock()
_state: dict[str, Any] = {}
_docs_contexts: dict[str, Any] = {}


def _gx():
    """Import GX (once) with analytics disabled; returns the ``great_expectations`` module."""
    os.environ["GX_ANALYTICS_ENABLED"] = "false"
    import great_expectations as gx

    return gx


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _registry() -> dict[str, type]:
    """snake_case expectation name -> GX expectation class (from ``great_expectations.expectations``)."""
    with _lock:
        reg = _state.get("registry")
        if reg is None:
            _gx()
            import great_expectations.expectations as gxe
            from great_expectations.expectations.expectation import Expectation

            reg = {}
            for attr in dir(gxe):
                obj = getattr(gxe, attr)
                if (
                    isinstance(obj, type)
                    and issubclass(obj, Expectation)
                    and attr.startswith("Expect")
                ):
                    reg[getattr(obj, "expectation_type", None) or _snake(attr)] = obj
            _state["registry"] = reg
        return reg


def _pydantic_problem(name: str, exc: Exception) -> str:
    """One readable line from a pydantic (v1) ValidationError, naming the arguments."""
    try:
        errors = exc.errors()  # type: ignore[attr-defined]
    except Exception:  # not a pydantic error
        return f"{name}: {exc}"
    seen: dict[str, list[str]] = {}
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(arguments)"
        msg = err.get("msg", "invalid")
        if msg == "extra fields not permitted":
            msg = "unknown argument"
        elif msg == "field required":
            msg = "missing required argument"
        msgs = seen.setdefault(loc, [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{loc}: {' or '.join(msgs[:3])}" for loc, msgs in seen.items()]
    return f"{name}: bad arguments: " + "; ".join(parts)


def parse_expectations(items: list, where: str, field: str) -> list:
    """Turn YAML items ``{expect_x: {kwargs}}`` into GX expectation objects.

    Raises :class:`ConfigError` naming ``field[i]`` for an unknown expectation (with the closest
    names), an item that is not a one-key mapping, or bad/missing arguments.
    """
    if items is None:
        return []
    if not isinstance(items, list):
        raise ConfigError(where, "must be a list of {expectation_name: {arguments}}", field)
    reg = _registry()
    out = []
    for i, item in enumerate(items):
        path = f"{field}[{i}]"
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(
                where,
                "must be a one-key mapping {expectation_name: {arguments}}, "
                f"got {_clamp(repr(item))}",
                path,
            )
        ((name, kwargs),) = item.items()
        if not isinstance(name, str) or name not in reg:
            close = difflib.get_close_matches(str(name), list(reg), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(where, f"unknown expectation {name!r}{hint}", path)
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise ConfigError(
                where, f"{name}: arguments must be a mapping, got {_clamp(repr(kwargs))}", path
            )
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise ConfigError(where, f"{name}: argument names must be strings: {bad!r}", path)
        try:
            out.append(reg[name](**kwargs))
        except Exception as exc:  # pydantic ValidationError, or a validator's ValueError
            raise ConfigError(where, _pydantic_problem(name, exc), path) from None
    return out


def is_row_level(expectation) -> bool:
    """True for map expectations (values checked row by row), False for aggregate ones."""
    _gx()
    from great_expectations.expectations.expectation import (
        ColumnMapExpectation,
        ColumnPairMapExpectation,
        MulticolumnMapExpectation,
    )

    return isinstance(
        expectation, (ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation)
    )


_TABLE_ROWS_ONLY = {"expect_table_row_count_to_be_between", "expect_table_row_count_to_equal"}


def columns_read(expectations: list) -> set[str] | None:
    """The columns these expectations read, or None when one may read the whole table.

    Column, column-pair and multicolumn expectations read only their own columns, row counts
    read none; anything else (table-level checks, row conditions) may read every column.
    """
    _gx()
    from great_expectations.expectations.expectation import (
        ColumnAggregateExpectation,
        ColumnMapExpectation,
        ColumnPairMapExpectation,
        MulticolumnMapExpectation,
    )

    used: set[str] = set()
    for e in expectations:
        if getattr(e, "row_condition", None):
            return None
        if isinstance(e, (ColumnMapExpectation, ColumnAggregateExpectation)):
            used.add(e.column)
        elif isinstance(e, ColumnPairMapExpectation):
            used.update((e.column_A, e.column_B))
        elif isinstance(e, MulticolumnMapExpectation):
            used.update(e.column_list)
        elif e.expectation_type not in _TABLE_ROWS_ONLY:
            return None
    return used


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


def _clamp(text: str, limit: int = _VALUE_REPR_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        shown = _clamp(repr(value))
        if etype == "expect_column_values_to_be_in_set":
            return f"{head}: {shown} not in set"
        if etype == "expect_column_values_to_not_be_in_set":
            return f"{head}: {shown} in forbidden set"
        if etype == "expect_column_values_to_not_be_null":
            return f"{head}: null value"
        return f"{head}: unexpected value {shown}"
    values = {k: v for k, v in row.items() if k not in _INDEX_COLS}
    return f"{head}: unexpected values {_clamp(repr(values))}"


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
        if r.exception_info and r.exception_info.get("raised_exception"):
            raise TidemarkError(
                f"{cfg.type}({_domain(dict(cfg.kwargs))}): GX could not evaluate it: "
                f"{_clamp(str(r.exception_info.get('exception_message')), 300)}"
            )
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
    for r in res.results:  # pass 1 already checked errors and per-expectation counts
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


def _docs_context(docs_dir: str):
    """A file-system GX project rooted at ``docs_dir`` (one per directory per process)."""
    root = os.path.abspath(docs_dir)
    with _lock:
        ctx = _docs_contexts.get(root)
        if ctx is None:
            gx = _gx()
            os.makedirs(root, exist_ok=True)
            ctx = gx.get_context(mode="file", project_root_dir=root)
            _docs_contexts[root] = ctx
        return ctx


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "gate"


def _render_docs(docs_dir: str, label: str, batch_id: str, res) -> str:
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )

    ctx = _docs_context(docs_dir)
    name = _safe_name(label)
    run_id = RunIdentifier(run_name=name, run_time=datetime.datetime.now(datetime.UTC))
    key = ValidationResultIdentifier(
        expectation_suite_identifier=ExpectationSuiteIdentifier(name=name),
        run_id=run_id,
        batch_identifier=batch_id,
    )
    res.meta["run_id"] = run_id
    with _lock:
        ctx.validation_results_store.set(key, res)
        # Only this run's page: the index lists every stored validation, so rebuilding it in
        # each run would cost more with every run (`tidemark dq docs` rebuilds it).
        ctx.build_data_docs(resource_identifiers=[key], build_index=False)
        urls = ctx.get_docs_sites_urls(resource_identifier=key)
    for site in urls:
        url = site.get("site_url")
        if url:
            return url.removeprefix("file://")
    return _index_page(docs_dir)


def _index_page(docs_dir: str) -> str:
    return os.path.join(os.path.abspath(docs_dir), "gx", "uncommitted", "data_docs",
                        "local_site", "index.html")


def build_docs_index(docs_dir: str) -> tuple[str, int]:
    """Rebuild the Data Docs index page of ``docs_dir``: (its path, validations it lists)."""
    ctx = _docs_context(docs_dir)
    with _lock:
        count = len(ctx.validation_results_store.list_keys())
        ctx.build_data_docs()
    return _index_page(docs_dir), count


def gate(df, expectations: list, docs_dir: str | None, label: str) -> GateOutcome:
    """Run the batch-level expectations as one GX suite over ``df``; optionally render Data Docs."""
    if not expectations:
        return GateOutcome(success=True)
    suite = _suite(_safe_name(label), expectations)
    batch, res = _validate(df, suite, {"result_format": "SUMMARY"})
    results = []
    for r in res.results:
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
        if r.exception_info and r.exception_info.get("raised_exception"):
            item["exception"] = _clamp(str(r.exception_info.get("exception_message")), 300)
        results.append(item)
    docs_path = _render_docs(docs_dir, label, batch.id, res) if docs_dir else None
    return GateOutcome(
        success=bool(res.success),
        results=results,
        raw=_json_safe(res.to_json_dict()),
        docs_path=docs_path,
    )
