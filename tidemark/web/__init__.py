"""The dead-letter web app (FastAPI), mounted in Airflow's API server by
plugins/tidemark_dlq.py, with Airflow's own authentication and DAG permissions. Its redrive
triggers DAGs through Airflow's REST API (airflow_api.py).

May import: render, ledger, config, quality (where Data Docs sites are), core (not airflow:
the two adapters are siblings).
"""
