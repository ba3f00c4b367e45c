"""Airflow DAGs of every pipeline file in the folder pipelines/ beside this file:
tidemark_<name>, tidemark_<name>_backfill and tidemark_<name>_redrive (tidemark/airflow/dags.py).
Drop a pipeline YAML into pipelines/ and its DAGs appear. A broken one is left out here and
shown as tidemark_pipeline_files.py's import error, naming the file and the field."""

from pathlib import Path

from tidemark.airflow.dags import pipeline_dags

globals().update(pipeline_dags(Path(__file__).parent / "pipelines"))
