-- What the Pipelines page (tidemark/web/pipelines_pages.py) charts over time.
-- Lag: per sink and partition, the source's settled end (head) against the sink's
-- checkpoint, as the maintenance DAG measures it (tidemark/driver/lag.py). The ledger keeps
-- every checkpoint a run moved (run_ranges), but not where the source was: only a
-- measurement knows. One measurement's rows share `at`. Pruned with the runs' retention
-- (ledger/history.py).
CREATE TABLE tidemark.lag_samples (
    pipeline   text        NOT NULL,
    sink       text        NOT NULL,
    partition  int         NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    checkpoint bigint      NOT NULL,
    head       bigint      NOT NULL
);
-- INCLUDE: the charts read the index alone (90 days of 20 pipelines: half a million rows).
CREATE INDEX lag_samples_by_time ON tidemark.lag_samples (pipeline, at)
    INCLUDE (sink, partition, checkpoint, head);
CREATE INDEX lag_samples_age ON tidemark.lag_samples (at);

-- The page's other series, read by time per pipeline: runs (durations, records per second
-- from run_metrics) and dead letters created (per error class).
CREATE INDEX runs_by_time ON tidemark.runs (pipeline, created_at);
CREATE INDEX dlq_created ON tidemark.dlq (pipeline, first_seen) INCLUDE (error_class, sink);
