-- Data-quality results: one row per (run, scope); scope '' is the pipeline, else a sink name.
CREATE TABLE tidemark.dq_results (
    run_id       bigint  NOT NULL REFERENCES tidemark.runs(run_id),
    scope        text    NOT NULL DEFAULT '',
    success      boolean NOT NULL,
    rows_failed  bigint  NOT NULL DEFAULT 0,   -- row-level failures quarantined
    results      jsonb   NOT NULL DEFAULT '[]', -- per expectation: success, observed value
    raw          jsonb,                         -- the GX validation result
    docs_path    text,                          -- rendered Data Docs page
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, scope)
);
