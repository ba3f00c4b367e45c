-- The Airflow task try that started a run, as columns: the DAG run's failure message, the
-- report task and the Dead letters page find it by (pipeline, dag_id, dag_run_id) instead of
-- parsing JSON. external_id stays for other callers' own ids.
ALTER TABLE tidemark.runs
    ADD COLUMN dag_id text,
    ADD COLUMN dag_run_id text,
    ADD COLUMN task_id text,
    ADD COLUMN try_number integer;

-- Runs started before this migration carry the identity as JSON in external_id.
CREATE FUNCTION pg_temp.airflow_json(v text) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    RETURN CASE WHEN jsonb_typeof(v::jsonb) = 'object' THEN v::jsonb END;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;

UPDATE tidemark.runs r
SET dag_id = j->>'dag_id', dag_run_id = j->>'run_id', task_id = j->>'task_id',
    try_number = CASE WHEN jsonb_typeof(j->'try') = 'number' THEN (j->>'try')::integer END,
    external_id = NULL
FROM (SELECT run_id, pg_temp.airflow_json(external_id) AS j FROM tidemark.runs
      WHERE external_id LIKE '{%') AS parsed
WHERE r.run_id = parsed.run_id AND jsonb_typeof(j->'dag_id') = 'string'
  AND jsonb_typeof(j->'run_id') = 'string';

CREATE INDEX runs_by_dag_run ON tidemark.runs (pipeline, dag_id, dag_run_id)
    WHERE dag_id IS NOT NULL;
