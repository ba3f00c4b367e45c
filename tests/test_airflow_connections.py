"""The CLI finds connections made in Airflow (issue 48 point 4): run where Airflow is
configured, a pipeline's ``conn_id`` resolves through Airflow's metadata database (as
`airflow connections get` does), with no AIRFLOW_CONN_<ID> duplicate. A real Airflow metadata
database (SQLite, `airflow db migrate`) and a connection made by `airflow connections add`;
its password is never printed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.test_cli import assert_one_clear_line, tm


def _airflow(env: dict[str, str], *args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "airflow", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory) -> dict[str, str]:
    """An AIRFLOW_HOME with a migrated SQLite metadata database, and no AIRFLOW_CONN_*."""
    home = tmp_path_factory.mktemp("airflow-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "TIDEMARK_"))}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"})
    _airflow(env, "db", "migrate")
    return env


def test_the_cli_resolves_a_connection_made_with_airflow_connections_add(env, airflow_env):
    target = conninfo_to_dict(env.sink2_dsn)
    role, password = f"shop_{uuid.uuid4().hex[:8]}", "Conn-Secret-48"
    with psycopg.connect(env.sink2_dsn, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        c.execute(f'GRANT ALL ON DATABASE "{target["dbname"]}" TO {role}')
    try:
        _airflow(
            airflow_env,
            "connections", "add", "shop_log", "--conn-type", "postgres",
            "--conn-host", target["host"], "--conn-port", str(target["port"]),
            "--conn-login", role, "--conn-password", password,
            "--conn-schema", target["dbname"],
        )  # fmt: skip
        env.pipeline(source={"type": "postgres_log", "conn_id": "shop_log", "table": "shop.events"})
        cli_env = {**env.cli_env(), **airflow_env}
        code, out, err = tm(cli_env, "source", "create", "orders")
        assert code == 0, out + err
        assert f"created source table shop.events in postgresql://{role}:***@" in out, out
        assert password not in out + err
        owner = "SELECT tableowner FROM pg_tables WHERE schemaname = 'shop'"
        assert env.q(env.sink2_dsn, owner) == [(role,), (role,)]  # made as the connection's user
        # A connection Airflow does not have: one line saying where it looked.
        env.pipeline(source={"type": "postgres_log", "conn_id": "nope", "table": "shop.events"})
        code, out, err = tm(cli_env, "source", "create", "orders")
        assert code == 2
        assert_one_clear_line(
            err,
            "pipeline orders: source: Airflow connection 'nope' not found",
            "nor in Airflow's metadata database sqlite:///",
            "set AIRFLOW_CONN_NOPE to its URI",
        )
    finally:
        with psycopg.connect(env.sink2_dsn, autocommit=True) as c:
            c.execute(f"DROP OWNED BY {role}")
            c.execute(f"DROP ROLE {role}")


def test_the_compose_stacks_connections_are_made_once_and_a_users_edit_is_kept(airflow_env):
    """docker-compose.yaml's airflow-init makes spark_default and smtp_default in Airflow's
    database when they are missing, and leaves one a user changed (as docs/airflow.md tells
    them to) alone: as AIRFLOW_CONN_* variables they would win over the user's."""
    import json
    import re
    from pathlib import Path

    import yaml

    compose = yaml.safe_load((Path(__file__).parent.parent / "docker-compose.yaml").read_text())
    init = compose["services"]["airflow-init"]["command"][-1]
    script = "\n".join(
        line for line in init.splitlines() if re.match(r"\s*(airflow connections|set -)", line)
    ).replace("airflow ", f"{sys.executable} -m airflow ")
    assert "connections add spark_default" in script and "connections add smtp_default" in script
    common = compose["x-airflow-common"]["environment"]
    assert not [k for k in common if k.startswith("AIRFLOW_CONN_")], common

    def init_connections() -> None:
        res = subprocess.run(
            ["bash", "-c", script], env=airflow_env, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stdout + res.stderr

    def hosts() -> dict[str, tuple[str, str]]:
        out = _airflow(airflow_env, "connections", "export", "-", "--file-format", "json")
        return {i: (c["host"], str(c["port"])) for i, c in json.loads(out).items()}

    init_connections()
    made = hosts()
    assert made["spark_default"] == ("spark://spark-master", "7077"), made
    assert made["smtp_default"] == ("mailpit", "1025"), made
    _airflow(airflow_env, "connections", "delete", "spark_default")
    mine = {"conn_type": "spark", "host": "spark://my-master", "port": 7077}
    _airflow(airflow_env, "connections", "add", "spark_default", "--conn-json", json.dumps(mine))
    init_connections()  # a restart of the stack runs airflow-init again
    assert hosts()["spark_default"] == ("spark://my-master", "7077")
