-- A decided participant someone else rolled back (docs/design.md, "Commit protocol" step 4).
-- 'lost': a sink's decision of which some participants committed and another was rolled
-- back by someone else; its ranges count as delivered and `tidemark settle RUN` re-delivers
-- them (it then reads committed). Before any commit, the run is rolled back whole: aborted.
ALTER TYPE tidemark.run_state ADD VALUE IF NOT EXISTS 'lost';

-- A chosen participant the finish rolled back itself, because another was lost first.
ALTER TABLE tidemark.participants DROP CONSTRAINT IF EXISTS participants_outcome_check;
ALTER TABLE tidemark.participants
    ADD CONSTRAINT participants_outcome_check
    CHECK (outcome IN ('committed', 'lost', 'rolled_back'));
