"""Broken pipeline files in the folder pipelines/ beside this file, as this file's Airflow
import error: one line per file naming the file, the field and the problem
(tidemark/airflow/dags.py). It defines no DAG; the other pipelines' DAGs are
tidemark_pipelines.py's and stay."""

from pathlib import Path

from tidemark.airflow.dags import check_pipeline_files

check_pipeline_files(Path(__file__).parent / "pipelines")
