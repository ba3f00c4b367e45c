"""Tidemark's metrics, sent through Airflow's own metrics layer (``airflow.sdk.observability.
stats``: StatsD, Datadog or OpenTelemetry, whichever ``[metrics]`` turns on; nothing when
none is). docs/operations.md lists each metric and the alert it should drive.

Emitted from Airflow's task processes only, where Airflow has set that layer up: the run's
own numbers by the ``report`` task after the Spark job (which runs in spark-submit's child
process, perhaps on a cluster, where Airflow's metrics are not configured), read from the
ledger that the job wrote them to; the gauges of lag, prepared transactions and dead letters by
the maintenance ``check`` every 5 minutes.

Names carry their labels, ``tidemark.<metric>.<pipeline>[.<sink>[.<partition or class>]]``
(StatsD has no tags); the same labels also go as tags, for backends that have them.
"""

from __future__ import annotations

import logging

from tidemark.ledger.dlq import ERROR_CLASSES
from tidemark.ledger.run_state import RunState
from tidemark.ledger.runs import SinkRun, StartedRun

log = logging.getLogger(__name__)
PREFIX = "tidemark"


def _stats():
    from airflow.sdk.observability.stats import Stats

    return Stats


def _name(metric: str, *labels: object) -> str:
    return ".".join([PREFIX, metric, *(str(x) for x in labels)])


def emit_run(pipeline: str, run: StartedRun, sinks: list[SinkRun]) -> int:
    """A finished run's numbers (``runs.of_dag_run``): per sink its records delivered and
    quarantined (committed sinks only: nothing else reached the sink), its outcome and its
    phase timings; the run's duration. Returns how many metrics were sent."""
    stats, sent = _stats(), 0
    for s in sinks:
        tags = {"pipeline": pipeline, "sink": s.sink}
        stats.incr(
            _name("sink_runs", pipeline, s.sink, s.state), tags={**tags, "state": str(s.state)}
        )
        sent += 1
        if s.state is not RunState.COMMITTED:
            continue
        stats.incr(_name("records_delivered", pipeline, s.sink), s.counts.rows, tags=tags)
        stats.incr(_name("records_quarantined", pipeline, s.sink), s.counts.dead, tags=tags)
        sent += 2
        for phase, seconds in sorted((s.timings or {}).items()):
            if phase.endswith("_seconds") and isinstance(seconds, int | float):
                stats.timing(
                    _name("phase", pipeline, s.sink, phase.removesuffix("_seconds")),
                    seconds * 1000.0,
                    tags={**tags, "phase": phase},
                )
                sent += 1
    start, end = run.created_at, run.finished_at
    if end is not None:
        stats.timing(
            _name("run_duration", pipeline),
            (end - start).total_seconds() * 1000.0,
            tags={"pipeline": pipeline, "mode": run.mode},
        )
        sent += 1
    return sent


def emit_health(
    lags: dict[str, list],
    prepared_oldest_seconds: float,
    dead_letters: dict[str, dict[str, int]],
    pipelines: list[str],
) -> int:
    """The maintenance gauges: checkpoint lag (records) and oldest undelivered record age
    (seconds) per pipeline, sink and partition; the oldest prepared transaction's age
    (seconds, 0 when none); live dead letters per pipeline and error class (0 included, so a
    gauge falls back when letters are redriven or discarded)."""
    stats, sent = _stats(), 0
    for pipeline, items in lags.items():
        for x in items:
            tags = {"pipeline": pipeline, "sink": x.sink, "partition": str(x.partition)}
            stats.gauge(
                _name("checkpoint_lag", pipeline, x.sink, x.partition), x.records, tags=tags
            )
            stats.gauge(
                _name("oldest_undelivered_age", pipeline, x.sink, x.partition),
                round(x.age_seconds(), 3),
                tags=tags,
            )
            sent += 2
    stats.gauge(_name("prepared_oldest_age"), round(prepared_oldest_seconds, 3))
    sent += 1
    for pipeline in pipelines:
        counts = dead_letters.get(pipeline, {})
        for cls in ERROR_CLASSES:
            stats.gauge(
                _name("dead_letters", pipeline, cls),
                counts.get(cls, 0),
                tags={"pipeline": pipeline, "error_class": cls},
            )
            sent += 1
    return sent


def safely(fn, *args) -> None:
    """Metrics never fail the task that sends them: a problem is logged in one line."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - metrics never fail the task
        log.warning("tidemark metrics not sent: %s: %s", type(exc).__name__, exc)
