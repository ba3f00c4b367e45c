-- A dry run's sink that would commit ends 'previewed' (docs/design.md, "Commit protocol",
-- Preview), its own state: before, it ended 'aborted' with the error 'dry run: rolled back',
-- told apart from an abort by that text. Those rows become 'previewed', without the error.
--
-- A value added to an enum (ALTER TYPE ... ADD VALUE) cannot be used in the transaction that
-- added it, and the migrations run in one: the type is made again, with the new value, and
-- the column converted to it (the partial index on it names the old type's values).
ALTER TYPE tidemark.run_state RENAME TO run_state_v18;
CREATE TYPE tidemark.run_state AS ENUM (
    'planned', 'writing', 'prepared', 'committing', 'committed', 'aborted', 'dq_failed', 'lost',
    'previewed');

DROP INDEX tidemark.run_sinks_open;
ALTER TABLE tidemark.run_sinks ALTER COLUMN state DROP DEFAULT;
ALTER TABLE tidemark.run_sinks ALTER COLUMN state TYPE tidemark.run_state USING (
    CASE WHEN state = 'aborted' AND error = 'dry run: rolled back' THEN 'previewed'
         ELSE state::text END)::tidemark.run_state;
ALTER TABLE tidemark.run_sinks ALTER COLUMN state SET DEFAULT 'planned';
UPDATE tidemark.run_sinks SET error = NULL
    WHERE state = 'previewed' AND error = 'dry run: rolled back';
CREATE INDEX run_sinks_open ON tidemark.run_sinks (state)
    WHERE state IN ('planned', 'writing', 'prepared', 'committing');
DROP TYPE tidemark.run_state_v18;
