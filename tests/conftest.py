"""Shared fixtures: a real PostgreSQL cluster, fresh databases per test, a real SparkSession."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from tidemark.devstack.airflow_stack import free_port
from tidemark.devstack.localpg import Cluster
from tidemark.ledger import migrations
from tidemark.protocol import twopc
from tidemark.sources.postgres_log import append, create_log_table

REPO = Path(__file__).resolve().parent.parent


# tryfirst: the xdist_group marks below must be on the items before pytest-xdist reads them
# (its own hook of this name) to send each group to one worker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # A test that takes the SparkSession needs Spark whatever its module says: marked here, so
    # `make test-fast` (-m "not slow and not spark and not airflow") cannot pick it up.
    for item in items:
        callspec = getattr(item, "callspec", None)
        engine = callspec.params.get("engine") if callspec is not None else None
        session = "spark" in item.fixturenames or engine == "spark"
        if session or engine == "connect":
            item.add_marker(pytest.mark.spark)
        # Under `pytest -n 2 --dist loadgroup` (make test): the Airflow tests run on one
        # worker (one Airflow at a time, the session's started once), as do the Connect ones
        # (the session's server); a module's tests taking the SparkSession or sharing a module
        # fixture (a built wheel, a migrated Airflow database) too. Each worker starts its own
        # SparkSession on its first test taking it: Spark's modules spread over both workers
        # (one group of all of them kept one worker on Spark for most of the run).
        if item.get_closest_marker("airflow") is not None:
            item.add_marker(pytest.mark.xdist_group("airflow"))
        elif engine == "connect" or "connect_server" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("connect_server"))
        elif session or _takes_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.name))

    # The Airflow modules last, in their order, those with an Airflow of their own first: the
    # session's Airflow (airflow_site) then runs from its first module to the end of the
    # session without idling beside the other tests or another Airflow.
    def rank(item) -> int:
        if item.get_closest_marker("airflow") is None:
            return 0
        return 2 if "airflow_site" in item.fixturenames else 1

    items.sort(key=rank)  # stable: the order within each rank stays
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _name_groups(items)
        items[:] = _longest_first(items)


def pytest_configure(config):
    # The controller hands out work units (a group, or one test) in the order of the workers'
    # collection (_longest_first), not xdist's default of the most tests first: a group's
    # test count says little of its time (the standalone cluster's 6 tests take longer than
    # 30 quick ones), and a long unit handed out last leaves the other worker idle.
    if getattr(config.option, "dist", None) == "loadgroup":
        config.option.loadscopereorder = False


# A test's expected seconds on 2 busy cores, by its marks, to order the work units (below).
_EXPECTED = (("slow", 45.0), ("airflow", 15.0), ("spark", 10.0))


def _expected(item) -> float:
    return next((t for m, t in _EXPECTED if item.get_closest_marker(m) is not None), 1.0)


def _longest_first(items: list) -> list:
    """``items`` by work unit (a group, or a test of none), the longest expected first (the
    longest-processing-time rule: what is handed out last is short, so both workers end
    together), each unit's tests in their order."""
    units: dict[str, list] = {}
    for item in items:
        at = item.nodeid.rfind("@")  # xdist's rule (a parameter's id may hold an "@")
        unit = item.nodeid[at + 1 :] if at > item.nodeid.rfind("]") else item.nodeid
        units.setdefault(unit, []).append(item)
    ordered = sorted(units.values(), key=lambda u: -sum(map(_expected, u)))  # stable on ties
    return [item for unit in ordered for item in unit]


def _name_groups(items) -> None:
    """pytest-xdist 3.8 sends a test to its group's worker by the "@group" it appends to
    ``item._nodeid``, which pytest 9 no longer reads (``Node.nodeid`` is ``str(item._id)``):
    every group was ignored, each worker starting its own SparkSession and Airflow. Appended
    here where pytest 9 reads it (xdist's own suffix, if it works again, adds an equal one)."""
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group")})
        if groups:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def _takes_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope == "module" for d in defs)


@pytest.fixture(scope="session")
def pg():
    root = Path(tempfile.mkdtemp(prefix="tidemark-test-pg-"))
    os.chmod(root, 0o755)
    # fsync off: no test crashes the machine, only processes (jobs, backends, the server),
    # whose writes the kernel keeps either way. With it on, DROP DATABASE's checkpoint made each
    # test's databases cost 2 to 3 s instead of 0.5 s on a busy 2-core machine.
    cluster = Cluster(root, free_port(), overrides={"fsync": "off"})
    cluster.start()
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def airflow_site(pg, tmp_path_factory):
    """One real Airflow for the session's Airflow modules (tests/airflow_site.py), started
    once the first of them has written its DAG files."""
    from tests.airflow_site import AirflowSite

    site = AirflowSite(pg, tmp_path_factory.mktemp("airflow-site"))
    _sites.append(site)
    try:
        yield site
    finally:
        site.stop()


_sites: list = []  # the session's AirflowSite, once made


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # The session's Airflow stops after the last test using it (they run one after another:
    # rank and xdist group above), not at the session's end: idle beside the tests that a
    # worker runs after them, its scheduler and servers would take their CPU.
    if "airflow_site" in item.fixturenames and (
        nextitem is None or "airflow_site" not in nextitem.fixturenames
    ):
        for site in _sites:
            site.stop()


def pytest_generate_tests(metafunc):
    # A test taking `engine` runs its write tasks on the local runner (no JVM); marked
    # @pytest.mark.engines("local", "spark") it runs on Spark too (then marked spark, above).
    if "engine" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("engines")
        metafunc.parametrize("engine", marker.args if marker else ("local",), indirect=True)


@pytest.fixture
def engine(request, env):
    """Where the test's runs write (tidemark/driver/runners.py): a TaskRunner to hand
    env.run, and the engine of the `tidemark` processes env.cli_env starts."""
    from tidemark.core.engines import Engine
    from tidemark.driver.runners import LocalRunner, SparkRunner

    env.engine = Engine(request.param)
    if env.engine is Engine.SPARK:
        return SparkRunner(request.getfixturevalue("spark"), env.settings(), "tidemark-tests")
    if env.engine is Engine.CONNECT:
        from tidemark.driver.runners import ConnectRunner

        env.spark_remote = request.getfixturevalue("connect_server").url
        runner = ConnectRunner(
            env.spark_remote,
            request.getfixturevalue("connect_spark"),
            env.settings(),
            "tidemark-tests",
        )
        # connect_spark, made just now on first use, left the process classic: this test is
        # on Connect (undone with the test, as _spark_api_mode's setting is).
        request.getfixturevalue("monkeypatch").setenv("SPARK_CONNECT_MODE_ENABLED", "1")
        return runner
    return LocalRunner()


_CONNECT_MODE_VARS = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")


@pytest.fixture(autouse=True)
def _spark_api_mode(request, monkeypatch):
    """PySpark marks its process as Spark Connect's for good (SPARK_CONNECT_MODE_ENABLED, and
    SPARK_REMOTE) once a Connect session starts: only the tests on Connect see that, or every
    classic session, and every `tidemark` or Spark process a later test on this worker starts,
    asks for a remote URL."""
    callspec = getattr(request.node, "callspec", None)
    engine = callspec.params.get("engine") if callspec is not None else None
    if engine == "connect" or "connect_spark" in request.fixturenames:
        monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    else:
        for var in _CONNECT_MODE_VARS:
            monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """A local Spark Connect server for the session (tidemark/devstack/connect_server.py):
    the `connect` engine's tests run their write tasks on it."""
    from tidemark.devstack.connect_server import ConnectServer

    server = ConnectServer(tmp_path_factory.mktemp("connect"), master="local[2,4]")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def connect_spark(connect_server):
    """One Connect session on the session's server, the tidemark package shipped once."""
    from tidemark.engine.connect_session import remote_session

    s = remote_session(connect_server.url, "tidemark-tests")
    # Between tests the process is a classic one again: module fixtures set up later on this
    # worker start classic sessions and Spark processes (_spark_api_mode sets it per test).
    for var in _CONNECT_MODE_VARS:
        os.environ.pop(var, None)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def spark():
    from tidemark.engine.session import session

    for var in _CONNECT_MODE_VARS:  # a classic session, whatever a Connect test left
        os.environ.pop(var, None)
    s = session("local[2,4]", "tidemark-tests")
    yield s
    s.stop()
    _close_gateway()


def _close_gateway() -> None:
    """PySpark leaves its py4j gateway to the interpreter's exit, where the finalizers of its
    connections log "Closing down clientserver connection" through whatever handlers a test
    set up (Airflow's, imported in-process, on pytest's captured streams, closed by then):
    "--- Logging error ---" after pytest's summary. Closed here, while those streams are
    open, and the driver JVM ended by closing its stdin, as it is at the interpreter's exit."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    SparkContext._gateway = None
    SparkContext._jvm = None
    gateway.shutdown()  # closes every connection now: none is left for a finalizer
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.stdin is not None:
        proc.stdin.close()
        proc.wait(timeout=60)


LEDGER_TEMPLATE = "tidemark_ledger_template"
_templates: set[int] = set()  # ports of the clusters whose template this session made


def ledger_template(cluster: Cluster) -> str:
    """A migrated ledger with an empty source log, made once per cluster and session: each
    test's ledger is a copy of it (``CREATE DATABASE ... TEMPLATE``), not a rerun of every
    migration. Made afresh each session, so it always has the checkout's migrations."""
    if cluster.port not in _templates:
        with _admin(cluster) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{LEDGER_TEMPLATE}"')
            c.execute(f'CREATE DATABASE "{LEDGER_TEMPLATE}"')
        dsn = cluster.dsn(LEDGER_TEMPLATE)
        migrations.upgrade(dsn)
        with psycopg.connect(dsn) as c:
            create_log_table(c, "src.log")
        # A connection open to the template makes every CREATE DATABASE from it fail: none
        # is left open above (each `with` closed its own).
        _templates.add(cluster.port)
    return LEDGER_TEMPLATE


def _admin(cluster: Cluster) -> psycopg.Connection:
    # CREATE and DROP DATABASE over a connection instead of a psql process each (the role is a
    # superuser and owns what it creates, as Cluster.create_database's OWNER clause says).
    return psycopg.connect(cluster.dsn("postgres"), autocommit=True)


class Env:
    """One test's world: a ledger database (also holding the source log), two sink databases,
    a pipelines folder."""

    def __init__(self, cluster: Cluster, tmp: Path):
        self.cluster = cluster
        tag = uuid.uuid4().hex[:8]
        self.names = {"ledger": f"led_{tag}", "sink": f"snk_{tag}", "sink2": f"snk2_{tag}"}
        template = ledger_template(cluster)
        with _admin(cluster) as c:
            c.execute(f'CREATE DATABASE "{self.names["ledger"]}" TEMPLATE "{template}"')
            c.execute(f'CREATE DATABASE "{self.names["sink"]}"')
        self.made = ["ledger", "sink"]  # sink2 on first use (sink2_dsn): most tests have one sink
        self.ledger_dsn = cluster.dsn(self.names["ledger"])
        self.sink_dsn = cluster.dsn(self.names["sink"])
        self.dir = tmp / "pipelines"
        self.dir.mkdir()
        self.tmp = tmp
        self.engine: str | None = None  # TIDEMARK_ENGINE of its processes (fixture engine)
        self.spark_remote: str | None = None  # their TIDEMARK_SPARK_REMOTE (engine connect)

    @property
    def sink2_dsn(self) -> str:
        if "sink2" not in self.made:
            with _admin(self.cluster) as c:
                c.execute(f'CREATE DATABASE "{self.names["sink2"]}"')
            self.made.append("sink2")
        return self.cluster.dsn(self.names["sink2"])

    # -- data ----------------------------------------------------------------------------------
    def append(self, records) -> dict[int, tuple[int, int]]:
        """Append ``records`` to the source log, returning once a run would read them."""
        with psycopg.connect(self.ledger_dsn) as c:
            spans = append(c, "src.log", records)
        self._settled()
        return spans

    def _settled(self, timeout: float = 120.0) -> None:
        """Wait until the log's newest rows are settled: a run reads only rows older than
        every transaction still running on the cluster (postgres_log, xmin), and this
        cluster is shared with the session's Airflow, whose scheduler may hold one open."""
        deadline = time.monotonic() + timeout
        settled = """SELECT coalesce(max(xid) < pg_snapshot_xmin(pg_current_snapshot()), true)
                     FROM src.log"""
        with psycopg.connect(self.ledger_dsn, autocommit=True) as c:
            while not c.execute(settled).fetchone()[0]:
                if time.monotonic() > deadline:
                    holders = c.execute(
                        "SELECT datname, application_name, state, xact_start "
                        "FROM pg_stat_activity WHERE backend_xid IS NOT NULL "
                        "OR backend_xmin IS NOT NULL"
                    ).fetchall()
                    raise AssertionError(f"appended rows unsettled after {timeout}s: {holders}")
                time.sleep(0.05)  # no event tells when xmin moves: poll, bounded

    def append_orders(self, ids, partitions: int = 2, version: int = 1, **extra):
        recs = []
        for i in ids:
            body = {"id": i, "name": f"order-{i}", "amount": i * 1.25, "version": version, **extra}
            recs.append(
                (
                    i % partitions,
                    str(i).encode(),
                    json.dumps(body).encode(),
                    json.dumps({"v": version}),
                    None,
                )
            )
        return self.append(recs)

    def source(self, *partitions: int) -> dict:
        """The pipelines' source: the log in the ledger database, or only these partitions."""
        doc: dict = {"type": "postgres_log", "dsn": self.ledger_dsn, "table": "src.log"}
        return {**doc, "partitions": list(partitions)} if partitions else doc

    def orders_sink(self, **extra) -> dict:
        """Sink main: public.orders of the first sink database, keyed by id (and ``extra``)."""
        return {
            "name": "main",
            "dsn": self.sink_dsn,
            "table": "public.orders",
            "key": ["id"],
            **extra,
        }

    def pipeline(self, name: str = "orders", **overrides) -> Path:
        doc = {
            "name": name,
            "source": self.source(),
            "decode": {
                "schema": {"id": "int", "name": "string", "amount": "double", "version": "int"}
            },
            "transform": {
                "select": {"id": "id", "name": "name", "amount": "amount", "version": "version"},
                "required": ["id"],
            },
            "sinks": [self.orders_sink()],
            "limits": {"max_records_per_partition": 100_000},
        }
        for k, v in overrides.items():
            doc[k] = v
        path = self.dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def load(self, name: str = "orders"):
        from tidemark import config

        return config.load(self.dir / f"{name}.yaml")

    # -- inspection ------------------------------------------------------------------------------
    def q(self, dsn: str, sql: str, params=()):
        with psycopg.connect(dsn, autocommit=True) as c:
            return c.execute(sql, params).fetchall()

    def ledger(self, sql: str, params=()):
        return self.q(self.ledger_dsn, sql, params)

    def prepared(self) -> list[str]:
        return [
            r[0] for r in self.q(self.ledger_dsn, "SELECT gid FROM pg_prepared_xacts ORDER BY gid")
        ]

    def checkpoints(self, pipeline: str = "orders", sink: str = "main") -> dict[int, int]:
        return dict(
            self.ledger(
                "SELECT partition, next_offset FROM tidemark.checkpoints "
                "WHERE pipeline = %s AND sink = %s",
                (pipeline, sink),
            )
        )

    def source_offsets(self) -> dict[int, int]:
        return dict(self.ledger('SELECT "partition", count(*) FROM src.log GROUP BY 1'))

    def settings(self, **kw):
        from tidemark.core.settings import Settings

        return Settings(ledger_dsn=self.ledger_dsn, pipelines_dir=self.dir, **kw)

    def run(self, spark, name: str = "orders", **kw):
        """A Run of pipeline ``name`` in this process, executed: its report."""
        from tidemark.driver.run import Run

        return self._execute(Run, spark, name, **kw)

    def redrive(self, spark, name: str = "orders", **kw):
        """A run in redrive mode of pipeline ``name`` (``ids=``/``request=``, ``by=``), executed."""
        from tidemark.driver.redrive import redrive_run

        return self._execute(redrive_run, spark, name, **kw)

    def _execute(self, runner, spark, name: str, **kw):
        """``spark``: a SparkSession, or a TaskRunner (fixture engine)."""
        from tidemark import config
        from tidemark.driver.runners import TaskRunner

        all_p, _ = config.load_all(self.dir)
        kw.setdefault("log", lambda m: None)
        kw["runner" if isinstance(spark, TaskRunner) else "spark"] = spark
        return runner(
            all_p[name],
            kw.pop("settings", None) or self.settings(),
            ledger_dsn=self.ledger_dsn,
            all_pipelines=all_p,
            **kw,
        ).execute()

    def recover(self):
        from tidemark import config
        from tidemark.protocol.recovery import recover

        all_p, _ = config.load_all(self.dir)
        return recover(self.ledger_dsn, all_p, "tm")

    def cli_env(self, **extra) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEMARK_")}
        env.update(
            {
                "TIDEMARK_LEDGER_DSN": self.ledger_dsn,
                "TIDEMARK_PIPELINES_DIR": str(self.dir),
                "TIDEMARK_SPARK_MASTER": "local[2,4]",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.engine is not None:
            env["TIDEMARK_ENGINE"] = str(self.engine)
        if self.spark_remote is not None:
            env["TIDEMARK_SPARK_REMOTE"] = self.spark_remote
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def cli_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tidemark", *args]

    def drop(self) -> None:
        for db in (self.names[n] for n in self.made):
            try:
                with psycopg.connect(self.cluster.dsn(db), autocommit=True) as c:
                    for gid, _ in twopc.prepared(c, "%"):
                        twopc.rollback(c, gid)
            except psycopg.OperationalError:
                pass
            # Not deferred to a thread, though DROP DATABASE waits for a checkpoint: its
            # transaction would hold back the cluster-wide xmin that source planning reads.
            with _admin(self.cluster) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def order_record(partition: int, i: int, name: str, amount: float, version: int = 1) -> tuple:
    """A source-log record of order ``i``, keyed by its id, with no headers or timestamp."""
    body = {"id": i, "name": name, "amount": amount, "version": version}
    return (partition, str(i).encode(), json.dumps(body).encode(), None, None)


def first_five(checkpoints: dict, began: dict | None = None) -> dict:
    """A claim's plan: offsets 0 to 5 of partition 0, for each sink."""
    from tidemark.core.ranges import Range

    return {s: [Range(0, 0, 5)] for s in checkpoints}


def claim_orders(conn, owner: str = "test:1", ttl_seconds: int = 60, plan=first_five):
    """The ledger's claim of a run of pipeline orders into its sink main, exactly once."""
    from tidemark.ledger import state

    return state.claim(
        conn,
        pipeline="orders",
        config={},
        sinks=["main"],
        mode="run",
        owner=owner,
        delivery="exactly_once",
        ttl_seconds=ttl_seconds,
        plan=plan,
    )


@pytest.fixture
def env(pg, tmp_path):
    e = Env(pg, tmp_path)
    yield e
    e.drop()
