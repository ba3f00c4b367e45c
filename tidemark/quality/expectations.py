"""Expectations as pipeline files write them, ``{snake_case_gx_name: {kwargs}}``, turned into
real Great Expectations 1.x objects; which are row-level, which columns they read.

GX is imported lazily (importing it costs seconds) and never phones home: analytics are
switched off through the environment before the first import.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import threading

from tidemark.core.errors import ConfigError
from tidemark.core.text import shown

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

VALUE_REPR_MAX = 60
lock = threading.RLock()  # GX contexts are not thread-safe; one lock for every use


def _gx():
    """Import GX (once) with analytics disabled; returns the ``great_expectations`` module."""
    os.environ["GX_ANALYTICS_ENABLED"] = "false"
    import great_expectations as gx

    return gx


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _registry() -> dict[str, type]:
    """snake_case expectation name -> GX expectation class (from ``great_expectations.expectations``)."""
    with lock:
        return _expectation_classes()


@functools.cache
def _expectation_classes() -> dict[str, type]:
    _gx()
    import great_expectations.expectations as gxe
    from great_expectations.expectations.expectation import Expectation

    classes = {}
    for attr in dir(gxe):
        obj = getattr(gxe, attr)
        if isinstance(obj, type) and issubclass(obj, Expectation) and attr.startswith("Expect"):
            classes[getattr(obj, "expectation_type", None) or _snake(attr)] = obj
    return classes


def _pydantic_problem(name: str, exc: Exception) -> str:
    """One readable line from a pydantic (v1) ValidationError, naming the arguments."""
    try:
        errors = exc.errors()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a pydantic error: its own message then
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
                f"got {shown(item, VALUE_REPR_MAX)}",
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
                where,
                f"{name}: arguments must be a mapping, got {shown(kwargs, VALUE_REPR_MAX)}",
                path,
            )
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise ConfigError(where, f"{name}: argument names must be strings: {bad!r}", path)
        try:
            out.append(reg[name](**kwargs))
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError or a validator's own
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
