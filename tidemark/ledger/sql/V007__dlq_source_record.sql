-- Dead letters keep the source record's headers and timestamp as the source had them
-- (docs/design.md, "DLQ envelope"): a redrive hands the transform what a delivery of the
-- record would. The jsonb `headers` column stays for display and search, but it cannot be
-- handed back: jsonb normalizes the text (key order, whitespace, duplicate keys) and refuses
-- \u0000 (such headers are stored base64-wrapped there).
ALTER TABLE tidemark.dlq
    ADD COLUMN source_ts      timestamptz,
    -- the headers text's UTF-8 bytes, exactly as the source gave them (NULL: no headers)
    ADD COLUMN source_headers bytea,
    -- true: source_ts and source_headers are the source's. NULL: not known yet (a letter
    -- from before V007, or one written without them); a redrive first reads them from the
    -- source. false: the source no longer held the record; source_note says so.
    ADD COLUMN source_kept    boolean,
    -- why source_ts and source_headers are unknown. Kept through resolve and discard (they
    -- overwrite `note`).
    ADD COLUMN source_note    text;
