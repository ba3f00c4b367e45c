"""Airflow DAGs of the pipeline file beside this one (flights.yaml): tidemark_flights and
tidemark_flights_backfill. Every pipeline YAML gets a copy of this file under its own name."""

from tidemark.airflow.dags import pipeline_dags

globals().update(pipeline_dags(__file__))
