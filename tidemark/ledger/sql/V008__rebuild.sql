-- A rebuild (`tidemark sink rebuild`) is a run of its own mode: it re-delivers everything one
-- sink has received into a new table and swaps it in (docs/operations.md, "Rebuild a sink").
ALTER TABLE tidemark.runs DROP CONSTRAINT runs_mode_check;
ALTER TABLE tidemark.runs
    ADD CONSTRAINT runs_mode_check CHECK (mode IN ('run', 'backfill', 'redrive', 'rebuild'));

-- What a run changed (or, previewed, would change) in each sink's table: "added column x
-- text", a rebuild's new table and the name it kept the old one under. The report task in
-- Airflow says it; the run report alone used to.
ALTER TABLE tidemark.run_sinks ADD COLUMN schema_changes text[] NOT NULL DEFAULT '{}';
