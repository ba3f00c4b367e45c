-- Where each sink began, per partition: the offset its checkpoint was first set to (the
-- pipeline's `start`: the source's first settled record, or its end with `start: latest`).
-- No re-delivery (backfill, rebuild, a backfill's fallback) reaches below it: the records
-- there were never delivered to the sink (docs/design.md, "Re-delivery").
-- NULL: not known, read as "the first record the source holds" (what every re-delivery
-- assumed before this version).
ALTER TABLE tidemark.checkpoints ADD COLUMN start_offset bigint
    CHECK (start_offset >= 0 AND start_offset <= next_offset);

-- Checkpoints from before it: filled only where the ledger proves where the sink began; a
-- start set too high would make a rebuild leave out rows the sink did receive, so where
-- nothing proves it, NULL (the operator can set it: docs/operations.md).
-- 1. Never advanced (no run has committed into it; advance() sets updated_by): it is still
--    where it began.
UPDATE tidemark.checkpoints SET start_offset = next_offset WHERE updated_by IS NULL;

-- 2. Seeded by the claim that created the pipeline's ledger row: that claim's run (same
--    transaction, so the same now()) starts each of its ranges at the seed. Later runs, and
--    the runs retention may have deleted, prove nothing: a checkpoint can only have been
--    seeded once, but not necessarily by the oldest run still kept.
UPDATE tidemark.checkpoints c SET start_offset = rr.from_offset
FROM tidemark.pipelines p, tidemark.runs r, tidemark.run_ranges rr
WHERE c.start_offset IS NULL AND p.name = c.pipeline AND r.pipeline = p.name
  AND r.created_at = p.created_at AND r.mode = 'run'
  AND rr.run_id = r.run_id AND rr.sink = c.sink AND rr.partition = c.partition
  AND rr.from_offset <= c.next_offset;
