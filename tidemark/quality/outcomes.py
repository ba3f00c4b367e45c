"""What a gate's expectation observed, in words: "observed 300" for an aggregate, "12 of 480
values (2.5%) not in the set; e.g. 'x', 'y'" for a column map expectation, whose GX result
has counts and sample values instead of an observed value. Plain Python, no GX: the CLI's
status, `dq show` and a failed gate's error line all say it so."""

from __future__ import annotations

import json

from tidemark.core.text import clamp, literal

SAMPLES = 3  # sample values a line names
# What an unexpected value is, per expectation; others are "unexpected".
_WHAT = {
    "expect_column_values_to_be_in_set": "not in the set",
    "expect_column_values_to_not_be_in_set": "in the forbidden set",
    "expect_column_values_to_not_be_null": "null",
    "expect_column_values_to_be_null": "not null",
    "expect_column_values_to_be_unique": "not unique",
    "expect_column_values_to_be_between": "out of range",
    "expect_column_values_to_match_regex": "not matching",
    "expect_column_values_to_not_match_regex": "matching the forbidden pattern",
}


def observed(result: dict, limit: int = 160) -> str:
    """``result``: one expectation's stored result (tidemark.dq_results.results: observed_value,
    and for column map expectations unexpected_count, unexpected_percent, element_count,
    missing_count, partial_unexpected_list)."""
    value = result.get("observed_value")
    if value is None and result.get("unexpected_count") is not None:
        return clamp(_unexpected(result), limit)
    if value is None:
        return "observed nothing"
    shown = json.dumps(value, default=str) if isinstance(value, dict) else literal(value, limit)
    return clamp(f"observed {shown}", limit)


def _unexpected(result: dict) -> str:
    etype = result.get("expectation", "")
    n = int(result["unexpected_count"])
    total = result.get("element_count")
    if total is not None and etype != "expect_column_values_to_not_be_null":
        total -= result.get("missing_count") or 0  # GX counts the share of non-null values
    out = (
        f"{n:,} of {total:,} values" if total is not None else f"{n:,} value{'' if n == 1 else 's'}"
    )
    if result.get("unexpected_percent") is not None:
        out += f" ({float(result['unexpected_percent']):.3g}%)"
    out += f" {_WHAT.get(etype, 'unexpected')}"
    samples = list(
        dict.fromkeys(
            json.dumps(v, default=str) for v in result.get("partial_unexpected_list") or []
        )
    )
    if samples and etype != "expect_column_values_to_not_be_null":
        out += "; e.g. " + ", ".join(literal(json.loads(s), 40) for s in samples[:SAMPLES])
    return out
