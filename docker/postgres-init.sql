-- Run once by the postgres image on an empty data volume (/docker-entrypoint-initdb.d).
-- One role owns the three databases of the Docker Compose stack:
--   tidemark   the ledger (checkpoints, runs, leases, DLQ) and the demo source log
--   warehouse  the demo sink
--   airflow    the Airflow metadata database
-- The server runs with max_prepared_transactions > 0 (see docker-compose.yaml), which the
-- two-phase commit of every Tidemark run needs.
CREATE ROLE tidemark LOGIN PASSWORD 'tidemark';
CREATE DATABASE tidemark OWNER tidemark;
CREATE DATABASE warehouse OWNER tidemark;
CREATE DATABASE airflow OWNER tidemark;
