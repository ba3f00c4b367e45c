"""Airflow end to end: a real Airflow 3.3 (API server, scheduler, DAG processor, LocalExecutor),
the session's (tests/airflow_site.py), DAGs generated from pipeline YAMLs, Spark jobs through
SparkSubmitOperator, alerts to a real SMTP server (aiosmtpd) and a real HTTP receiver."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.airflow_site import AirflowSite, Inbox
from tests.conftest import REPO, Env
from tidemark.devstack.airflow_stack import Stack
from tidemark.sources.postgres_log import append, create_log_table

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]

PIPELINES = (REPO / "dags" / "tidemark_pipelines.py").read_text()
PIPELINE_FILES = (REPO / "dags" / "tidemark_pipeline_files.py").read_text()
MAINTENANCE = (REPO / "dags" / "tidemark_maintenance.py").read_text()
N = 120  # records in the source log (2 partitions)
# Between REST polls for a run's end: a run ends up to this much before the test sees it
# (2 s cost about 1 s a wait, 32 waits in this module); each poll is one cheap GET.
POLL = 0.5
# Downstream DAGs scheduled on sink tables, by the postgres provider's asset URI; each returns
# the extras of the asset events that triggered it.
DOWNSTREAM = """
from airflow.sdk import DAG, Asset, task

for dag_id, uri in {uris!r}.items():
    with DAG(dag_id, schedule=[Asset(uri)], catchup=False, tags=["downstream"]):
        @task
        def seen(triggering_asset_events=None, uri=uri):
            return [e.extra for e in triggering_asset_events[Asset(uri)]]

        seen()
"""


WT0 = datetime(2026, 1, 1, tzinfo=UTC)
# (id, time after WT0) of the windowed pipeline's records: two in the first hour, one in the
# second, one in the fourth.
WLOG = [(1, timedelta(minutes=10)), (2, timedelta(minutes=50)), (3, timedelta(minutes=70)),
        (4, timedelta(minutes=200))]  # fmt: skip


def _wrec(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"w{i}", "amount": 1.0, "version": 1}).encode()


class World:
    def __init__(
        self, env: Env, stack: Stack, mails: Inbox, hooks: Inbox, lineage_file: Path, stats: Inbox
    ):
        self.env, self.stack, self.mails, self.hooks = env, stack, mails, hooks
        self.lineage_file, self.stats = lineage_file, stats
        self.api = stack.api()

    def add_connection(self, **conn: object) -> None:
        """An Airflow connection, made through the REST API as a user makes one."""
        r = self.api.post("/connections", json=conn)
        assert r.status_code == 201, r.text

    def trigger(self, dag_id: str, conf: dict | None = None):
        self.stack.unpause(dag_id)
        return self.api.post(
            f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}}
        )

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 420) -> str:
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.api.get(f"/dags/{dag_id}/dagRuns/{run_id}").json()["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(POLL)  # polling the REST API: Airflow offers no run-finished event
        raise AssertionError(f"{dag_id} {run_id} still {state} after {timeout}s")

    def run_to_end(self, dag_id: str, conf: dict | None = None) -> tuple[str, str]:
        """Trigger ``dag_id`` and wait for the run: its id and the state it ended in."""
        r = self.trigger(dag_id, conf)
        assert r.status_code == 200, r.text
        run_id = r.json()["dag_run_id"]
        return run_id, self.wait_run(dag_id, run_id)

    def wait_latest(self, dag_id: str) -> str:
        """The state the newest run of ``dag_id`` ended in, once it has."""
        (latest,) = self.api.get(
            f"/dags/{dag_id}/dagRuns", params={"order_by": "-run_after", "limit": 1}
        ).json()["dag_runs"]
        return self.wait_run(dag_id, latest["dag_run_id"])

    def fails_at_once(self, dag_id: str, task_id: str) -> tuple[str, str]:
        """Trigger ``dag_id``, see its run fail with ``task_id`` failed on its first try (no
        retry), and return the run id and the text of the alert that names the run."""
        run_id, state = self.run_to_end(dag_id)
        assert state == "failed"
        ti = self.api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}").json()
        assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
        return run_id, self.hooks.wait(lambda h: run_id in h["json"]["text"])["json"]["text"]

    def tasks(self, dag_id: str, run_id: str) -> dict[str, str]:
        r = self.api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()
        return {t["task_id"]: t["state"] for t in r["task_instances"]}

    def log(self, dag_id: str, run_id: str, task: str, try_number: int = 1) -> str:
        r = self.api.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task}/logs/{try_number}",
            headers={"Accept": "application/json"},
        )
        lines = []
        for c in r.json().get("content", []):
            if not isinstance(c, dict):
                lines.append(str(c))
                continue
            lines.append(c.get("event", ""))
            # A task's exception is a structured field of its "failed" line.
            lines += [
                f"{e.get('exc_type')}: {e.get('exc_value')}"
                for e in c.get("error_detail") or []
                if isinstance(e, dict)
            ]
        return "\n".join(lines)

    def runs(self, dag_id: str) -> list[dict]:
        return self.api.get(f"/dags/{dag_id}/dagRuns", params={"order_by": "run_after"}).json()[
            "dag_runs"
        ]

    def airflow_backfill(self, dag_id: str, to_date: str) -> list[dict]:
        """Airflow's own Backfill of ``dag_id`` from 2026-01-01T00:00Z to ``to_date``: its runs
        (at least two), once all have ended."""
        r = self.api.post(
            "/backfills",
            json={
                "dag_id": dag_id,
                "from_date": "2026-01-01T00:00:00Z",
                "to_date": to_date,
                "max_active_runs": 1,
                "reprocess_behavior": "completed",
            },
        )
        assert r.status_code in (200, 201), r.text
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = [x for x in self.runs(dag_id) if x["run_type"] == "backfill"]
            if len(runs) >= 2 and all(x["state"] in ("success", "failed") for x in runs):
                return runs
            time.sleep(POLL)  # polling the REST API: Airflow offers no run-finished event
        raise AssertionError(f"{dag_id}: backfill runs {self.runs(dag_id)} after 300 s")

    def wait_runs(self, dag_id: str, count: int, timeout: float = 240) -> list[dict]:
        """At least ``count`` runs of ``dag_id`` (an asset-scheduled DAG), all finished."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runs = self.runs(dag_id)
            if len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs):
                return runs
            time.sleep(POLL)  # polling the REST API: Airflow offers no run-created event
        raise AssertionError(f"{dag_id}: {self.runs(dag_id)} after {timeout}s")

    def asset_events(self, uri: str) -> list[dict]:
        assets = self.api.get("/assets", params={"uri_pattern": uri}).json()["assets"]
        ids = [a["id"] for a in assets if a["uri"] == uri]
        assert ids, f"no asset {uri}: {assets}"
        return self.api.get("/assets/events", params={"asset_id": ids[0]}).json()["asset_events"]

    def lineage(self, pred, timeout: float = 120) -> dict:
        """The first OpenLineage event the file transport wrote that matches ``pred``."""
        deadline = time.monotonic() + timeout
        events: list[dict] = []
        while time.monotonic() < deadline:
            if self.lineage_file.exists():
                events = [
                    json.loads(line)
                    for line in self.lineage_file.read_text().splitlines()
                    if line.strip()
                ]
                found = [e for e in events if pred(e)]
                if found:
                    return found[0]
            time.sleep(1)  # the listener writes after the task ends: poll the file
        raise AssertionError(
            f"no matching OpenLineage event in {timeout}s; jobs: "
            f"{sorted({(e['job']['name'], e.get('eventType')) for e in events})}"
        )

    def xcom(self, dag_id: str, run_id: str, task: str):
        r = self.api.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task}/xcomEntries/return_value"
        )
        assert r.status_code == 200, r.text
        return r.json()["value"]


@pytest.fixture(scope="module")
def world(airflow_site, pg, tmp_path_factory):
    site = airflow_site
    tmp = tmp_path_factory.mktemp("airflow")
    env = Env(pg, tmp)
    env.append_orders(range(N))
    alerts = {"email": ["ops@example.com"], "webhook_conn_id": "tidemark_webhook"}
    fast = {"retries": 0, "driver_memory": "1g"}
    # orders retries (quickly): a failure that must not retry shows as one try.
    env.pipeline("orders", alerts=alerts, airflow={**fast, "retries": 2, "retry_delay_seconds": 1})
    env.pipeline(
        "gated",
        alerts={**alerts, "dlq_max": 0, "lag_max_records": 10},
        airflow=fast,
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.gated", "key": ["id"]}],
        quality={
            "batch": [{"expect_table_row_count_to_be_between": {"min_value": 1, "max_value": 5}}]
        },
    )
    (env.dir / "broken.yaml").write_text("name: broken\nsource: {type: kafka}\n")
    # A new user's pipeline on connections made through Airflow's API (below), one naming a
    # connection nobody made, and one whose second sink's server is down.
    env.pipeline(
        "viaconn",
        airflow=fast,
        source={"type": "postgres_log", "conn_id": "newuser_src", "table": "src.log"},
        sinks=[{"name": "wh", "conn_id": "newuser_wh", "table": "public.viaconn", "key": ["id"]}],
    )
    env.pipeline(
        "noconn",
        alerts=alerts,
        airflow=fast,
        sinks=[{"name": "main", "conn_id": "nowhere_wh", "table": "public.noconn", "key": ["id"]}],
    )
    # On a schedule with a period, which Airflow's own Backfill accepts.
    env.pipeline(
        "hourly",
        airflow=fast,
        schedule="0 * * * *",
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.hourly", "key": ["id"]}],
    )
    # Opted in: Airflow's own Backfill re-delivers each run's data interval. Its own log,
    # with times in the past, so that Airflow's Backfill may cover them.
    with psycopg.connect(env.ledger_dsn) as c:
        create_log_table(c, "src.wlog")
        append(c, "src.wlog", [(0, str(i).encode(), _wrec(i), None, WT0 + m) for i, m in WLOG])
    env.pipeline(
        "windowed",
        airflow={**fast, "backfill_by_interval": True},
        schedule="0 * * * *",
        source={"type": "postgres_log", "dsn": env.ledger_dsn, "table": "src.wlog"},
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.windowed", "key": ["id"]}],
    )
    env.pipeline(
        "offline",
        alerts=alerts,
        airflow=fast,
        sinks=[
            {"name": "main", "dsn": env.sink_dsn, "table": "public.offline", "key": ["id"]},
            {
                "name": "down",
                "dsn": "postgresql://nobody@127.0.0.1:1/gone?connect_timeout=3",
                "table": "public.offline",
                "key": ["id"],
            },
        ],
    )
    host = f"postgres://127.0.0.1:{pg.port}/{env.names['sink']}/public"
    downstream = DOWNSTREAM.format(
        uris={
            "downstream_orders": f"{host}/orders",
            "downstream_gated": f"{host}/gated",
            "downstream_offline": f"{host}/offline",
        }
    )
    files = {
        "tidemark_pipelines.py": PIPELINES,
        "tidemark_pipeline_files.py": PIPELINE_FILES,
        "tidemark_maintenance.py": MAINTENANCE,
        "downstream.py": downstream,
    }
    dag_ids = ["tidemark_orders", "tidemark_gated", "tidemark_maintenance"]
    dag_ids += ["downstream_orders", "downstream_gated", "downstream_offline"]
    with module_world(site, env, "test_airflow", tmp / "docs", files, dag_ids) as w:
        for dag_id in dag_ids[3:]:
            w.stack.unpause(dag_id)
        for conn_id, dsn in (("newuser_src", env.ledger_dsn), ("newuser_wh", env.sink_dsn)):
            c = conninfo_to_dict(dsn)
            w.add_connection(
                connection_id=conn_id,
                conn_type="postgres",
                host=c["host"],
                port=int(c["port"]),
                login=c["user"],
                password=c["password"],
                schema=c["dbname"],
            )
        yield w


@contextlib.contextmanager
def module_world(
    site: AirflowSite, env: Env, module: str, docs: Path, files: dict[str, str], dag_ids: list[str]
) -> Iterator[World]:
    """A test module's DAG folder in the session's Airflow: ``env``'s pipelines and ``files``,
    each of ``dag_ids`` parsed from it; the World that drives it. At the end the folder's DAGs
    and what the module added to Airflow are gone, and ``env`` dropped."""
    dags = site.enter(module, env.ledger_dsn, docs)
    try:
        shutil.move(env.dir, dags / "pipelines")
        env.dir = dags / "pipelines"
        for name, text in files.items():
            (dags / name).write_text(text)
        site.wait_dags(dags, dag_ids)
        w = World(env, site.stack, site.mails, site.hooks, site.lineage_file, site.stats)
        try:
            yield w
        finally:
            w.api.close()
    finally:
        site.leave(dags)
        env.drop()


def test_dags_parsed_and_broken_yaml_is_one_import_error(world):
    """One DAG file makes every pipeline file's DAGs: the YAML alone is enough."""
    for dag_id in (
        "tidemark_orders",
        "tidemark_orders_backfill",
        "tidemark_gated",
        "tidemark_gated_backfill",
        "tidemark_viaconn",
        "tidemark_offline_redrive",
        "tidemark_maintenance",
    ):
        dag = world.stack.wait_dag(dag_id)
        assert "tidemark" in [t["name"] for t in dag["tags"]]
    errors = world.api.get("/importErrors").json()["import_errors"]
    assert [Path(e["filename"]).name for e in errors] == ["tidemark_pipeline_files.py"]
    assert "broken.yaml: source" in errors[0]["stack_trace"]
    details = world.api.get("/dags/tidemark_orders/details").json()
    assert details["max_active_runs"] == 1


def test_trigger_replays_exactly_once_and_reports(world):
    run_id, state = world.run_to_end("tidemark_orders")
    assert state == "success", world.tasks("tidemark_orders", run_id)
    env = world.env
    assert env.checkpoints() == {0: N // 2, 1: N // 2}
    assert env.q(env.sink_dsn, "SELECT count(*), count(DISTINCT id) FROM public.orders")[0] == (
        N,
        N,
    )
    assert env.prepared() == []
    report = world.xcom("tidemark_orders", run_id, "report")
    assert report["sinks"]["main"]["state"] == "committed"
    assert report["sinks"]["main"]["counts"]["rows"] == N
    ids = env.ledger(
        "SELECT dag_id, dag_run_id, task_id, try_number FROM tidemark.runs WHERE run_id = %s",
        (report["run_id"],),
    )[0]
    assert ids == ("tidemark_orders", run_id, "replay", 1)
    # The ledger came from the Airflow connection tidemark_ledger (the tasks, and the job
    # through the env the operator hands it): Airflow's processes have no TIDEMARK_LEDGER_DSN.
    # (Here the connection is in Airflow's database; `make up` sets it in the environment,
    # tests/test_ops.py.)
    assert "TIDEMARK_LEDGER_DSN" not in world.stack.env()
    conn = world.api.get("/connections/tidemark_ledger").json()
    assert (conn["schema"], conn["login"]) == (env.names["ledger"], "tidemark")
    # The report task sent the run's numbers through Airflow's StatsD client.
    world.stats.wait(lambda m: m == f"airflow.tidemark.records_delivered.orders.main:{N}|c")
    world.stats.wait(lambda m: m == "airflow.tidemark.records_quarantined.orders.main:0|c")
    world.stats.wait(lambda m: m == "airflow.tidemark.sink_runs.orders.main.committed:1|c")
    for timing in (
        "run_duration.orders",
        "phase.orders.main.write",
        "phase.orders.main.commit",
        "phase.orders.main.task_copy",
    ):
        world.stats.wait(
            lambda m, t=timing: m.startswith(f"airflow.tidemark.{t}:") and m.endswith("|ms")
        )


def test_commit_emits_sink_asset_event_and_lineage(world):
    """The first commit of orders: an asset event on its sink table (postgres provider URI)
    that a downstream DAG runs on, and OpenLineage events for the replay task."""
    env = world.env
    first = env.ledger("SELECT min(run_id) FROM tidemark.runs WHERE pipeline = 'orders'")[0][0]
    uri = f"postgres://127.0.0.1:{env.cluster.port}/{env.names['sink']}/public/orders"
    run = world.wait_runs("downstream_orders", 1)[0]
    assert run["state"] == "success" and run["run_type"] == "asset_triggered", run
    extras = world.xcom("downstream_orders", run["dag_run_id"], "seen")
    assert len(extras) == 1, extras
    extra = extras[0]
    assert {k: extra[k] for k in ("pipeline", "sink", "table", "run_id", "mode")} == {
        "pipeline": "orders",
        "sink": "main",
        "table": "public.orders",
        "run_id": first,
        "mode": "run",
    }
    assert extra["ranges"] == [
        {"partition": 0, "from_offset": 0, "to_offset": N // 2},
        {"partition": 1, "from_offset": 0, "to_offset": N // 2},
    ]
    assert extra["counts"]["rows"] == N and extra["counts"]["dead"] == 0
    assert [e["extra"]["run_id"] for e in world.asset_events(uri)][:1] == [first]

    dag_run = env.ledger("SELECT dag_run_id FROM tidemark.runs WHERE run_id = %s", (first,))[0][0]
    ev = world.lineage(
        lambda e: (
            e["job"]["name"] == "tidemark_orders.replay"
            and e["eventType"] == "COMPLETE"
            and e["run"]["facets"].get("airflow", {}).get("dagRun", {}).get("run_id") == dag_run
        )
    )
    server = f"postgres://127.0.0.1:{env.cluster.port}"
    assert [(i["namespace"], i["name"]) for i in ev["inputs"]] == [
        (server, f"{env.names['ledger']}.src.log")
    ]
    assert [
        (o["namespace"], o["name"], o["outputFacets"]["outputStatistics"]["rowCount"])
        for o in ev["outputs"]
    ] == [(server, f"{env.names['sink']}.public.orders", N)]
    parent = ev["run"]["facets"]["parent"]
    assert (parent["job"]["namespace"], parent["job"]["name"]) == (
        "tidemark-test",
        "tidemark_orders",
    )
    world.lineage(
        lambda e: (
            e["job"]["name"] == "tidemark_orders"  # the DAG run's own events
            and e["run"]["runId"] == parent["run"]["runId"]
        )
    )


def test_idle_run_skips_spark_and_announces_nothing(world):
    """Nothing new since the last commit: the first task says so and replay and report are
    skipped (no JVM, no Great Expectations), with no asset event."""
    env = world.env
    for run in world.runs("tidemark_orders"):
        world.wait_run("tidemark_orders", run["dag_run_id"])
    uri = f"postgres://127.0.0.1:{env.cluster.port}/{env.names['sink']}/public/orders"
    before = len(world.asset_events(uri))
    run_id, state = world.run_to_end("tidemark_orders")
    assert state == "success"
    assert world.tasks("tidemark_orders", run_id) == {
        "recover": "success",
        "replay": "skipped",
        "report": "skipped",
        "announce": "skipped",
    }
    assert "orders: up to date: nothing to replay" in world.log(
        "tidemark_orders", run_id, "recover"
    )
    assert len(world.asset_events(uri)) == before
    assert env.ledger("SELECT count(*) FROM tidemark.runs WHERE dag_run_id = %s", (run_id,)) == [
        (0,)
    ]


def test_backfill_params_validated_and_run(world):
    bad = world.trigger(
        "tidemark_orders_backfill",
        {"partition": -1, "from_offset": 0, "to_offset": 10, "sinks": ["main"]},
    )
    assert bad.status_code == 400 and "partition" in bad.text
    bad = world.trigger(
        "tidemark_orders_backfill",
        {"partition": 0, "from_offset": 0, "to_offset": 10, "sinks": ["nope"]},
    )
    assert bad.status_code == 400, bad.text

    world.wait_latest("tidemark_orders")  # the backfill needs the range committed
    run_id, state = world.run_to_end(
        "tidemark_orders_backfill",
        {"partition": 0, "from_offset": 20, "to_offset": 10, "sinks": ["main"]},
    )
    assert state == "failed"
    assert world.tasks("tidemark_orders_backfill", run_id)["check"] == "failed"
    mail = world.mails.wait(lambda m: run_id in m["Subject"])
    assert "to_offset (10) must be greater than from_offset (20)" in mail.get_body().get_content()

    env = world.env
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute("UPDATE public.orders SET name = 'tampered' WHERE id = 4")
    run_id, state = world.run_to_end(
        "tidemark_orders_backfill",
        {"partition": 0, "from_offset": 0, "to_offset": 10, "sinks": ["main"]},
    )
    assert state == "success", world.tasks("tidemark_orders_backfill", run_id)
    assert env.q(env.sink_dsn, "SELECT name FROM public.orders WHERE id = 4") == [("order-4",)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM public.orders")[0][0] == N
    assert env.checkpoints() == {0: N // 2, 1: N // 2}
    report = world.xcom("tidemark_orders_backfill", run_id, "report")
    assert report["mode"] == "backfill" and report["sinks"]["main"]["counts"]["rows"] == 10


def test_redrive_dag_hands_the_job_a_ledger_request(world):
    """After a bad deploy: records 0 .. 9 quarantined as validation instead of delivered. The
    redrive DAG's select task records the selection as a redrive request and the Spark job
    gets only its id (XCom and command line), then places each record once."""
    env = world.env
    world.wait_latest("tidemark_orders")
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute("DELETE FROM public.orders WHERE id < 10")
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("""INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
                         source_offset, key, payload, headers, error_class, reason)
                     SELECT 'orders', 'main', 1, "partition", "offset", key, payload, headers,
                            'validation', 'bad deploy'
                     FROM src.log WHERE convert_from(key, 'UTF8')::int < 10""")
    run_id, state = world.run_to_end(
        "tidemark_orders_redrive", {"error_class": "validation", "requested_by": "erin"}
    )
    assert state == "success", world.tasks("tidemark_orders_redrive", run_id)
    request = world.xcom("tidemark_orders_redrive", run_id, "select")
    assert isinstance(request, int)
    assert env.ledger(
        "SELECT pipeline, letters, selection->>'error_class' FROM "
        "tidemark.redrive_requests WHERE request_id = %s",
        (request,),
    ) == [("orders", 10, "validation")]
    # The job's command line as Airflow rendered it (not the task log's echo of it).
    ti = world.api.get(f"/dags/tidemark_orders_redrive/dagRuns/{run_id}/taskInstances/replay")
    args = ti.json()["rendered_fields"]["application_args"]
    assert str(args[args.index("--request") + 1]) == str(request), args
    assert env.ledger(
        "SELECT status::text, count(*) FROM tidemark.dlq WHERE pipeline = 'orders' GROUP BY 1"
    ) == [("redriven", 10)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM public.orders")[0][0] == N
    report = world.xcom("tidemark_orders_redrive", run_id, "report")
    assert report["mode"] == "redrive" and report["sinks"]["main"]["state"] == "committed"
    assert env.prepared() == []


def test_failed_task_alerts_by_mail_and_webhook(world):
    run_id, state = world.run_to_end("tidemark_gated")
    assert state == "failed"
    assert world.tasks("tidemark_gated", run_id)["replay"] == "failed"
    env = world.env
    assert env.q(env.sink_dsn, "SELECT to_regclass('public.gated')") == [(None,)]
    assert set(env.checkpoints("gated").values()) <= {0}  # seeded, never moved
    mail = world.mails.wait(lambda m: "gated" in m["Subject"] and run_id in m["Subject"])
    assert "replay" in mail["Subject"] and mail["To"] == "ops@example.com"
    body = mail.get_body(("plain", "html")).get_content()
    assert "/tidemark/dlq/?pipeline=gated" in body
    assert f"{world.stack.url}/dags/tidemark_gated/runs/" in body or "log" in body.lower()
    hook = world.hooks.wait(lambda h: run_id in h["json"]["text"])
    text = hook["json"]["text"]
    assert hook["path"] == "/hook/T0K3N"
    for fact in (
        "gated",
        "replay",
        run_id,
        "/tidemark/dlq/?pipeline=gated",
        "data-quality gate failed: expect_table_row_count_to_be_between",
    ):
        assert fact in text
    # Nothing committed: no asset event, so the DAG scheduled on the sink never ran.
    assert (
        world.asset_events(
            f"postgres://127.0.0.1:{env.cluster.port}/{env.names['sink']}/public/gated"
        )
        == []
    )
    assert world.runs("downstream_gated") == []
    # Lineage says what failed: the gate's verdict on the input, nothing written.
    ev = world.lineage(
        lambda e: e["job"]["name"] == "tidemark_gated.replay" and e["eventType"] == "FAIL"
    )
    checks = ev["inputs"][0]["inputFacets"]["dataQualityAssertions"]["assertions"]
    assert {"assertion": "expect_table_row_count_to_be_between", "success": False} in [
        {k: a[k] for k in ("assertion", "success")} for a in checks
    ]
    assert [o["outputFacets"]["outputStatistics"]["rowCount"] for o in ev["outputs"]] == [0]
    # the failed run's outcome still reaches the metrics (sent by replay: report did not run)
    world.stats.wait(lambda m: m == "airflow.tidemark.sink_runs.gated.main.dq_failed:1|c")


def test_maintenance_sweeps_and_alerts_on_dlq_growth(world):
    env = world.env
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("""INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition,
                                               source_offset, payload, error_class, reason)
                     SELECT 'gated', 'main', coalesce(max(run_id), 0), 0, 999999, 'x', 'decode',
                            'payload is not JSON'
                     FROM tidemark.runs""")
    # A retention of its own, written into the running pipeline's file (no restart): the
    # prune task reads it on this run and drops the sink's old retired table.
    import yaml

    path = env.dir / "orders.yaml"
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "retention": {"retired_tables_days": 30}}))
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE public.orders_20200101_run1 (id int)")
    run_id, state = world.run_to_end("tidemark_maintenance")
    assert state == "failed"
    # Recovery could not reach offline's second sink nor resolve noconn's connection: its
    # task fails, and the check still runs, for every pipeline.
    assert world.tasks("tidemark_maintenance", run_id) == {
        "recover": "failed",
        "check": "failed",
        "prune": "success",
    }
    # This run's prune, or a scheduled one's before it (the DAG runs every 5 minutes).
    assert env.q(env.sink_dsn, "SELECT to_regclass('public.orders_20200101_run1')") == [(None,)]
    prune_logs = [
        world.log("tidemark_maintenance", r["dag_run_id"], "prune")
        for r in world.runs("tidemark_maintenance")
    ]
    dropped = "dropped retired table public.orders_20200101_run1 (pipeline orders sink main"
    assert any(dropped in log for log in prune_logs), prune_logs[-1][-3000:]
    assert "pipeline orders: its own retention:" in world.log(
        "tidemark_maintenance", run_id, "prune"
    )
    recover_log = world.log("tidemark_maintenance", run_id, "recover")
    assert "nowhere_wh" in recover_log and "127.0.0.1:1" in recover_log, recover_log[-3000:]
    mail = world.mails.wait(lambda m: "gated: needs attention" in m["Subject"])
    assert "1 records quarantined in the DLQ (&gt; 0)" in mail.get_body().get_content()
    hook = world.hooks.wait(lambda h: "gated: needs attention" in h["json"]["text"])
    assert "quarantined in the DLQ" in hook["json"]["text"]
    # Each broken pipeline alerted on its own, through its own channels.
    offline = world.hooks.wait(lambda h: "offline: needs attention" in h["json"]["text"])
    assert "recovery: cannot scan" in offline["json"]["text"]
    noconn = world.hooks.wait(lambda h: "noconn: needs attention" in h["json"]["text"])
    assert "nowhere_wh" in noconn["json"]["text"]
    assert not [m for m in world.mails.items if "orders: needs attention" in m["Subject"]]

    # The check's gauges, through Airflow's StatsD client.
    def gauge(name: str) -> float:
        line = world.stats.wait(
            lambda m: m.startswith(f"airflow.tidemark.{name}:") and m.endswith("|g")
        )
        return float(line.split(":")[1].removesuffix("|g"))

    assert gauge("checkpoint_lag.gated.main.0") == gauge("checkpoint_lag.gated.main.1") == 60
    assert gauge("checkpoint_lag.orders.main.1") == N // 2 - env.checkpoints().get(1, 0)
    assert gauge("oldest_undelivered_age.gated.main.0") > 0
    assert gauge("dead_letters.gated.decode") == 1
    assert gauge("dead_letters.gated.validation") == 0
    assert gauge("prepared_oldest_age") == 0


def test_lag_alerts_once_per_episode(world):
    """gated never commits (its gate fails): each partition stays 60 records behind, past its
    lag_max_records of 10. The maintenance run of the test above alerted it; another run
    alerts the DLQ again but not the lag, whose episode is still open."""
    first = world.hooks.wait(lambda h: "gated: needs attention" in h["json"]["text"])["json"]
    for part in (0, 1):
        assert (
            f"- sink main partition {part} lags: 60 records behind the source "
            f"(checkpoint 0, source at 60; > 10)"
        ) in first["text"]
    episodes = world.api.get("/variables/tidemark_lag_episodes").json()
    assert sorted(json.loads(episodes["value"])) == ["gated/main/0", "gated/main/1"]
    _, state = world.run_to_end("tidemark_maintenance")
    assert state == "failed"
    # Every run alerts the DLQ again (the schedule may have added runs): only the first the lag.
    texts = [
        h["json"]["text"]
        for h in world.hooks.items
        if "gated: needs attention" in h["json"]["text"]
    ]
    assert len(texts) >= 2 and all("quarantined in the DLQ" in t for t in texts), texts
    assert ["lags" in t for t in texts] == [True] + [False] * (len(texts) - 1), texts
    mails = [
        m.get_body().get_content()
        for m in world.mails.items
        if "gated: needs attention" in m["Subject"]
    ]
    assert ["partition 0 lags" in m for m in mails] == [True] + [False] * (len(mails) - 1)


def test_a_halted_pipeline_fails_at_once_without_retry(world):
    """Exit 5 (halted) fails the replay task on its first try although orders retries twice;
    the alert says why."""
    env = world.env
    env.ledger("""INSERT INTO tidemark.pipelines (name, config, halted_reason, halted_at)
                  VALUES ('orders', '{}', 'planted by the test', now())
                  ON CONFLICT (name) DO UPDATE SET halted_reason = EXCLUDED.halted_reason,
                                                   halted_at = now() RETURNING name""")
    try:
        _, text = world.fails_at_once("tidemark_orders", "replay")
        assert "pipeline orders is halted: planted by the test" in text
        assert "exit 5: not retried" in text
    finally:
        env.ledger(
            "UPDATE tidemark.pipelines SET halted_reason = NULL, halted_at = NULL "
            "WHERE name = 'orders' RETURNING name"
        )


def test_connections_made_through_airflow_reach_the_job(world):
    """viaconn reads its source and writes its sink through connections created with
    Airflow's REST API (the fixture): the spark-submit child gets them from the task."""
    env = world.env
    run_id, state = world.run_to_end("tidemark_viaconn")
    assert state == "success", world.log("tidemark_viaconn", run_id, "replay")[-3000:]
    assert env.q(env.sink_dsn, "SELECT count(*), count(DISTINCT id) FROM public.viaconn") == [
        (N, N)
    ]
    assert env.checkpoints("viaconn", "wh") == {0: N // 2, 1: N // 2}


def test_a_connection_airflow_lacks_fails_at_once_naming_it(world):
    _, text = world.fails_at_once("tidemark_noconn", "recover")
    assert "pipeline noconn: sink main: Airflow connection 'nowhere_wh' does not exist" in text, (
        text
    )
    assert "not retried" in text


def test_a_sink_that_commits_is_announced_when_another_fails(world):
    """offline commits main and cannot reach down: replay fails (and alerts), and the run
    still announces main's table, so a DAG scheduled on it runs."""
    env = world.env
    run_id, state = world.run_to_end("tidemark_offline")
    assert state == "failed"
    assert world.tasks("tidemark_offline", run_id) == {
        "recover": "success",
        "replay": "failed",
        "report": "upstream_failed",
        "announce": "success",
    }
    assert env.q(env.sink_dsn, "SELECT count(*) FROM public.offline") == [(N,)]
    run = world.wait_runs("downstream_offline", 1)[0]
    assert run["state"] == "success" and run["run_type"] == "asset_triggered", run
    (extra,) = world.xcom("downstream_offline", run["dag_run_id"], "seen")
    assert (extra["pipeline"], extra["sink"], extra["counts"]["rows"]) == ("offline", "main", N)


def test_airflows_own_backfill_re_delivers_each_runs_data_interval_when_opted_in(world):
    """airflow.backfill_by_interval: each run of Airflow's Backfill of tidemark_windowed
    re-delivers the records of its data interval (a backfill by time), and the backfill
    DAG's form takes a time window too."""
    env = world.env
    world.stack.unpause("tidemark_windowed")  # its first scheduled run delivers every record
    first = world.wait_runs("tidemark_windowed", 1)[0]
    assert first["state"] == "success", world.tasks("tidemark_windowed", first["dag_run_id"])
    names = "SELECT id, name FROM public.windowed ORDER BY id"
    assert env.q(env.sink_dsn, names) == [(i, f"w{i}") for i, _ in WLOG]
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute("UPDATE public.windowed SET name = 'tampered'")

    runs = world.airflow_backfill("tidemark_windowed", "2026-01-01T01:00:00Z")
    assert len(runs) == 2 and {x["state"] for x in runs} == {"success"}, runs
    # Hours 0 and 1 re-delivered (ids 1, 2 and 3); id 4, at 03:20, was not.
    assert env.q(env.sink_dsn, names) == [(1, "w1"), (2, "w2"), (3, "w3"), (4, "tampered")]
    ids = [x["dag_run_id"] for x in runs]
    assert env.ledger(
        "SELECT mode, count(*) FROM tidemark.runs WHERE pipeline = 'windowed' "
        "AND dag_run_id = ANY(%s) GROUP BY 1",
        (ids,),
    ) == [("backfill", 2)]

    form = world.trigger(
        "tidemark_windowed_backfill",
        {"partition": None, "since": "2026-01-01T03:00:00Z", "until": "2026-01-01T04:00:00Z",
         "sinks": ["main"]},
    )  # fmt: skip
    assert form.status_code == 200, form.text
    run_id = form.json()["dag_run_id"]
    assert world.wait_run("tidemark_windowed_backfill", run_id) == "success", world.tasks(
        "tidemark_windowed_backfill", run_id
    )
    assert env.q(env.sink_dsn, names) == [(i, f"w{i}") for i, _ in WLOG]
    report = world.xcom("tidemark_windowed_backfill", run_id, "report")
    assert report["mode"] == "backfill" and report["sinks"]["main"]["counts"]["rows"] == 1


def test_airflows_own_backfill_of_the_scheduled_dag_is_refused_saying_why(world):
    """A run reads from the checkpoints, not by date: Airflow's Backfill of tidemark_hourly
    would re-deliver nothing and look green. Each of its runs fails at once, saying what to
    use instead, and writes nothing."""
    env = world.env
    world.stack.unpause("tidemark_hourly")  # the scheduler starts no run of a paused DAG
    runs = world.airflow_backfill("tidemark_hourly", "2026-01-01T01:30:00Z")
    assert len(runs) >= 2 and {x["state"] for x in runs} == {"failed"}, runs
    for x in runs:
        ti = world.api.get(
            f"/dags/tidemark_hourly/dagRuns/{x['dag_run_id']}/taskInstances/recover"
        ).json()
        assert (ti["state"], ti["try_number"]) == ("failed", 1), ti
    log = world.log("tidemark_hourly", runs[0]["dag_run_id"], "recover")
    assert "reads from its checkpoints, not by date" in log
    assert "tidemark_hourly_backfill" in log
    assert env.ledger(
        "SELECT count(*) FROM tidemark.runs WHERE pipeline = 'hourly' AND dag_run_id = ANY(%s)",
        ([x["dag_run_id"] for x in runs],),
    ) == [(0,)]


def test_airflows_own_cli_runs_against_the_stack_from_its_env_file(world, tmp_path):
    """`make up` leaves the settings Airflow's CLI needs (no stray SQLite, no migration
    prompt), readable by its owner only, and runs the triggerer too."""
    import subprocess
    import sys

    f = world.stack.env_file
    assert f.stat().st_mode & 0o777 == 0o600
    assert world.stack.health()["triggerer"]["status"] == "healthy"
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run(
        ["bash", "-c", f"source {f} && airflow dags list -o plain"],
        cwd=tmp_path,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    assert {"tidemark_orders", "tidemark_orders_backfill", "tidemark_maintenance"} <= listed
    assert not list(tmp_path.rglob("*.db")), list(tmp_path.rglob("*.db"))
    backfill = world.api.get("/dags/tidemark_gated_backfill").json()
    assert backfill["is_paused"] is False  # triggered only: no unpause before its first use
