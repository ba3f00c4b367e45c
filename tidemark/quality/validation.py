"""Great Expectations' process-wide ephemeral context: one Spark batch definition that takes
any DataFrame, suites built from Tidemark's expectation objects, and validation."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tidemark.core.errors import TidemarkError
from tidemark.quality.expectations import _gx
from tidemark.quality.expectations import lock as _lock


@dataclasses.dataclass(frozen=True)
class Workspace:
    """GX's ephemeral context of this process and its Spark batch definition, which takes any
    DataFrame (datasource ``tidemark``, asset ``records``, batch definition ``whole``)."""

    context: Any
    batch_definition: Any


@functools.cache
def _built() -> Workspace:
    gx = _gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    # persist=False: the caller caches the DataFrame; GX must not persist (and leak) it.
    ds = ctx.data_sources.add_spark(name="tidemark", persist=False)
    asset = ds.add_dataframe_asset(name="records")
    return Workspace(ctx, asset.add_batch_definition_whole_dataframe("whole"))


def workspace() -> Workspace:
    """The process's GX workspace, built once (under GX's lock: contexts are not thread-safe)."""
    with _lock:
        return _built()


def batch_definition():
    """The process-wide ephemeral context's Spark whole-dataframe batch definition."""
    return workspace().batch_definition


def suite(name: str, expectations: list):
    """A fresh ExpectationSuite holding copies of the expectations (caller's objects untouched)."""
    batch_definition()  # the suite resolves GX's current context; make sure it exists
    gx = _gx()
    copies = [exp.copy(deep=True, update={"id": None}) for exp in expectations]
    suite = gx.ExpectationSuite(name=name, expectations=copies)
    if len(suite.expectations) != len(copies):
        raise TidemarkError(f"GX rejected an expectation of suite {name!r} (see the log)")
    return suite


def validate(df, suite, result_format):
    batch = batch_definition().get_batch(batch_parameters={"dataframe": df})
    return batch, batch.validate(suite, result_format=result_format)
