"""The reader's own time, per phase (``read``: the source's next batch, ``decode``: Arrow's
JSON parse), summed from Spark's Python workers back to the driver by an accumulator.

A write task only sees how long it waited for Spark (``read_transform``); this says how much
of that the reader spent, in the reader's process, beside the task (docs/operations.md,
"Where the time goes"). Imported where PySpark is: the driver building a run's DataFrame,
and the workers that read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.accumulators import AccumulatorParam

if TYPE_CHECKING:
    from pyspark import Accumulator, SparkContext

Seconds = dict[str, float]


class Sum(AccumulatorParam[Seconds]):
    def zero(self, value: Seconds) -> Seconds:
        return {}

    def addInPlace(self, value1: Seconds, value2: Seconds) -> Seconds:
        for phase, seconds in value2.items():
            value1[phase] = value1.get(phase, 0.0) + seconds
        return value1


_CLOCKS: dict[int, Accumulator[Seconds]] = {}  # one per SparkContext


def clock(sc: SparkContext) -> Accumulator[Seconds]:
    """The context's reader clock: it only grows, so a run reads what it added (:func:`since`)."""
    key = id(sc)
    if key not in _CLOCKS:
        _CLOCKS[key] = sc.accumulator({}, Sum())
    return _CLOCKS[key]


def since(sc: SparkContext, before: Seconds) -> Seconds:
    now = clock(sc).value
    return {k: round(v - before.get(k, 0.0), 3) for k, v in now.items()}
