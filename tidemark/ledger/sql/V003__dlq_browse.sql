-- Dead-letter browsing: keyset pages on id DESC stay index scans at any depth.
-- Per pipeline and status (the UI's default view), and per status across pipelines. A page
-- without a status filter merges one index scan per status (tidemark/dlq.py).
CREATE INDEX dlq_keyset_pipeline ON tidemark.dlq (pipeline, status, id DESC);
CREATE INDEX dlq_keyset_status ON tidemark.dlq (status, id DESC);
