"""A failing row's reason, as its dead letter states it: the expectation, its columns and the
offending value. Plain Python, no Great Expectations: Spark tasks write these reasons too
(tidemark/engine/sink_task.py) when the write job itself finds the failing rows."""

from __future__ import annotations

from tidemark.core.columns import OFFSET as OFFSET_COL
from tidemark.core.columns import PARTITION as PARTITION_COL
from tidemark.core.text import clamp, literal
from tidemark.quality.expectations import VALUE_REPR_MAX

INDEX_COLS = [PARTITION_COL, OFFSET_COL]
# The kwargs that name an expectation's columns: all a reason needs of them.
COLUMN_KWARGS = ("column", "column_A", "column_B", "column_list")


def domain(kwargs: dict) -> str:
    if "column" in kwargs:
        return f"column={kwargs['column']}"
    if "column_A" in kwargs:
        return f"column_A={kwargs['column_A']}, column_B={kwargs.get('column_B')}"
    if "column_list" in kwargs:
        return f"column_list={','.join(map(str, kwargs['column_list']))}"
    return ""


def columns_of(kwargs: dict) -> list[str]:
    """The columns an expectation reads, in its own order (a reason prints them so)."""
    if "column" in kwargs:
        return [kwargs["column"]]
    if "column_A" in kwargs:
        return [kwargs["column_A"], kwargs["column_B"]]
    return list(kwargs.get("column_list") or [])


def reason(etype: str, kwargs: dict, row: dict) -> str:
    """``row``: the failing row's index columns and the columns the expectation reads. Values
    read as a user writes them (-98.12, 'text', NULL), never as Python reprs."""
    head = f"{etype}({domain(kwargs)})"
    if "column" in kwargs:
        value = row.get(kwargs["column"])
        seen = literal(value, VALUE_REPR_MAX)
        if etype == "expect_column_values_to_be_in_set":
            return f"{head}: {seen} not in set"
        if etype == "expect_column_values_to_not_be_in_set":
            return f"{head}: {seen} in forbidden set"
        if etype == "expect_column_values_to_not_be_null":
            return f"{head}: null value"
        return f"{head}: unexpected value {seen}"
    values = ", ".join(
        f"{k} = {literal(v, VALUE_REPR_MAX)}" for k, v in row.items() if k not in INDEX_COLS
    )
    return f"{head}: unexpected values {clamp(values, 2 * VALUE_REPR_MAX)}"
