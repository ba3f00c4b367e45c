"""The dead-letter web app (FastAPI), mounted in Airflow's API server by
plugins/tidemark_dlq.py, with Airflow's own authentication and DAG permissions. Its redrive
triggers DAGs through Airflow's REST API (airflow_api.py).

app.py builds the app from its parts: context (what they share), middleware, errors (the
exception handlers), selection (typed input), access, views, pages, api, trigger and runs.

May import: render, ledger, config, quality (where Data Docs sites are), core (not airflow:
the two adapters are siblings).
"""
