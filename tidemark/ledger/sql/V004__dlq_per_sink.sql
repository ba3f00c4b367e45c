-- Dead letters name the sink they apply to (DESIGN.md, "Which sinks a verdict applies to").
-- A verdict binds only the sinks whose range held the record, so a letter is one row per
-- (sink, record): a letter with no sink can no longer be read as applying to every sink.
--
-- Letters quarantined before the sinks (sink NULL) become one letter per sink that the run
-- which last quarantined them committed, and whose range in that run held the record. A sink
-- that has not got that far will read the record itself; one that already had it keeps it.
INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset, key,
                          payload, headers, error_class, reason, detail, attempts, status,
                          first_seen, last_seen, resolved_by, resolved_at, note)
SELECT d.pipeline, rr.sink, d.run_id, d.source_partition, d.source_offset, d.key, d.payload,
       d.headers, d.error_class, d.reason, d.detail, d.attempts, d.status, d.first_seen,
       d.last_seen, d.resolved_by, d.resolved_at, d.note
FROM tidemark.dlq d
JOIN tidemark.run_ranges rr ON rr.run_id = d.run_id AND rr.partition = d.source_partition
     AND d.source_offset >= rr.from_offset AND d.source_offset < rr.to_offset
JOIN tidemark.run_sinks rs ON rs.run_id = rr.run_id AND rs.sink = rr.sink
     AND rs.state = 'committed'
WHERE d.sink IS NULL
ON CONFLICT DO NOTHING;

DELETE FROM tidemark.dlq WHERE sink IS NULL;

-- One letter per (pipeline, sink, record): a re-run, a backfill or a redrive updates it (its
-- class, reason and attempts), never adds a second. Of duplicates left by older versions
-- keep the newest.
DELETE FROM tidemark.dlq d USING tidemark.dlq n
WHERE n.pipeline = d.pipeline AND n.sink = d.sink AND n.source_partition = d.source_partition
  AND n.source_offset = d.source_offset
  AND (n.last_seen, n.id) > (d.last_seen, d.id);

ALTER TABLE tidemark.dlq DROP CONSTRAINT dlq_one_per_stage;
ALTER TABLE tidemark.dlq ALTER COLUMN sink SET NOT NULL;
ALTER TABLE tidemark.dlq ADD CONSTRAINT dlq_one_per_sink
    UNIQUE (pipeline, sink, source_partition, source_offset);
