-- Tidemark ledger, version 1: checkpoints, runs and their state machine, participants,
-- leases with fencing epochs, the dead-letter queue and run metrics.

CREATE SCHEMA IF NOT EXISTS tidemark;

CREATE TYPE tidemark.run_state AS ENUM (
    'planned', 'writing', 'prepared', 'committing', 'committed', 'aborted', 'dq_failed');

CREATE TYPE tidemark.error_class AS ENUM (
    'decode', 'transform', 'validation', 'dq_gate', 'sink_write');

CREATE TYPE tidemark.dlq_status AS ENUM ('quarantined', 'redriven', 'discarded');

CREATE TABLE tidemark.pipelines (
    name          text PRIMARY KEY,
    config        jsonb NOT NULL DEFAULT '{}',
    -- Set when the pipeline must not run until an operator looks (a lost prepared transaction).
    halted_reason text,
    halted_at     timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- The next offset each sink still has to receive, per source partition.
CREATE TABLE tidemark.checkpoints (
    pipeline    text   NOT NULL REFERENCES tidemark.pipelines(name),
    sink        text   NOT NULL,
    partition   int    NOT NULL,
    next_offset bigint NOT NULL CHECK (next_offset >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  bigint,
    PRIMARY KEY (pipeline, sink, partition)
);

-- A job: one Spark application that reads once and writes to one or more sinks.
CREATE TABLE tidemark.runs (
    run_id      bigserial PRIMARY KEY,
    pipeline    text NOT NULL REFERENCES tidemark.pipelines(name),
    mode        text NOT NULL CHECK (mode IN ('run', 'backfill', 'redrive')),
    delivery    text NOT NULL DEFAULT 'exactly_once'
                CHECK (delivery IN ('exactly_once', 'at_least_once')),
    owner       text NOT NULL,           -- host:pid of the driver
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    external_id text                     -- e.g. the Airflow dag_id/run_id/task that started it
);

-- The state machine lives per (run, sink): sinks decide and advance independently.
CREATE TABLE tidemark.run_sinks (
    run_id      bigint NOT NULL REFERENCES tidemark.runs(run_id),
    sink        text   NOT NULL,
    state       tidemark.run_state NOT NULL DEFAULT 'planned',
    lease_epoch bigint NOT NULL,
    error       text,
    counts      jsonb NOT NULL DEFAULT '{}',
    timings     jsonb NOT NULL DEFAULT '{}',
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sink)
);
CREATE INDEX run_sinks_open ON tidemark.run_sinks (state)
    WHERE state IN ('planned', 'writing', 'prepared', 'committing');

-- What each sink of a run receives: [from_offset, to_offset) per partition.
CREATE TABLE tidemark.run_ranges (
    run_id      bigint NOT NULL,
    sink        text   NOT NULL,
    partition   int    NOT NULL,
    from_offset bigint NOT NULL,
    to_offset   bigint NOT NULL CHECK (to_offset >= from_offset),
    PRIMARY KEY (run_id, sink, partition),
    FOREIGN KEY (run_id, sink) REFERENCES tidemark.run_sinks(run_id, sink)
);

-- The decision: the gids chosen for a (run, sink). A gid may be chosen by several sinks of
-- the same run (the source-stage dead letters are shared).
CREATE TABLE tidemark.participants (
    run_id    bigint NOT NULL,
    sink      text   NOT NULL,
    gid       text   NOT NULL,
    target    text   NOT NULL,          -- 'ledger' or 'sink:<name>'
    task      int    NOT NULL,
    rows      bigint NOT NULL DEFAULT 0,
    outcome   text   CHECK (outcome IN ('committed', 'lost')),
    PRIMARY KEY (run_id, sink, gid),
    FOREIGN KEY (run_id, sink) REFERENCES tidemark.run_sinks(run_id, sink)
);
CREATE INDEX participants_gid ON tidemark.participants (gid);

-- Who may run a (pipeline, sink) now. epoch grows on every take-over (fencing token).
CREATE TABLE tidemark.leases (
    pipeline   text   NOT NULL REFERENCES tidemark.pipelines(name),
    sink       text   NOT NULL,
    epoch      bigint NOT NULL DEFAULT 0,
    run_id     bigint,
    owner      text,
    expires_at timestamptz,
    PRIMARY KEY (pipeline, sink)
);

CREATE TABLE tidemark.dlq (
    id               bigserial PRIMARY KEY,
    pipeline         text NOT NULL,
    sink             text,                    -- NULL before the sink stage
    run_id           bigint NOT NULL,
    source_partition int NOT NULL,
    source_offset    bigint NOT NULL,
    key              bytea,
    payload          bytea,                   -- exactly the source bytes
    headers          jsonb,
    error_class      tidemark.error_class NOT NULL,
    reason           text NOT NULL CHECK (length(reason) <= 500),
    detail           text,
    attempts         int NOT NULL DEFAULT 1,
    status           tidemark.dlq_status NOT NULL DEFAULT 'quarantined',
    first_seen       timestamptz NOT NULL DEFAULT now(),
    last_seen        timestamptz NOT NULL DEFAULT now(),
    resolved_by      text,
    resolved_at      timestamptz,
    note             text,
    CONSTRAINT dlq_one_per_stage UNIQUE NULLS NOT DISTINCT
        (pipeline, sink, source_partition, source_offset, error_class)
);
CREATE INDEX dlq_browse ON tidemark.dlq (pipeline, status, error_class, last_seen DESC);

-- Per-run metrics, one row per (run, sink, name).
CREATE TABLE tidemark.run_metrics (
    run_id bigint NOT NULL,
    sink   text   NOT NULL,
    name   text   NOT NULL,
    value  double precision NOT NULL,
    PRIMARY KEY (run_id, sink, name)
);
