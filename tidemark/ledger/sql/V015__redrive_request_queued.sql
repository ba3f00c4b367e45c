-- When a DAG run was last triggered to redrive a request ("Redrive these" after a preview,
-- the redrive DAG given a request id). Until its run claims the pipeline, no open ledger run
-- protects the request from `tidemark prune`; this does (ledger/retention.py).
ALTER TABLE tidemark.redrive_requests ADD COLUMN queued_at timestamptz;
