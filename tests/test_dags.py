"""DAG integrity: the repo's DAG folder and generated DAGs parse with Airflow's own DagBag."""

from __future__ import annotations

import copy
import shutil

import pytest

from tests.conftest import REPO
from tidemark.core.errors import BadInput


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("airflow-home")
    monkeypatch_module.setenv("AIRFLOW_HOME", str(home))
    monkeypatch_module.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    monkeypatch_module.setenv("TIDEMARK_DEMO_SOURCE_DSN", "postgresql://u:p@127.0.0.1:1/x")
    monkeypatch_module.setenv("TIDEMARK_DEMO_SINK_DSN", "postgresql://u:p@127.0.0.1:1/y")
    return home


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _bag(folder):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder))


def test_repo_dags_import_without_errors(airflow_home):
    bag = _bag(REPO / "dags")
    assert bag.import_errors == {}
    assert {
        "tidemark_flights",
        "tidemark_flights_backfill",
        "tidemark_flights_redrive",
        "tidemark_maintenance",
    } <= set(bag.dags)
    flights = bag.dags["tidemark_flights"]
    assert [t.task_id for t in flights.topological_sort()] == [
        "recover",
        "replay",
        "report",
        "announce",
    ]
    assert flights.max_active_runs == 1 and "demo" in flights.tags
    replay = flights.get_task("replay")
    assert replay.pool == "tidemark_spark" and replay.retries == 2
    assert replay.retry_exponential_backoff == 2.0
    assert flights.timetable.expression in ("@hourly", "0 * * * *")
    for dag in bag.dags.values():
        dag.validate()
        assert len(dag.topological_sort()) == len(dag.tasks)  # no cycle


def test_replay_dag_skips_spark_when_idle_and_announces_sink_assets(airflow_home):
    from airflow.providers.standard.operators.python import ShortCircuitOperator
    from airflow.sdk import AssetAlias

    bag = _bag(REPO / "dags")
    flights = bag.dags["tidemark_flights"]
    assert isinstance(flights.get_task("recover"), ShortCircuitOperator)
    for dag_id in ("tidemark_flights", "tidemark_flights_backfill", "tidemark_flights_redrive"):
        announce = bag.dags[dag_id].get_task("announce")
        assert announce.outlets == [AssetAlias("tidemark_flights_sinks")]
        # It runs whatever replay did: a sink that committed is announced when another failed.
        assert announce.trigger_rule == "all_done"
        assert announce.upstream_task_ids == {"replay"}
        assert bag.dags[dag_id].get_task("report").outlets == []


def test_sink_asset_uri_is_the_postgres_providers():
    from urllib.parse import urlsplit

    from airflow.providers.postgres.assets.postgres import sanitize_uri

    from tidemark.airflow.assets import table_uri

    cases = {
        (
            "postgresql://u:secret@db.example:6543/wh",
            "public.flights",
        ): "postgres://db.example:6543/wh/public/flights",
        (
            "host=db.example dbname=wh user=u password=secret",
            "flights",
        ): "postgres://db.example:5432/wh/public/flights",
        ("postgresql:///wh?host=/var/run/postgresql", "s.t"): "postgres://localhost:5432/wh/s/t",
    }
    for (dsn, table), uri in cases.items():
        got = table_uri(dsn, table)
        assert got == uri
        assert sanitize_uri(urlsplit(got)).geturl() == got  # already the provider's canonical form
    # a raw '@' would make part of the password the asset's host, in every lineage event
    for raw in ("Ab@Secret9", "Ab%zzSecret9", "Ab/Secret9"):
        with pytest.raises(ValueError, match="does not parse") as bad:
            table_uri(f"postgresql://u:{raw}@db.example/wh", "t")
        assert "Secret9" not in str(bad.value)


def test_backfill_params_validate(airflow_home):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _bag(REPO / "dags").dags["tidemark_flights_backfill"]
    assert [t.task_id for t in dag.topological_sort()] == [
        "recover",
        "check",
        "replay",
        "report",
        "announce",
    ]
    params = dag.params
    ok = copy.deepcopy(params)
    ok.update({"partition": 2, "from_offset": 0, "to_offset": 100, "sinks": ["warehouse"]})
    assert ok.validate()["to_offset"] == 100
    assert ok.validate()["dry_run"] is False  # a preview only when asked
    for bad in (
        {"partition": -1},
        {"from_offset": "ten"},
        {"sinks": []},
        {"sinks": ["nowhere"]},
        {"dry_run": "yes"},
    ):
        p = copy.deepcopy(params)
        with pytest.raises(ParamValidationError):
            p.update(bad)
            p.validate()


def test_redrive_dag_params_validate(airflow_home):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _bag(REPO / "dags").dags["tidemark_flights_redrive"]
    assert [t.task_id for t in dag.topological_sort()] == [
        "recover",
        "select",
        "replay",
        "report",
        "announce",
    ]
    assert dag.max_active_runs == 1 and dag.get_task("replay").pool == "tidemark_spark"
    ok = copy.deepcopy(dag.params)
    ok.update({"ids": [3, 4], "requested_by": "alice"})
    assert ok.validate()["ids"] == [3, 4]
    ok.update({"request": 12})
    assert ok.validate()["request"] == 12
    # The job gets a ledger request's id, never the ids: a list of 100,000 would not fit
    # spark-submit's command line.
    args = dag.get_task("replay").application_args
    at = args.index("--request")
    assert args[at + 1] == "{{ ti.xcom_pull(task_ids='select') }}"
    assert not any("join" in a for a in args)
    # The form's dry_run previews the redrive (--dry-run after the pipeline's name).
    assert ok.validate()["dry_run"] is False
    replay = dag.get_task("replay")
    command = replay._command({"params": {**ok, "dry_run": True}})
    assert command[command.index("flights") + 1] == "--dry-run"
    assert "--dry-run" not in replay._command({"params": dict(ok)})
    for bad in (
        {"dry_run": 1},
        {"ids": ["x"]},
        {"ids": [0]},
        {"error_class": "nope"},
        {"sink": "nowhere"},
        {"request": 0},
        {"request": "x"},
    ):
        p = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError):
            p.update(bad)
            p.validate()


def test_broken_yaml_is_one_import_error_others_load(airflow_home, tmp_path):
    """A YAML dropped into pipelines/ is enough for its DAGs; broken ones are the import error
    of a DAG file that defines no DAG, one line each (file, field, problem), so they never
    hide the others (Airflow marks every DAG of a file with an import error stale)."""
    dags = tmp_path / "dags"
    shutil.copytree(REPO / "dags", dags)
    pipes = dags / "pipelines"
    (pipes / "broken.yaml").write_text("name: broken\nsinks: nope\n")
    (pipes / "bad_key.yml").write_text(
        (pipes / "flights.yaml").read_text().replace("key: [", "keyz: [")
    )
    shutil.copy(pipes / "flights.yaml", pipes / "mine.yaml")
    bag = _bag(dags)
    assert [k.rsplit("/", 1)[-1] for k in bag.import_errors] == ["tidemark_pipeline_files.py"]
    (trace,) = bag.import_errors.values()
    lines = trace.splitlines()
    assert any("broken.yaml: source: Field required" in line for line in lines), trace
    assert any("bad_key.yml: sinks[0].key: Field required" in line for line in lines), trace
    # Every problem of a file, not the first only: "(and 2 more)", then each on its line.
    assert any(
        line.startswith("  ") and "broken.yaml: decode: Field required" in line for line in lines
    ), trace
    assert {
        "tidemark_flights",
        "tidemark_flights_backfill",
        "tidemark_mine",
        "tidemark_mine_redrive",
        "tidemark_maintenance",
    } <= set(bag.dags)
    assert not any("broken" in d for d in bag.dags)


def test_maintenance_dag_prunes_beside_the_check(airflow_home):
    """prune and check run after recover whatever its outcome, side by side: a failing prune
    neither stops the check nor hides behind it (it fails the DAG run itself)."""
    from airflow.sdk import TriggerRule

    dag = _bag(REPO / "dags").dags["tidemark_maintenance"]
    assert {t.task_id for t in dag.tasks} == {"recover", "check", "prune"}
    prune, check = dag.get_task("prune"), dag.get_task("check")
    assert prune.upstream_task_ids == {"recover"} and not prune.downstream_task_ids
    assert check.upstream_task_ids == {"recover"} and not check.downstream_task_ids
    assert prune.trigger_rule == TriggerRule.ALL_DONE
    assert check.trigger_rule == TriggerRule.ALL_DONE
    assert prune.python_callable.__module__ == "tidemark.airflow.tasks"


def test_the_backfill_form_takes_a_time_window_or_every_partition(airflow_home):
    from tidemark.airflow.tasks import check_backfill

    dag = _bag(REPO / "dags").dags["tidemark_flights_backfill"]
    window = {
        "partition": None,
        "since": "2026-05-01T10:00:00",
        "until": "2026-05-01T12:00:00+02:00",
        "sinks": ["warehouse"],
    }
    p = copy.deepcopy(dag.params)
    p.update(window)
    assert p.validate()["since"] == "2026-05-01T10:00:00"
    path = str(REPO / "dags/pipelines/flights.yaml")
    # Naive is UTC; the window's end, 10:00 UTC, is not after its start: refused.
    with pytest.raises(BadInput, match="must be after since"):
        check_backfill(path, window)
    window["until"] = "2026-05-01T14:00:00+02:00"
    assert check_backfill(path, window)["args"] == [
        "--sink",
        "warehouse",
        "--since",
        "2026-05-01T10:00:00+0000",
        "--until",
        "2026-05-01T14:00:00+0200",
    ]
    # A form left as it is names nothing: refused, never everything (nor partition 0).
    untouched = {k: v for k, v in copy.deepcopy(dag.params).validate().items()}
    with pytest.raises(BadInput, match="say what to re-deliver"):
        check_backfill(path, untouched)
    assert check_backfill(path, {**untouched, **window})["args"][2:3] == ["--since"]
    every = {"partition": None, "from_offset": 0, "to_offset": None, "sinks": ["warehouse"]}
    assert check_backfill(path, every)["args"] == [
        "--sink",
        "warehouse",
        "--partition",
        "all",
        "--from",
        "0",
    ]
    with pytest.raises(BadInput, match="give both since and until"):
        check_backfill(path, {**every, "since": "2026-05-01"})
    # The form may accept what the source no longer holds (docs/operations.md).
    assert untouched["accept_pruned"] is False
    assert check_backfill(path, {**every, "accept_pruned": True})["args"][-1] == "--accept-pruned"

    # The command replay runs: the check's arguments after the pipeline's name.
    replay = dag.get_task("replay")
    replay.application_args = ["--pipelines-dir", "d", "backfill", "flights", "--airflow-run", "{}"]

    class Ti:
        def xcom_pull(self, task_ids):
            assert task_ids == "check"
            return {"args": ["--partition", "all"]}

    assert replay._command({"ti": Ti()}) == [
        "--pipelines-dir", "d", "backfill", "flights", "--partition", "all", "--airflow-run", "{}"
    ]  # fmt: skip
    assert replay._command({"ti": Ti(), "params": {"dry_run": True}}) == [
        "--pipelines-dir", "d", "backfill", "flights", "--partition", "all", "--dry-run",
        "--airflow-run", "{}",
    ]  # fmt: skip


def test_airflows_backfill_of_a_scheduled_run_re_delivers_its_data_interval_when_opted_in(
    airflow_home,
):
    from datetime import UTC, datetime

    from tidemark.airflow.dags import ReplayOperator

    args = ["--pipelines-dir", "d", "run", "flights", "--airflow-run", "{}"]
    op = ReplayOperator(
        task_id="replay", pipeline="flights", pipeline_file="f", application="a",
        application_args=args, by_interval=True,
    )  # fmt: skip

    class Run:
        run_type = "backfill"

    ctx = {
        "dag_run": Run(),
        "data_interval_start": datetime(2026, 1, 1, 0, tzinfo=UTC),
        "data_interval_end": datetime(2026, 1, 1, 1, tzinfo=UTC),
    }
    assert op._command(ctx) == [
        "--pipelines-dir", "d", "backfill", "flights",
        "--since", "2026-01-01T00:00:00+0000", "--until", "2026-01-01T01:00:00+0000",
        "--airflow-run", "{}",
    ]  # fmt: skip
    Run.run_type = "scheduled"
    assert op._command(ctx) == args


@pytest.mark.parametrize("kind", ["backfill", "redrive"])
def test_a_form_left_as_it_is_can_be_triggered(airflow_home, kind):
    """Airflow's Trigger form holds back a run until every field whose type lacks null is
    filled in: an optional field defaults to null and allows it (the redrive form's error
    class, sink and requested-by once defaulted to "", so nothing could be triggered)."""
    dag = _bag(REPO / "dags").dags[f"tidemark_flights_{kind}"]
    for name, param in dag.params.items():
        types = param.schema.get("type")
        types = types if isinstance(types, list) else [types]
        if param.value is None:
            assert "null" in types, f"{kind} form: {name} defaults to null but refuses it"
        assert param.value != "", f"{kind} form: {name} defaults to an empty string"
    assert copy.deepcopy(dag.params).validate()  # the defaults are a valid form


@pytest.mark.parametrize("master", ["yarn", "local[2]"])
def test_no_connection_reaches_spark_submits_command_line(
    airflow_home, tmp_path, monkeypatch, master
):
    """On YARN and Kubernetes the provider puts a task's env_vars on spark-submit's command
    line (``spark.yarn.appMasterEnv.*``, ``spark.kubernetes.driverEnv.*``): the replay task
    hands the job only the path of a file its user alone can read, which goes when the task
    ends; the job reads its connections from it and deletes it."""
    import json
    import os
    import stat

    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from tidemark.airflow.dags import pipeline_dags
    from tidemark.core import job_secrets

    ledger = "postgresql://tm:Ledger%2FSecret9@127.0.0.1:1/ledger"
    sink = "postgresql://tm:Sink%40Secret9@127.0.0.1:1/warehouse"
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": master})
    )
    monkeypatch.setenv("AIRFLOW_CONN_TIDEMARK_LEDGER", ledger)
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", sink)
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(
        "name: orders\n"
        "source: {type: postgres_log, conn_id: warehouse, table: src.log}\n"
        "decode: {schema: {id: int}}\n"
        "transform: {select: {id: id}, required: [id]}\n"
        "sinks: [{name: main, conn_id: warehouse, table: public.orders, key: [id]}]\n"
    )
    replay = pipeline_dags(folder)["tidemark_orders"].get_task("replay")
    seen: dict = {}

    def submit(self, context):
        hook = self._get_hook()
        seen["cmd"] = " ".join(hook._build_spark_submit_command(self.application))
        seen["env"] = dict(self.env_vars)
        path = self.env_vars[job_secrets.VAR]
        seen["path"], seen["mode"] = path, stat.S_IMODE(os.stat(path).st_mode)
        seen["folder_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        monkeypatch.setenv(job_secrets.VAR, path)
        job_secrets.load_into_environ()  # what the job does first
        seen["job"] = {
            k: os.environ.get(k) for k in ("TIDEMARK_LEDGER_DSN", "AIRFLOW_CONN_WAREHOUSE")
        }
        seen["left"] = os.path.exists(path)

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    replay.execute({"params": {}, "dag_run": None})
    assert "Secret9" not in seen["cmd"] + json.dumps(seen["env"])
    assert seen["env"].keys() == {job_secrets.VAR}
    assert (seen["mode"], seen["folder_mode"]) == (0o600, 0o700)
    assert seen["job"] == {"TIDEMARK_LEDGER_DSN": ledger, "AIRFLOW_CONN_WAREHOUSE": sink}
    assert not seen["left"] and not os.path.exists(os.path.dirname(seen["path"]))


def test_a_cluster_deploy_mode_is_refused_with_what_to_set(airflow_home, tmp_path, monkeypatch):
    import json

    from airflow.sdk.exceptions import AirflowFailException

    from tidemark.airflow.dags import pipeline_dags

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}}),
    )
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(REPO / "dags" / "pipelines" / "flights.yaml", folder)
    replay = pipeline_dags(folder)["tidemark_flights"].get_task("replay")
    with pytest.raises(AirflowFailException, match="client mode"):
        replay.execute({"params": {}, "dag_run": None})


PIPELINE_WITH_SPARK = (
    "name: orders\n"
    "source: {type: postgres_log, conn_id: warehouse, table: src.log}\n"
    "decode: {schema: {id: int}}\n"
    "transform: {select: {id: id}, required: [id]}\n"
    "sinks: [{name: main, conn_id: warehouse, table: public.orders, key: [id]}]\n"
    "spark:\n"
    "  spark.executor.memory: 6g\n"
    "  spark.archives: hdfs:///envs/tidemark.tar.gz#environment\n"
    "  spark.pyspark.python: ./environment/bin/python\n"
)


def _submitted_command(airflow_home, tmp_path, monkeypatch, extra: dict) -> str:
    """The spark-submit command the provider's hook builds for the replay task, given the
    Spark connection's extra and a pipeline with a ``spark:`` block."""
    import json

    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from tidemark.airflow.dags import pipeline_dags

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "spark://cluster", "port": 7077, "extra": extra}),
    )
    monkeypatch.setenv("AIRFLOW_CONN_TIDEMARK_LEDGER", "postgresql://tm:x@127.0.0.1:1/ledger")
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgresql://tm:x@127.0.0.1:1/warehouse")
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(PIPELINE_WITH_SPARK)
    replay = pipeline_dags(folder)["tidemark_orders"].get_task("replay")
    seen: dict = {}

    def submit(self, context):
        seen["cmd"] = self._get_hook()._build_spark_submit_command(self.application)

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    replay.execute({"params": {}, "dag_run": None})
    return " ".join(seen["cmd"])


def test_spark_settings_from_the_connection_and_the_pipeline_reach_spark_submit(
    airflow_home, tmp_path, monkeypatch
):
    """The connection's extra ``conf`` is the cluster's default, the pipeline's ``spark:``
    block wins over it; Tidemark's driver options stay."""
    conf = {
        "spark.executor.memory": "4g",
        "spark.executor.cores": 1,
        "spark.pyspark.python": "/opt/tidemark/bin/python",
        "spark.driver.host": "10.0.0.5",
    }
    cmd = _submitted_command(airflow_home, tmp_path, monkeypatch, {"conf": conf})
    assert cmd.startswith("spark-submit --master spark://cluster:7077 ")
    for setting in (
        "spark.executor.memory=6g",
        "spark.executor.cores=1",
        "spark.archives=hdfs:///envs/tidemark.tar.gz#environment",
        "spark.pyspark.python=./environment/bin/python",
        "spark.driver.host=10.0.0.5",
        "spark.executor.extraJavaOptions=-Dlog4j2",
    ):
        assert f"--conf {setting}" in cmd, cmd
    assert "spark.executor.memory=4g" not in cmd


def test_a_secret_in_the_spark_connections_conf_fails_the_task_in_one_line(
    airflow_home, tmp_path, monkeypatch
):
    from airflow.sdk.exceptions import AirflowFailException

    extra = {"conf": {"spark.hadoop.fs.s3a.secret.key": "Hunter2Secret"}}
    with pytest.raises(AirflowFailException) as e:
        _submitted_command(airflow_home, tmp_path, monkeypatch, extra)
    message = str(e.value)
    assert message.startswith(
        "Spark connection 'spark_default': extra conf: spark.hadoop.fs.s3a.secret.key: "
    )
    assert "Hunter2Secret" not in message and "\n" not in message


def test_a_kubernetes_master_without_its_provider_fails_the_task_saying_what_to_install(
    airflow_home, tmp_path, monkeypatch
):
    import json

    from airflow.sdk.exceptions import AirflowFailException

    from tidemark.airflow import spark_conf

    if spark_conf._kubernetes_provider():
        pytest.skip("the cncf-kubernetes provider is installed")

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "k8s://https://api.example", "port": 6443}),
    )
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(PIPELINE_WITH_SPARK)
    with pytest.raises(
        AirflowFailException, match="install apache-airflow-providers-cncf-kubernetes"
    ):
        spark_conf.job_conf({}, "spark_default", str(folder / "orders.yaml"))
