"""One real Airflow for the test session, shared by the modules that test through it
(tests/test_airflow.py, tests/test_dlq_web.py, tests/test_dlq_browser.py) instead of one
started and stopped per module: the ``airflow_site`` fixture of tests/conftest.py.

What differed between their stacks is either the same for all of them here (the auth
manager with the user ``scoped``, Spark's master, the SMTP server, webhook receiver, StatsD
server and OpenLineage file that only test_airflow reads) or switched when a module starts
(``enter``, then ``wait_dags``): its DAG folder, its ledger (the Airflow connection ``tidemark_ledger``, kept in
Airflow's database instead of the environment so that it can change) and its Data Docs (a
symlink the processes' TIDEMARK_DATA_DOCS_DIR names). ``leave`` pauses the module's DAGs, fails
its unfinished runs, deletes its DAGs with their history and the connections and variables it
made, so the next module starts as on a fresh Airflow.

tests/test_dlq_teams.py keeps a stack of its own: multi-team mode, the teams' bundles and
their users are settings of Airflow's processes that would change what the others test.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import socket
import threading
import time
from email import policy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from aiosmtpd.controller import Controller

from tidemark.devstack.airflow_stack import Stack, free_port, ledger_connection
from tidemark.devstack.localpg import Cluster

REPO = Path(__file__).resolve().parent.parent
# tests/scoped_auth.py's user, who sees and edits the pipeline orders only. Not imported from
# there: that imports Airflow, whose logging setup would hold on to pytest's captured stderr.
SCOPED_USER = "scoped"


class Inbox:
    """Messages an SMTP server, a webhook receiver or a StatsD server got, awaited by event."""

    def __init__(self):
        self.items: list = []
        self.cond = threading.Condition()

    def put(self, item) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def clear(self) -> None:
        with self.cond:
            self.items.clear()

    def wait(self, pred, timeout: float = 240):
        with self.cond:
            assert self.cond.wait_for(lambda: any(pred(i) for i in self.items), timeout), (
                f"nothing matching arrived in {timeout}s; got {self.items!r}"
            )
            return next(i for i in self.items if pred(i))


class _Mail:
    def __init__(self, inbox: Inbox):
        self.inbox = inbox

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd hook
        self.inbox.put(email.message_from_bytes(envelope.content, policy=policy.default))
        return "250 OK"


def _webhook(inbox: Inbox) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server hook
            body = self.rfile.read(int(self.headers["Content-Length"]))
            inbox.put({"path": self.path, "json": json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _statsd(inbox: Inbox) -> socket.socket:
    """A StatsD server: Tidemark's metric lines into ``inbox`` (Airflow's own are many)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                data = sock.recv(65535)
            except OSError:  # closed
                return
            for line in data.decode().splitlines():
                if ".tidemark." in line:
                    inbox.put(line)

    threading.Thread(target=serve, daemon=True).start()
    return sock


class SharedStack(Stack):
    """The dev stack's Airflow, but with the ledger connection in Airflow's database: an
    AIRFLOW_CONN_ variable would win over it and could not change while the stack runs."""

    def env(self) -> dict[str, str]:
        env = super().env()
        env.pop("AIRFLOW_CONN_TIDEMARK_LEDGER")
        return env


class AirflowSite:
    def __init__(self, cluster: Cluster, root: Path):
        self.root = root
        self.dags = root / "dags"
        self.dags.mkdir()
        self.docs = root / "docs"  # a symlink to the current module's Data Docs
        (root / "no-docs").mkdir()
        self.docs.symlink_to(root / "no-docs")
        self.mails, self.hooks, self.stats = Inbox(), Inbox(), Inbox()
        self.lineage_file = root / "openlineage.jsonl"
        self.smtp = Controller(_Mail(self.mails), hostname="127.0.0.1", port=free_port())
        self.webhook = _webhook(self.hooks)
        self.statsd = _statsd(self.stats)
        self.smtp.start()
        self.stack = SharedStack(
            home=root / "home",
            ledger_dsn=cluster.dsn("postgres"),  # only where the metadata database goes
            port=free_port(),
            dags_folder=self.dags,
            env_extra={
                "TIDEMARK_DATA_DOCS_DIR": str(self.docs),
                # Airflow's SimpleAuthManager plus a user who sees one pipeline only
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
                "AIRFLOW__CORE__AUTH_MANAGER": "tests.scoped_auth.ScopedAuthManager",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": (
                    f"admin:admin,viewer:viewer,{SCOPED_USER}:admin"
                ),
                # A module's new DAG folder is found within this many seconds.
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
                    {"conn_type": "spark", "host": "local[2]"}
                ),
                "AIRFLOW_CONN_SMTP_DEFAULT": json.dumps(
                    {
                        "conn_type": "smtp",
                        "host": "127.0.0.1",
                        "port": self.smtp.port,
                        "extra": {
                            "disable_ssl": True,
                            "disable_tls": True,
                            "from_email": "tidemark@localhost",
                        },
                    }
                ),
                "AIRFLOW_CONN_TIDEMARK_WEBHOOK": json.dumps(
                    {
                        "conn_type": "http",
                        "host": f"http://127.0.0.1:{self.webhook.server_port}/hook/T0K3N",
                    }
                ),
                "AIRFLOW__OPENLINEAGE__NAMESPACE": "tidemark-test",
                "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                    {"type": "file", "log_file_path": str(self.lineage_file), "append": True}
                ),
                "AIRFLOW__METRICS__STATSD_ON": "True",
                "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
                "AIRFLOW__METRICS__STATSD_PORT": str(self.statsd.getsockname()[1]),
                "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
            },
        )
        self._before: tuple[set[str], set[str]] = (set(), set())
        self._ledger: str | None = None  # the current module's
        self.started = False

    def _start(self) -> None:
        # Once the first module's DAG files are in place: the DAG processor parses them while
        # the other components start, instead of finding them at its next refresh.
        self.stack.password(SCOPED_USER)
        self.stack.start()
        self.started = True

    def stop(self) -> None:
        # Once: tests/conftest.py stops it after its last test, the fixture at the session's end.
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        try:
            if self.started:
                self.stack.stop()
        finally:
            self.smtp.stop()
            self.webhook.shutdown()
            self.statsd.close()

    # -- one module at a time --------------------------------------------------------------
    def enter(self, module: str, ledger_dsn: str, docs: Path) -> Path:
        """Point the stack at a module's ledger and Data Docs; returns the empty folder for
        its DAG files (``leave`` removes it)."""
        folder = self.dags / module
        folder.mkdir()
        docs.mkdir(parents=True, exist_ok=True)
        link = self.root / "docs.new"
        link.symlink_to(docs)
        link.replace(self.docs)  # atomic: a process reads the old target or the new one
        for inbox in (self.mails, self.hooks, self.stats):
            inbox.clear()
        self._ledger = ledger_dsn
        if self.started:
            self._point_at_ledger()
        return folder

    def _point_at_ledger(self) -> None:
        assert self._ledger is not None
        with self.stack.api() as api:
            conn = json.loads(ledger_connection(self._ledger))
            extra = conn.pop("extra", None)
            api.delete("/connections/tidemark_ledger")  # 404 when there is none yet
            r = api.post(
                "/connections",
                json={
                    "connection_id": "tidemark_ledger",
                    **conn,
                    **({"extra": json.dumps(extra)} if extra else {}),
                },
            )
            assert r.status_code == 201, r.text
            self._before = (self._connections(api), self._variables(api))

    def wait_dags(self, folder: Path, dag_ids, timeout: float = 180) -> None:
        """Until each DAG is parsed from ``folder``: one of an earlier module's with the same
        id would otherwise answer for it. The first module's call starts the stack, its DAG
        files written."""
        if not self.started:
            self._start()
            self._point_at_ledger()
        deadline = time.monotonic() + timeout
        with self.stack.api() as api:
            for dag_id in dag_ids:
                while True:
                    r = api.get(f"/dags/{dag_id}")
                    dag = r.json() if r.status_code == 200 else {}
                    if dag.get("fileloc", "").startswith(f"{folder}/") and not dag["is_stale"]:
                        break
                    assert time.monotonic() < deadline, f"{dag_id} not parsed from {folder}: {dag}"
                    time.sleep(1)  # the DAG processor tells nobody it has parsed a file

    def leave(self, folder: Path, timeout: float = 120) -> None:
        """Remove a module's DAGs, their runs and what it added to Airflow's connections and
        variables, and its DAG folder."""
        if not self.started:  # the module failed before its wait_dags
            shutil.rmtree(folder)
            return
        with self.stack.api() as api:
            dags = [
                d["dag_id"]
                for d in api.get("/dags", params={"limit": 1000, "exclude_stale": False}).json()[
                    "dags"
                ]
                if d["fileloc"].startswith(f"{folder}/")
            ]
            for dag_id in dags:
                api.patch(f"/dags/{dag_id}", json={"is_paused": True}).raise_for_status()
                runs = api.get(
                    f"/dags/{dag_id}/dagRuns",
                    params={"state": ["queued", "running"], "limit": 1000},
                ).json()["dag_runs"]
                for run in runs:
                    api.patch(
                        f"/dags/{dag_id}/dagRuns/{run['dag_run_id']}", json={"state": "failed"}
                    ).raise_for_status()
            shutil.rmtree(folder)
            deadline = time.monotonic() + timeout
            # The DAG processor marks DAGs whose files are gone stale in one UPDATE of them
            # all: a DAG deleted meanwhile fails it (StaleDataError), and the processor exits,
            # leaving every later module unparsed. So delete only once it has marked them.
            for dag_id in dags:
                while (r := api.get(f"/dags/{dag_id}")).status_code == 200 and not r.json()[
                    "is_stale"
                ]:
                    assert time.monotonic() < deadline, f"{dag_id}: not marked stale"
                    time.sleep(0.5)
            for dag_id in dags:
                # 409 while a task of a run just failed is still being stopped
                while (code := api.delete(f"/dags/{dag_id}").status_code) == 409:
                    assert time.monotonic() < deadline, f"{dag_id}: tasks still running"
                    time.sleep(1)
                assert code in (204, 404), (dag_id, code)
            conns, variables = self._before
            for conn_id in self._connections(api) - conns:
                api.delete(f"/connections/{conn_id}").raise_for_status()
            for key in self._variables(api) - variables:
                api.delete(f"/variables/{key}").raise_for_status()

    @staticmethod
    def _connections(api) -> set[str]:
        r = api.get("/connections", params={"limit": 1000})
        return {c["connection_id"] for c in r.json()["connections"]}

    @staticmethod
    def _variables(api) -> set[str]:
        r = api.get("/variables", params={"limit": 1000})
        return {v["key"] for v in r.json()["variables"]}
