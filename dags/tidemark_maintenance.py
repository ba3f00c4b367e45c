"""Airflow DAG tidemark_maintenance: recovery sweep and health alerts (tidemark/dags.py)."""

from tidemark.dags import maintenance_dag

dag = maintenance_dag()
