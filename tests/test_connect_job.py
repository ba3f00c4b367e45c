"""The replay task's Spark Connect endpoint from an Airflow connection
(tidemark/airflow/connect_job.py) and the local stack's spark_default (`make up CONNECT=1`);
the DAG run through a Connect server is tests/test_airflow_connect.py."""

from __future__ import annotations

import json

import httpx
import pytest
from airflow.sdk.exceptions import AirflowFailException

from tidemark.airflow.connect_job import endpoint
from tidemark.devstack.airflow_stack import Stack, spark_connection, sync_spark_default


def _conn(monkeypatch, conn_id: str, **fields) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))
    return conn_id


def test_a_spark_connection_spark_submits(monkeypatch):
    assert endpoint(_conn(monkeypatch, "sd", conn_type="spark", host="local[*]")) is None


def test_a_spark_connect_connection_is_its_url_with_token_and_service_params(monkeypatch):
    local = _conn(
        monkeypatch, "cl", conn_type="spark_connect", host="localhost", port=15002, password="t/k+n"
    )
    assert endpoint(local) == "sc://localhost:15002/;token=t/k%2Bn"
    dbx = _conn(
        monkeypatch,
        "dbx",
        conn_type="spark_connect",
        host="adb-1.azuredatabricks.net",
        port=443,
        extra={"use_ssl": True, "params": {"x-databricks-cluster-id": "0123-abc"}},
    )
    assert endpoint(dbx) == (
        "sc://adb-1.azuredatabricks.net:443/;use_ssl=True;x-databricks-cluster-id=0123-abc"
    )
    bare = _conn(monkeypatch, "bare", conn_type="spark_connect", host="h", port=1,
                 extra={"params": {"x-h": 1}})  # fmt: skip
    assert endpoint(bare) == "sc://h:1/;x-h=1"


def test_bad_service_params_fail_at_once_naming_the_connection(monkeypatch):
    bad = _conn(monkeypatch, "bad", conn_type="spark_connect", host="h", port=1,
                extra={"params": {"no good": "1"}})  # fmt: skip
    with pytest.raises(AirflowFailException, match="'bad' .spark_connect.: extra params"):
        endpoint(bad)


class Connections:
    """Airflow's connections API as far as sync_spark_default uses it, in memory."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        conn_id = request.url.path.rsplit("/", 1)[1]
        if request.method == "GET":
            row = self.rows.get(conn_id)
            return httpx.Response(200, json=row) if row else httpx.Response(404)
        body = json.loads(request.content)
        if request.method == "POST":
            assert body["connection_id"] not in self.rows
            self.rows[body["connection_id"]] = body
            return httpx.Response(201, json=body)
        assert request.method == "PATCH" and conn_id in self.rows
        self.rows[conn_id] = body
        return httpx.Response(200, json=body)


def test_make_up_makes_spark_default_in_airflows_database_and_keeps_a_users_own(
    tmp_path, monkeypatch
):
    assert json.loads(spark_connection(None)) == {"conn_type": "spark", "host": "local[*]"}
    # `make connect` wrote TIDEMARK_SPARK_REMOTE into .tidemark/env, which `tidemark airflow
    # up` loads: Airflow's processes get neither it nor a spark_default in their environment,
    # which Airflow would read before its database, hiding the one a user adds there.
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    monkeypatch.setenv("TIDEMARK_SPARK_REMOTE", "sc://127.0.0.1:15002")
    env = Stack(home=tmp_path, ledger_dsn="postgresql://x@127.0.0.1/x").env()
    assert "TIDEMARK_SPARK_REMOTE" not in env and "AIRFLOW_CONN_SPARK_DEFAULT" not in env

    airflow = Connections()
    api = httpx.Client(transport=httpx.MockTransport(airflow), base_url="http://a/api/v2")
    # `make up CONNECT=1`: a spark_connect connection to the server; `make up`: local Spark.
    assert sync_spark_default(api, "sc://127.0.0.1:15002") == (
        "spark_default: the Spark Connect server sc://127.0.0.1:15002"
    )
    row = airflow.rows["spark_default"]
    assert (row["conn_type"], row["host"], row["port"]) == ("spark_connect", "127.0.0.1", 15002)
    assert sync_spark_default(api, None) == "spark_default: local Spark (local[*])"
    assert airflow.rows["spark_default"]["conn_type"] == "spark"
    # One the user made (`airflow connections add`, the UI) is theirs: kept, and said so.
    mine = {"connection_id": "spark_default", "conn_type": "spark_connect", "host": "dbx",
            "port": 443, "description": None}  # fmt: skip
    airflow.rows["spark_default"] = dict(mine)
    assert sync_spark_default(api, "sc://127.0.0.1:15002") == (
        "spark_default: your own (spark_connect dbx:443), kept; "
        "the Connect server sc://127.0.0.1:15002 is not used by it"
    )
    assert airflow.rows["spark_default"] == mine


def test_a_url_without_parameters_is_no_secret_and_the_log_names_it(monkeypatch):
    # `make up CONNECT=1`'s spark_default: no token, no parameters. Registering its URL as a
    # secret made the task log read "running the job on Spark Connect at ***".
    from airflow.sdk.log import redact

    url = endpoint(_conn(monkeypatch, "plain", conn_type="spark_connect", host="127.0.0.1",
                         port=15071))  # fmt: skip
    assert url == "sc://127.0.0.1:15071/"
    assert redact(f"running the job on Spark Connect at {url}") == (
        "running the job on Spark Connect at sc://127.0.0.1:15071/"
    )
    # One with a token is still masked whole; the log names it without its parameters.
    tok = endpoint(_conn(monkeypatch, "tok", conn_type="spark_connect", host="127.0.0.1",
                         port=15072, password="tok-1234567890"))  # fmt: skip
    assert tok is not None and "tok-1234567890" not in redact(f"at {tok}")


def test_the_stacks_env_file_finds_this_venvs_airflow_command(tmp_path):
    # docs/airflow.md: `source .tidemark/airflow/airflow.env`, then `airflow connections add
    # ...`; in a shell without the venv activated, `airflow` was not found.
    import subprocess
    import sys
    from pathlib import Path

    f = Stack(home=tmp_path, ledger_dsn="postgresql://x@127.0.0.1/x").write_env_file()
    out = subprocess.run(
        ["bash", "-c", f"source {f} && command -v airflow"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == str(Path(sys.executable).parent / "airflow"), out.stderr
