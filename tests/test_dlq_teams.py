"""Multi-team Airflow and the Dead letters page (docs/dlq.md, "Who may do what"): each pipeline's
DAG lives in its team's bundle; a team's member sees and changes only that team's letters and
Data Docs. Real Airflow (simple auth manager in multi-team mode), real PostgreSQL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.conftest import REPO, Env, free_port
from tests.test_dlq import add, exported
from tidemark.devstack.airflow_stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]

PIPELINES = (REPO / "dags" / "tidemark_pipelines.py").read_text()
TEAMS = {"orders": "team_a", "other": "team_b"}  # pipeline -> the team owning its DAG


def _site_page(docs: Path, pipeline: str) -> Path:
    page = (
        docs
        / pipeline
        / "gx"
        / "uncommitted"
        / "data_docs"
        / "local_site"
        / "validations"
        / "run.html"
    )
    page.parent.mkdir(parents=True)
    page.write_text(f"<html><body>{pipeline} validation</body></html>")
    return page


@pytest.fixture(scope="module")
def teams(pg, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dlqteams")
    env = Env(pg, tmp)
    docs = tmp / "docs"
    ids: dict[str, int] = {}
    bundles = []
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        for pipeline, team in TEAMS.items():
            c.execute("INSERT INTO tidemark.pipelines (name) VALUES (%s)", (pipeline,))
            run = c.execute(
                "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES "
                "(%s, 'run', 'test:1') RETURNING run_id",
                (pipeline,),
            ).fetchone()[0]
            c.execute(
                "INSERT INTO tidemark.dq_results (run_id, success, docs_path) "
                "VALUES (%s, false, %s)",
                (run, str(_site_page(docs, pipeline))),
            )
            ids[pipeline] = add(
                c,
                run_id=run,
                pipeline=pipeline,
                cls="validation",
                payload=f'{{"marker": "{pipeline}-payload"}}'.encode(),
            )
            folder = tmp / f"bundle_{team}"
            env.pipeline(pipeline)
            (folder / "pipelines").mkdir(parents=True)
            shutil.move(env.dir / f"{pipeline}.yaml", folder / "pipelines" / f"{pipeline}.yaml")
            (folder / "tidemark_pipelines.py").write_text(PIPELINES)
            bundles.append(
                {
                    "name": f"dags_{team}",
                    "team_name": team,
                    "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                    "kwargs": {"path": str(folder), "refresh_interval": 10},
                }
            )
        # A pipeline no bundle holds (run only from the CLI, or its DAG deleted): no known team.
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('ghost')")
        run = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES "
            "('ghost', 'run', 'test:1') RETURNING run_id"
        ).fetchone()[0]
        ids["ghost"] = add(
            c,
            run_id=run,
            pipeline="ghost",
            cls="validation",
            payload=b'{"marker": "ghost-payload"}',
        )
    # A stack of its own, not the session's (tests/airflow_site.py): multi-team mode, the
    # teams' bundles and users are settings of Airflow's processes. Its own metadata database
    # too, as the session's stack may be running.
    stack = Stack(
        home=tmp / "home",
        ledger_dsn=env.ledger_dsn,
        port=free_port(),
        metadata_db="airflow_teams",
        env_extra={
            "AIRFLOW__CORE__MULTI_TEAM": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,alice:op:team_a,bob:op:team_b",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
            "TIDEMARK_DATA_DOCS_DIR": str(docs),
        },
    )
    try:
        stack.start()
        for pipeline in TEAMS:
            stack.wait_dag(f"tidemark_{pipeline}")  # its team comes from its bundle
        yield stack, ids
    finally:
        stack.stop()
        env.drop()


def _client(stack: Stack, user: str) -> httpx.Client:
    return httpx.Client(
        base_url=stack.url, timeout=60, headers={"Authorization": f"Bearer {stack.token(user)}"}
    )


def test_a_team_member_sees_only_the_letters_of_the_teams_dags(teams):
    stack, ids = teams
    with _client(stack, "alice") as c:
        listed = c.get("/tidemark/dlq/api/records", params={"status": "any"}).json()["records"]
        assert [r["id"] for r in listed] == [ids["orders"]]
        counts = c.get("/tidemark/dlq/api/counts").json()
        assert set(counts["pipelines"]) == {"orders"} and counts["total"] == 1
        page = c.get("/tidemark/dlq/", params={"status": "any"})
        assert page.status_code == 200 and "other-payload" not in page.text
        assert f"/dlq/record/{ids['other']}" not in page.text
        export = c.get("/tidemark/dlq/api/export", params={"status": "any"})
        assert [x["id"] for x in exported(export.text.splitlines())] == [ids["orders"]]
        for url in (
            f"/tidemark/dlq/api/records/{ids['other']}",
            f"/tidemark/dlq/record/{ids['other']}",
        ):
            r = c.get(url)
            assert r.status_code in (403, 404) and "other-payload" not in r.text, (url, r.text)
        r = c.get("/tidemark/dlq/api/records", params={"pipeline": "other"})
        assert r.status_code == 200 and r.json()["records"] == []  # as if it had none
    with _client(stack, "admin") as c:  # an admin sees every team's letters
        listed = c.get("/tidemark/dlq/api/records", params={"status": "any"}).json()["records"]
        assert sorted(r["id"] for r in listed) == sorted(ids.values())


def test_a_pipeline_with_no_known_team_is_an_admins_alone(teams):
    """Fail closed: a pipeline whose DAG Airflow does not know belongs to no team it could be
    checked against, so no team member reads or changes its letters; an admin does."""
    stack, ids = teams
    ghost = ids["ghost"]
    for user in ("alice", "bob"):
        with _client(stack, user) as c:
            listed = c.get("/tidemark/dlq/api/records", params={"status": "any"}).json()
            assert ghost not in [r["id"] for r in listed["records"]], user
            assert "ghost" not in c.get("/tidemark/dlq/api/counts").json()["pipelines"], user
            export = c.get("/tidemark/dlq/api/export", params={"pipeline": "ghost"})
            assert "ghost-payload" not in export.text, user
            r = c.get(f"/tidemark/dlq/api/records/{ghost}")
            assert r.status_code in (403, 404) and "ghost-payload" not in r.text, (user, r.text)
            r = c.post("/tidemark/dlq/api/discard", json={"ids": [ghost], "note": "x"})
            assert r.status_code == 200 and r.json()["discarded"] == [], (user, r.text)
    with _client(stack, "admin") as c:
        r = c.get(f"/tidemark/dlq/api/records/{ghost}")
        assert r.status_code == 200 and "ghost-payload" in r.text, r.text
    with psycopg.connect(stack.ledger_dsn) as conn:
        status = conn.execute(
            "SELECT status::text FROM tidemark.dlq WHERE id = %s", (ghost,)
        ).fetchone()[0]
    assert status == "quarantined"


def test_a_team_member_cannot_change_another_teams_letters(teams):
    stack, ids = teams
    with _client(stack, "bob") as c:
        # Letters of a pipeline one may not see are skipped like ids that do not exist.
        gone = [{"id": ids["orders"], "reason": "no such dead letter"}]
        r = c.post("/tidemark/dlq/api/discard", json={"ids": [ids["orders"]], "note": "x"})
        assert r.status_code == 200 and r.json()["discarded"] == [], r.text
        assert r.json()["skipped"] == gone
        r = c.post("/tidemark/dlq/api/redrive", json={"ids": [ids["orders"]]})
        assert r.json()["runs"] == [] and r.json()["skipped"] == gone, r.text
    with psycopg.connect(stack.ledger_dsn) as conn:
        status = conn.execute(
            "SELECT status::text FROM tidemark.dlq WHERE id = %s", (ids["orders"],)
        ).fetchone()[0]
    assert status == "quarantined"


def test_data_docs_are_served_per_pipeline_to_its_readers(teams):
    stack, ids = teams
    page = "/tidemark/dlq/docs/{}/validations/run.html"
    with _client(stack, "alice") as c:
        mine = c.get(page.format("orders"))
        assert mine.status_code == 200 and "orders validation" in mine.text
        theirs = c.get(page.format("other"))
        assert theirs.status_code == 404 and "other validation" not in theirs.text
        record = c.get(f"/tidemark/dlq/api/records/{ids['orders']}").json()
        assert [d["href"] for d in record["data_docs"]] == [page.format("orders")]
        assert str(Path(stack.home).parent) not in json.dumps(record)  # no server paths
    with _client(stack, "bob") as c:
        assert c.get(page.format("other")).status_code == 200
        assert c.get(page.format("orders")).status_code == 404


def test_the_pipelines_pages_show_each_team_its_own_pipelines(teams):
    """The Pipelines pages (docs/dlq.md, "Pipelines page") decide as the letters do: a team's
    member sees the team's pipelines; another team's, or one of no known team, is not found."""
    import re

    stack, _ = teams
    seen = {}
    for user in ("alice", "bob", "admin"):
        with _client(stack, user) as c:
            page = c.get("/tidemark/pipelines/")
            assert page.status_code == 200, page.text
            seen[user] = re.findall(r'data-pipeline="(\w+)"', page.text)
            for name in ("orders", "other", "ghost"):
                r = c.get(f"/tidemark/pipelines/{name}")
                assert r.status_code == (200 if name in seen[user] else 404), (user, name)
                api = c.get(f"/tidemark/pipelines/api/{name}")
                assert api.status_code == r.status_code, (user, name, api.text)
    assert seen == {
        "alice": ["orders"],
        "bob": ["other"],
        "admin": ["ghost", "orders", "other"],
    }
