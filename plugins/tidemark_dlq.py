"""Airflow plugin: Tidemark's dead letters and pipelines in Airflow's UI ("Dead letters" and
"Pipelines" in the navigation) and the dead letters' JSON API, served by Airflow's API
server under /tidemark (tidemark/web/app.py, tidemark/web/pipelines_pages.py)."""

from airflow.plugins_manager import AirflowPlugin

from tidemark.airflow.connection_lookup import register
from tidemark.web.app import app

register()  # the pages' ledger connection (ledger_conn_id) is Airflow's


class TidemarkDeadLetters(AirflowPlugin):
    name = "tidemark_dlq"
    fastapi_apps = [{"app": app, "url_prefix": "/tidemark", "name": "Tidemark dead letters"}]
    external_views = [
        {
            "name": "Dead letters",
            "href": "/tidemark/dlq/",
            "destination": "nav",
            "url_route": "dead-letters",
            "nav_top_level": True,
            "icon": "/tidemark/dlq/static/icon.svg",
        },
        {
            "name": "Pipelines",
            "href": "/tidemark/pipelines/",
            "destination": "nav",
            "url_route": "tidemark-pipelines",
            "nav_top_level": True,
            "icon": "/tidemark/pipelines/static/pipelines.svg",
        },
    ]
