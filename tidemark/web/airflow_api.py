"""Airflow's REST API as the Dead letters and Pipelines pages call it: trigger a pipeline's
redrive or rebuild DAG as the caller, tell whether that DAG is paused, read its Params and one
of its runs (state and conf).

At the address Airflow is configured with (:func:`base_url`), never the request's Host
header: a client could name any host and the API server would send it the caller's token
(server-side request forgery).
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from tidemark.core.errors import TidemarkError


class AirflowFailed(TidemarkError):
    """Airflow could not be reached or refused; the message says why, for the caller."""


class TriggerFailed(AirflowFailed):
    """Airflow did not start the run."""


def base_url() -> str:
    """Airflow's REST API: ``[api] base_url``, else its own host and port."""
    from airflow.configuration import conf

    base = (conf.get("api", "base_url", fallback="") or "").strip()
    if not base:
        host = (conf.get("api", "host", fallback="") or "").strip()
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"  # listening everywhere: loopback reaches it
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        base = f"http://{host}:{conf.getint('api', 'port', fallback=8080)}"
    return f"{base.rstrip('/')}/api/v2"


class AirflowApi:
    """One caller's client: their JWT on every request, so Airflow authorizes what they ask
    for too. A context manager; :meth:`close` ends its connections."""

    def __init__(self, token: str, api: str | None = None) -> None:
        self.api = api if api is not None else base_url()
        self._http = httpx.Client(
            timeout=30, headers={"Authorization": f"Bearer {token}"}, follow_redirects=False
        )

    def __enter__(self) -> AirflowApi:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _dag(self, dag: str) -> str:
        return f"{self.api}/dags/{quote(dag, safe='')}"

    def trigger(self, dag: str, conf: dict[str, Any]) -> str:
        """A run of ``dag`` now (no logical date) with ``conf``; returns its run id.
        TriggerFailed when Airflow cannot be reached or refuses."""
        try:
            r = self._http.post(
                f"{self._dag(dag)}/dagRuns", json={"logical_date": None, "conf": conf}
            )
        except httpx.HTTPError as exc:
            raise TriggerFailed(f"cannot reach Airflow's API: {exc}") from None
        if r.status_code != 200:
            raise TriggerFailed(_refusal(dag, r))
        return str(r.json()["dag_run_id"])

    def dag_run(self, dag: str, run_id: str) -> dict[str, Any] | None:
        """The run ``run_id`` of ``dag`` as Airflow shows it to the caller (``state``,
        ``conf``, ...); None if there is none they may see. AirflowFailed otherwise."""
        try:
            r = self._http.get(f"{self._dag(dag)}/dagRuns/{quote(run_id, safe='')}")
        except httpx.HTTPError as exc:
            raise AirflowFailed(f"cannot reach Airflow's API: {exc}") from None
        if r.status_code in (403, 404):
            return None
        if r.status_code != 200:
            raise AirflowFailed(_refusal(dag, r, "read a run of"))
        return dict(r.json())

    def dag_params(self, dag: str) -> dict[str, Any] | None:
        """``dag``'s Params as Airflow parsed them (each ``{"value", "schema", ...}``);
        None if there is no such DAG the caller may see. AirflowFailed otherwise."""
        try:
            r = self._http.get(f"{self._dag(dag)}/details")
        except httpx.HTTPError as exc:
            raise AirflowFailed(f"cannot reach Airflow's API: {exc}") from None
        if r.status_code in (403, 404):
            return None
        if r.status_code != 200:
            raise AirflowFailed(_refusal(dag, r, "read"))
        return dict(r.json().get("params") or {})

    def paused(self, dag: str) -> bool:
        """A paused DAG's run waits in the queue: say so rather than leave people waiting."""
        try:
            r = self._http.get(self._dag(dag))
            return r.status_code == 200 and bool(r.json().get("is_paused"))
        except (httpx.HTTPError, ValueError):
            return False


def _refusal(dag: str, r: httpx.Response, doing: str = "trigger") -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    shown = (
        detail if isinstance(detail, str) else json.dumps(detail)[:300] if detail else r.text[:300]
    )
    if r.status_code == 404:
        return f"DAG {dag} not found in Airflow (is the pipeline deployed?): {shown}"
    return f"Airflow refused to {doing} {dag} (HTTP {r.status_code}): {shown}"
