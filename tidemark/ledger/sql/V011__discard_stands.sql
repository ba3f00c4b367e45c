-- A discarded letter is its record's one place (docs/design.md, invariant 1): retention keeps
-- its row (who discarded it, when and why) and may drop only what it carried of the record,
-- its payload, headers and detail (docs/operations.md, "Retention"). pruned_at says when it
-- did, so a page says the bytes went rather than that there were none, a prune does not pick
-- the letter again, and a letter that goes live again gets its bytes back from its record.
ALTER TABLE tidemark.dlq ADD COLUMN pruned_at timestamptz;
