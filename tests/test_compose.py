"""docker-compose.yaml, read as data (no Docker engine needed): the services, the settings they
share, and the files they build from or mount."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tidemark.core.settings import Settings

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yaml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
INIT_SQL = REPO / "docker" / "postgres-init.sql"

AIRFLOW_SERVICES = (
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
)
LONG_RUNNING = tuple(s for s in AIRFLOW_SERVICES if s != "airflow-init")
SERVICES = ("postgres", *AIRFLOW_SERVICES, "spark-master", "spark-worker", "mailpit")

EXPECTED_ENV = {
    "TIDEMARK_LEDGER_DSN": "postgresql://tidemark:tidemark@postgres:5432/tidemark",
    "TIDEMARK_DEMO_SOURCE_DSN": "postgresql://tidemark:tidemark@postgres:5432/tidemark",
    "TIDEMARK_DEMO_SINK_DSN": "postgresql://tidemark:tidemark@postgres:5432/warehouse",
    "TIDEMARK_PIPELINES_DIR": "/opt/tidemark/dags/pipelines",
    "TIDEMARK_DATA_DOCS_DIR": "/opt/tidemark/.tidemark/data_docs",
    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://tidemark:tidemark@postgres:5432/airflow",
    "AIRFLOW__CORE__DAGS_FOLDER": "/opt/tidemark/dags",
    "AIRFLOW__CORE__PLUGINS_FOLDER": "/opt/tidemark/plugins",
    "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
    "AIRFLOW__CORE__PARALLELISM": "4",
    "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "2",
    "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://airflow-apiserver:8080/execution/",
    "AIRFLOW__API__BASE_URL": "http://localhost:8080",
}
SECRETS = ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET")
# Read by the demo commands (`tidemark demo load`, the demo pipeline), not by Settings.
DEMO_ENV = {"TIDEMARK_DEMO_SOURCE_DSN", "TIDEMARK_DEMO_SINK_DSN"}


@pytest.fixture(scope="module")
def compose() -> dict:
    assert COMPOSE.is_file(), f"{COMPOSE} is missing"
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command_text(service: dict) -> str:
    cmd = service.get("command", "")
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def host_ip(port) -> str | None:
    """The host address a published port binds, in short ("ip:host:container") or long form."""
    if isinstance(port, dict):
        return port.get("host_ip")
    parts = str(port).rsplit(":", 2)
    return parts[0].strip("[]") if len(parts) == 3 else None


def depends(service: dict) -> dict[str, str]:
    dep = service.get("depends_on") or {}
    if isinstance(dep, list):
        return dict.fromkeys(dep, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in dep.items()}


def test_all_services_exist(services):
    missing = [s for s in SERVICES if s not in services]
    assert not missing, f"services missing from docker-compose.yaml: {missing}"


def test_postgres_enables_prepared_transactions(services):
    pg = services["postgres"]
    assert str(pg["image"]).startswith("postgres:15")
    m = re.search(r"max_prepared_transactions\s*=\s*(\d+)", command_text(pg))
    assert m, "postgres command does not set max_prepared_transactions"
    assert int(m.group(1)) > 0
    assert "pg_isready" in json.dumps(pg["healthcheck"]["test"])
    volumes = [str(v) for v in pg["volumes"]]
    assert any(
        v.split(":")[1] == "/var/lib/postgresql/data" and not v.startswith((".", "/"))
        for v in volumes
    ), "postgres data is not on a named volume"
    assert any(
        v.startswith("./docker/postgres-init.sql:/docker-entrypoint-initdb.d/") for v in volumes
    ), "postgres-init.sql is not mounted into docker-entrypoint-initdb.d"


def test_init_sql_creates_the_three_databases():
    text = INIT_SQL.read_text()
    created = set(re.findall(r"CREATE\s+DATABASE\s+\"?(\w+)\"?", text, re.IGNORECASE))
    assert {"tidemark", "warehouse", "airflow"} <= created, created
    assert re.search(
        r"CREATE\s+ROLE\s+tidemark\b.*\bLOGIN\b.*PASSWORD\s+'tidemark'", text, re.IGNORECASE
    )


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_airflow_service_settings(compose, services, name):
    svc = services[name]
    env = env_of(svc)
    wrong = {k: env.get(k) for k, v in EXPECTED_ENV.items() if env.get(k) != v}
    assert not wrong, f"{name}: missing or different settings {wrong}"
    for key in SECRETS:
        assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", env.get(key, "")), (
            f"{name}: {key} must come from a required variable (${{NAME:?...}})"
        )
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert depends(svc).get("postgres") == "service_healthy"
    if name in LONG_RUNNING:
        assert depends(svc).get("airflow-init") == "service_completed_successfully"
    mounts = {str(v).split(":")[1]: str(v) for v in svc["volumes"]}
    for folder in ("dags", "plugins"):
        assert mounts.get(f"/opt/tidemark/{folder}") == f"./{folder}:/opt/tidemark/{folder}:ro"
    docs = mounts.get("/opt/tidemark/.tidemark/data_docs", "")
    assert docs.split(":")[0] in (compose.get("volumes") or {}), (
        f"{name}: Data Docs are not on a named volume ({docs!r})"
    )


def test_airflow_commands(services):
    assert command_text(services["airflow-apiserver"]).split()[-1] == "api-server"
    assert command_text(services["airflow-scheduler"]) == "scheduler"
    assert command_text(services["airflow-dag-processor"]) == "dag-processor"
    assert command_text(services["airflow-triggerer"]) == "triggerer"
    init = command_text(services["airflow-init"])
    steps = [
        "airflow db migrate",
        "python -m tidemark db upgrade",
        'airflow pools set tidemark_spark 2 "Concurrent Tidemark Spark jobs"',
    ]
    positions = [init.find(s) for s in steps]
    assert -1 not in positions and positions == sorted(positions), init
    assert "set -e" in init, "airflow-init must stop at the first failing step"


def test_published_ports_bind_localhost_only(services):
    published = {
        (name, str(p)): host_ip(p) for name, svc in services.items() for p in svc.get("ports", [])
    }
    assert published, "nothing is published"
    wrong = [k for k, ip in published.items() if ip != "127.0.0.1"]
    assert not wrong, f"ports not bound to 127.0.0.1: {wrong}"
    assert "127.0.0.1:8080:8080" in services["airflow-apiserver"]["ports"]
    assert "127.0.0.1:8025:8025" in [str(p).split()[0] for p in services["mailpit"]["ports"]]


def init_connection(services, conn_id: str) -> dict:
    """The connection airflow-init makes (tests/test_airflow_connections.py runs it)."""
    init = command_text(services["airflow-init"])
    m = re.search(rf"connections add {conn_id} --conn-json '([^']+)'", init)
    assert m, f"airflow-init makes no {conn_id}"
    return json.loads(m.group(1))


def test_spark_connection_points_at_the_master(services):
    conn = init_connection(services, "spark_default")
    assert conn["conn_type"] == "spark"
    assert conn["host"] == "spark://spark-master"
    assert int(conn["port"]) == 7077
    master = command_text(services["spark-master"])
    assert "org.apache.spark.deploy.master.Master" in master
    assert "--host spark-master" in master
    assert "--port 7077" in master
    worker = command_text(services["spark-worker"])
    assert "org.apache.spark.deploy.worker.Worker spark://spark-master:7077" in worker


def test_spark_runs_the_shared_image(services):
    # The worker needs the job's Python dependencies (psycopg, pyarrow): the shared image.
    airflow_image = services["airflow-scheduler"]["image"]
    for name in ("spark-master", "spark-worker"):
        svc = services[name]
        assert svc["image"] == airflow_image, name
        assert svc["build"]["dockerfile"] == "docker/Dockerfile", name
        assert "spark-class" in command_text(svc), name


def test_smtp_connection_points_at_mailpit(services):
    assert str(services["mailpit"]["image"]).startswith("axllent/mailpit")
    conn = init_connection(services, "smtp_default")
    assert conn["conn_type"] == "smtp"
    assert conn["host"] == "mailpit"
    assert int(conn["port"]) == 1025


def test_webhook_connection_is_opt_in(services):
    for name in AIRFLOW_SERVICES:
        assert "AIRFLOW_CONN_TIDEMARK_WEBHOOK" not in env_of(services[name])
    assert re.search(r"^\s*#\s*AIRFLOW_CONN_TIDEMARK_WEBHOOK:", COMPOSE.read_text(), re.M)


def test_tidemark_env_names_are_settings(services):
    fields = {f"TIDEMARK_{name.upper()}" for name in Settings.model_fields}
    used = {key for svc in services.values() for key in env_of(svc) if key.startswith("TIDEMARK_")}
    assert used, "no TIDEMARK_* settings in docker-compose.yaml"
    unknown = used - fields - DEMO_ENV
    assert not unknown, f"not fields of tidemark.core.settings.Settings: {sorted(unknown)}"


def test_dockerfile_installs_requirements_and_tidemark():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM apache/airflow:3\.3\.\d+-python3\.11\b", text, re.M)
    assert "openjdk-17-jre-headless" in text
    assert re.search(r"^COPY requirements\.txt /requirements\.txt$", text, re.M)
    assert re.search(r"pip install --no-cache-dir --no-deps -r /requirements\.txt", text)
    assert re.search(r"pip install .*-e /opt/tidemark", text)
    assert re.search(r"^ENV PYTHONPATH=/opt/tidemark$", text, re.M)
