-- The gaps a run stepped over (docs/design.md, invariant 2 "No gaps"): per sink and
-- partition, the offsets of its range the source held no record at when the run planned its
-- read. A record that appears there later (a late segment of a file archive) lies below the
-- checkpoint and is placed nowhere: `tidemark status`, `tidemark recover` and the
-- maintenance DAG look for one, and a backfill (or rebuild) over the gap resolves it.
-- Not a child of tidemark.runs: run retention must not forget a gap.
CREATE TABLE tidemark.source_gaps (
    id          bigserial PRIMARY KEY,
    pipeline    text   NOT NULL,
    sink        text   NOT NULL,
    partition   int    NOT NULL,
    lo          bigint NOT NULL,
    hi          bigint NOT NULL CHECK (hi > lo),
    run_id      bigint NOT NULL,            -- the run that stepped over it
    stepped     boolean NOT NULL DEFAULT false,  -- that run committed for the sink
    resolved_by bigint,                     -- the backfill or rebuild that read it again
    resolved_at timestamptz
);
CREATE INDEX source_gaps_open ON tidemark.source_gaps (pipeline, sink, partition)
    WHERE stepped AND resolved_by IS NULL;
CREATE INDEX source_gaps_run ON tidemark.source_gaps (run_id, sink);
