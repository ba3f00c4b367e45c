"""An Airflow auth manager for the web tests (loaded by the API server they start): Airflow's
SimpleAuthManager, whose roles grant every DAG or none, plus a user ``scoped`` who may only see
and edit the DAGs of the pipeline ``orders``, as a per-DAG auth manager (FAB, Keycloak) allows.
"""

from __future__ import annotations

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

SCOPED_USER = "scoped"
SCOPED_PREFIX = "tidemark_orders"


class ScopedAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        if user.get_name() == SCOPED_USER and not (
            details is not None and details.id and details.id.startswith(SCOPED_PREFIX)
        ):
            return False  # neither another pipeline's DAG nor "every DAG"
        return super().is_authorized_dag(
            method=method, user=user, access_entity=access_entity, details=details
        )
