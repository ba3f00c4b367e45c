"""Airflow DAG tidemark_maintenance: recovery sweep and health alerts for the pipelines in
the folder beside this file (tidemark/airflow/dags.py)."""

from pathlib import Path

from tidemark.airflow.dags import maintenance_dag

dag = maintenance_dag(Path(__file__).parent / "pipelines")
