"""The DAGs on a Spark Connect service: a pipeline whose Spark connection
(``airflow.spark_conn_id``) is a ``spark_connect`` one, made through Airflow's REST API with a
token, replays through the session's Connect server (tests/conftest.py: connect_server) in the
session's real Airflow (tests/airflow_site.py); the token is in no task log, command line or
process environment."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.conftest import Env
from tests.invariants import assert_exactly_once
from tests.test_airflow import PIPELINES, module_world

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.spark, pytest.mark.timeout(900)]

N = 60
TOKEN = "s3cr3t-connect-T0KEN"  # long enough for Airflow to mask (MIN_LENGTH_MASKED_SECRET)


class ProcessWatch:
    """Every process's command line and environment seen while it runs (this user's, read
    from /proc), until stopped: what `ps` and a curious local user could read."""

    def __init__(self):
        self.seen: dict[int, tuple[str, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):  # /proc offers no process-started event
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    env = Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n")
                except OSError:  # ended, or another user's
                    continue
                self.seen[int(pid)] = (cmd.decode(errors="replace"), env.decode(errors="replace"))


@pytest.fixture(scope="module")
def world(airflow_site, pg, connect_server, tmp_path_factory):
    site = airflow_site
    tmp = tmp_path_factory.mktemp("airflow-connect")
    env = Env(pg, tmp)
    env.append_orders(range(N))
    env.pipeline("viaconnect", airflow={"retries": 0, "spark_conn_id": "tm_connect"})
    files = {"tidemark_pipelines.py": PIPELINES}
    with module_world(
        site, env, "test_airflow_connect", tmp / "docs", files, ["tidemark_viaconnect"]
    ) as w:
        # The Spark provider's spark_connect connection, as a user makes it in Airflow, with
        # a token (its "password"). Host localhost: PySpark sends a token to a server without
        # TLS only on localhost (grpc local credentials); the test server ignores it.
        w.add_connection(
            connection_id="tm_connect",
            conn_type="spark_connect",
            host="localhost",
            port=int(connect_server.url.rsplit(":", 1)[1]),
            password=TOKEN,
        )
        yield w


def test_a_spark_connect_connection_runs_the_job_there_keeping_its_token_secret(world):
    with ProcessWatch() as watch:
        run_id, state = world.run_to_end("tidemark_viaconnect")
    log = world.log("tidemark_viaconnect", run_id, "replay")
    assert state == "success", log[-3000:]
    assert_exactly_once(world.env, "viaconnect")
    assert world.env.q(world.env.sink_dsn, "SELECT count(*) FROM public.orders") == [(N,)]
    # It ran as a tidemark process on the Connect endpoint, not through spark-submit.
    assert "running the job on Spark Connect at sc://localhost:" in log
    jobs = [cmd for cmd, _ in watch.seen.values() if "-m tidemark" in cmd and "viaconnect" in cmd]
    assert jobs, "the job's process was never seen"
    assert not [
        cmd for cmd, _ in watch.seen.values() if "spark-submit" in cmd and "viaconnect" in cmd
    ]
    # The token: in no task log, no process's command line, no process's environment.
    assert TOKEN not in log
    leaks = [pid for pid, (cmd, env) in watch.seen.items() if TOKEN in cmd or TOKEN in env]
    assert leaks == [], f"the token is visible in processes {leaks}"
