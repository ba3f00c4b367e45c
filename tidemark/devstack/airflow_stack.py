"""A real local Airflow 3.3 for `make up` and the tests: the separate components, one machine.

The API server, the scheduler (LocalExecutor), the DAG processor and the triggerer run as
background processes bound to 127.0.0.1, with their metadata in a PostgreSQL database, sized
for a 2-core machine. State (generated secrets, the login, pid files, logs) lives in ``home``,
with ``airflow.env``: the settings to source before running Airflow's own CLI against it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from tidemark.airflow import POOL
from tidemark.core.dsn import mask
from tidemark.core.errors import TidemarkError
from tidemark.core.private import write_private
from tidemark.devstack import daemon

REPO = Path(__file__).resolve().parents[2]  # the checkout: dags/ and plugins/
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def metadata_url(ledger_dsn: str, database: str = "airflow") -> str:
    """SQLAlchemy URL of the Airflow metadata DB: the ledger's server, database ``airflow``."""
    info = psycopg.conninfo.conninfo_to_dict(ledger_dsn)
    user, pw = info.get("user", "postgres"), info.get("password", "")
    host, port = info.get("host", "127.0.0.1"), info.get("port", "5432")
    auth = f"{user}:{pw}@" if pw else f"{user}@"
    return f"postgresql+psycopg2://{auth}{host}:{port}/{database}"


REMOTE = "TIDEMARK_SPARK_REMOTE"  # `make up CONNECT=1`: the local Spark Connect server


def spark_connection(remote: str | None) -> str:
    """``spark_default`` as Airflow connection JSON: local Spark (spark-submit), or with
    ``remote`` (sc://host:port, `make up CONNECT=1`) a ``spark_connect`` connection to that
    server, which the DAGs' replay tasks then run their jobs on (docs/airflow.md). The DAGs
    take the endpoint from the connection alone: Airflow's processes get no
    TIDEMARK_SPARK_REMOTE."""
    if not remote:
        return json.dumps({"conn_type": "spark", "host": "local[*]"})
    from urllib.parse import urlsplit

    at = urlsplit(remote.split("/;", 1)[0])
    return json.dumps({"conn_type": "spark_connect", "host": at.hostname, "port": at.port})


# The description of the spark_default `tidemark airflow up` makes: one that still has it is
# the stack's to set again at the next start; any other is a user's own and is kept.
SPARK_DEFAULT = "spark_default"
MADE_BY_UP = (
    "made by `tidemark airflow up` (make up), set again at each start: "
    "give it another description to keep your changes"
)


def sync_spark_default(api, remote: str | None) -> str:
    """Make ``spark_default`` in Airflow's database (not in its processes' environment, which
    Airflow reads first: a connection a user then made in the UI or with `airflow connections
    add` was stored and never used): the local Spark, or the Connect server at ``remote``.
    One the user made or edited under another description is kept. ``api`` is
    :meth:`Stack.api`'s client; returns the line saying what spark_default is."""
    want = {"connection_id": SPARK_DEFAULT, **json.loads(spark_connection(remote))}
    want["description"] = MADE_BY_UP
    r = api.get(f"/connections/{SPARK_DEFAULT}")
    if r.status_code == 404:
        api.post("/connections", json=want).raise_for_status()
    else:
        r.raise_for_status()
        have = r.json()
        if have.get("description") != MADE_BY_UP:
            at = f"{have.get('conn_type')} {have.get('host')}:{have.get('port')}"
            unused = f"; the Connect server {remote} is not used by it" if remote else ""
            return f"{SPARK_DEFAULT}: your own ({at}), kept{unused}"
        api.patch(f"/connections/{SPARK_DEFAULT}", json=want).raise_for_status()
    where = f"the Spark Connect server {remote}" if remote else "local Spark (local[*])"
    return f"{SPARK_DEFAULT}: {where}"


def ledger_connection(ledger_dsn: str) -> str:
    """The ledger as Airflow connection JSON (``AIRFLOW_CONN_TIDEMARK_LEDGER``): libpq's other
    parameters (sslmode, ...) go to its extra."""
    info = psycopg.conninfo.conninfo_to_dict(ledger_dsn)
    conn = {
        "conn_type": "postgres",
        "host": info.pop("host", "127.0.0.1"),
        "port": int(info.pop("port", None) or 5432),
        "login": info.pop("user", None),
        "password": info.pop("password", None),
        "schema": info.pop("dbname", None),
        "extra": info,
    }
    return json.dumps({k: v for k, v in conn.items() if v})


def ensure_database(ledger_dsn: str, name: str) -> None:
    with psycopg.connect(ledger_dsn, autocommit=True, connect_timeout=10) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            try:
                c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except psycopg.Error as exc:
                raise TidemarkError(
                    f"cannot create the Airflow metadata database {name!r} on "
                    f"{mask(ledger_dsn)}: {exc.diag.message_primary}"
                ) from None


@dataclass
class Stack:
    home: Path
    ledger_dsn: str
    port: int = 8080
    env_extra: dict[str, str] = field(default_factory=dict)
    dags_folder: Path = REPO / "dags"
    plugins_folder: Path = REPO / "plugins"
    metadata_db: str = "airflow"
    user: str = USER

    # -- configuration ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _state(self) -> dict:
        path = self.home / "stack.json"
        if path.exists():
            return json.loads(path.read_text())
        state = {
            "fernet_key": _fernet_key(),
            "jwt_secret": secrets.token_urlsafe(32),
            "secret_key": secrets.token_urlsafe(32),
            "log_port": free_port(),
        }
        write_private(path, json.dumps(state))
        return state

    @property
    def passwords_file(self) -> Path:
        return self.home / "passwords.json"

    def password(self, user: str = USER) -> str:
        pw = json.loads(self.passwords_file.read_text()) if self.passwords_file.exists() else {}
        if user not in pw:
            pw[user] = secrets.token_urlsafe(12)
            write_private(self.passwords_file, json.dumps(pw))
        return pw[user]

    def env(self) -> dict[str, str]:
        st = self._state()
        self.password()
        bin_dir = str(Path(sys.executable).parent)
        env = dict(os.environ)
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",  # spark-submit, airflow
                "PYSPARK_PYTHON": sys.executable,
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.plugins_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                # 2 cores: a few task processes; Spark jobs are capped further by the pool.
                "AIRFLOW__CORE__PARALLELISM": "4",
                "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "2",
                "AIRFLOW__CORE__FERNET_KEY": st["fernet_key"],
                "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin,viewer:viewer",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_url(
                    self.ledger_dsn, self.metadata_db
                ),
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__BASE_URL": self.url,
                "AIRFLOW__API__SECRET_KEY": st["secret_key"],
                "AIRFLOW__API_AUTH__JWT_SECRET": st["jwt_secret"],
                # Port 8793 (the default) is taken on this kind of machine.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(st["log_port"]),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
                "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
                # The ledger as Airflow's own connection: tasks, the job they submit and the Dead
                # letters pages resolve it (tidemark.core.settings.airflow_ledger), and Airflow
                # masks its password in task logs. TIDEMARK_LEDGER_DSN is for the CLI only.
                "AIRFLOW_CONN_TIDEMARK_LEDGER": ledger_connection(self.ledger_dsn),
                # The local cluster's password is the well-known word "tidemark" (localpg), which
                # Airflow would then mask in every task log line naming a DAG or a path; longer
                # secrets (any real one) are still masked.
                "AIRFLOW__LOGGING__MIN_LENGTH_MASKED_SECRET": "9",
            }
        )
        env.pop("TIDEMARK_LEDGER_DSN", None)
        env.pop(REMOTE, None)  # spark_default names it (sync_spark_default)
        env.update(self.env_extra)
        return env

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def env_file(self) -> Path:
        return self.home / "airflow.env"

    def write_env_file(self) -> Path:
        """The settings Airflow's processes run with, as ``export`` lines to source before
        running Airflow's own CLI against this stack (``airflow dags list``, ``airflow
        backfill create``). Only the owner may read it: it holds the metadata database's
        password and the stack's keys."""
        env = self.env()
        keys = sorted(k for k in env if k.startswith(("AIRFLOW", "TIDEMARK_", "PYSPARK_")))
        lines = [f"export {k}={shlex.quote(env[k])}" for k in keys]
        # The `airflow` command of this venv, for a shell that has not activated it.
        lines.append(f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"')
        write_private(
            self.env_file,
            "# source this file to run `airflow ...` against the "
            "local Tidemark Airflow\n" + "\n".join(lines) + "\n",
        )
        return self.env_file

    def _airflow(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise TidemarkError(f"airflow {' '.join(args[:2])} failed: {mask(tail[0])}")
        return proc.stdout

    def migrate(self) -> None:
        ensure_database(self.ledger_dsn, self.metadata_db)
        self._airflow("db", "migrate")
        self._airflow("pools", "set", POOL, "1", "Concurrent Tidemark Spark jobs")
        if self.env().get("AIRFLOW__CORE__MULTI_TEAM", "").lower() == "true":
            self._airflow("teams", "sync")  # the teams the DAG bundles name must exist

    def _pidfile(self, component: str) -> Path:
        return self.home / "run" / f"{component}.pid"

    def pids(self) -> dict[str, int]:
        running = {c: daemon.recorded(self._pidfile(c)) for c in COMPONENTS}
        return {c: pid for c, pid in running.items() if pid is not None}

    def start(self, timeout: float = 240) -> None:
        if self.pids():
            raise TidemarkError(f"Airflow already runs from {self.home} (make down stops it)")
        if not _port_free(self.port):
            raise TidemarkError(
                f"port {self.port} on 127.0.0.1 is taken: set TIDEMARK_AIRFLOW_PORT to a free one"
            )
        self.migrate()
        self.write_env_file()
        (self.home / "run").mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        env = self.env()
        for c in COMPONENTS:
            with open(self.home / "logs" / f"{c}.out", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "airflow", c],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=self.home,
                )
            self._pidfile(c).write_text(str(proc.pid))
        self.wait_healthy(timeout)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "not answering"
        while time.monotonic() < deadline:
            dead = [c for c in COMPONENTS if c not in self.pids()]
            if dead:
                raise TidemarkError(
                    f"Airflow {dead[0]} exited; see {self.home / 'logs' / (dead[0] + '.out')}"
                )
            try:
                h = self.health()
                states = {k: (v or {}).get("status") for k, v in h.items()}
                if all(
                    states.get(k) == "healthy"
                    for k in ("metadatabase", "scheduler", "dag_processor", "triggerer")
                ):
                    return
                last = ", ".join(f"{k} {v}" for k, v in states.items())
            except Exception as exc:  # noqa: BLE001 - not listening yet
                last = type(exc).__name__
            time.sleep(1)
        raise TidemarkError(
            f"Airflow not healthy after {timeout:.0f}s ({last}); logs in {self.home / 'logs'}"
        )

    def stop(self, timeout: float = 30) -> bool:
        """Stop every component (and the task processes in their groups); True if any ran."""
        pids = self.pids()
        daemon.stop_groups(pids.values(), timeout)
        for c in COMPONENTS:
            self._pidfile(c).unlink(missing_ok=True)
        return bool(pids)

    # -- REST API --------------------------------------------------------------------------
    def token(self, user: str = USER, password: str | None = None) -> str:
        import httpx

        r = httpx.post(
            f"{self.url}/auth/token",
            json={"username": user, "password": password or self.password(user)},
            timeout=30,
        )
        r.raise_for_status()
        return r.json()["access_token"]

    def wait_dag(self, dag_id: str, timeout: float = 180) -> dict:
        """Wait until the DAG processor has parsed ``dag_id``; returns the DAG's record."""
        deadline = time.monotonic() + timeout
        with self.api() as api:
            while time.monotonic() < deadline:
                r = api.get(f"/dags/{dag_id}")
                if r.status_code == 200:
                    return r.json()
                time.sleep(1)
            errors = api.get("/importErrors").json().get("import_errors", [])
        hint = (
            f"; import errors: {errors[0]['filename']}: {errors[0]['stack_trace'][-300:]}"
            if errors
            else ""
        )
        raise TidemarkError(f"DAG {dag_id} not parsed after {timeout:.0f}s{hint}")

    def unpause(self, dag_id: str) -> None:
        self.wait_dag(dag_id)
        with self.api() as api:
            api.patch(f"/dags/{dag_id}", json={"is_paused": False}).raise_for_status()

    def api(self, token: str | None = None):
        import httpx

        return httpx.Client(
            base_url=f"{self.url}/api/v2",
            timeout=30,
            headers={"Authorization": f"Bearer {token or self.token()}"},
        )


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()
