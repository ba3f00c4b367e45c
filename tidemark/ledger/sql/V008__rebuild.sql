-- A rebuild (`tidemark sink rebuild`) is a run of its own mode: it re-delivers everything one
-- sink has received into a new table and swaps it in (docs/operations.md, "Rebuild a sink").
ALTER TABLE tidemark.runs DROP CONSTRAINT runs_mode_check;
ALTER TABLE tidemark.runs
    ADD CONSTRAINT runs_mode_check CHECK (mode IN ('run', 'backfill', 'redrive', 'rebuild'));
