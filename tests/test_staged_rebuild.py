"""A key change staged beside the live pipeline, rebuilt into, promoted (issue 48 point 1;
docs/operations.md, "Change a key: stage, rebuild, promote"). The new version waits in
orders.next.yaml while the live file runs on; `tidemark sink rebuild --staged` rebuilds the
table with it and makes it the live file; a run of the version it replaced (read before the
promotion) is refused for the rebuilt sink. Real PostgreSQL and Spark; the rebuild is a real
`tidemark` process."""

from __future__ import annotations

import subprocess

import psycopg
import pytest
import yaml

from tests.invariants import assert_exactly_once
from tidemark import config
from tidemark.core.errors import LeaseHeld
from tidemark.protocol import staging


def _cli(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        env.cli_argv(*args), env=env.cli_env(), capture_output=True, text=True, timeout=300
    )


def _stage(env, **overrides) -> str:
    """orders.next.yaml: the live file with ``overrides`` (its text)."""
    doc = yaml.safe_load((env.dir / "orders.yaml").read_text())
    doc.update(overrides)
    text = yaml.safe_dump(doc, sort_keys=False)
    (env.dir / "orders.next.yaml").write_text(text)
    return text


def _pkey(env) -> list[tuple]:
    return env.q(
        env.sink_dsn,
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = 'public.orders'::regclass AND contype = 'p'",
    )


def test_a_staged_key_change_runs_beside_the_live_pipeline_then_goes_live_with_its_rebuild(
    env, spark
):
    env.pipeline()
    env.append_orders(range(6))
    assert env.run(spark).ok
    env.append_orders(range(6), version=2)
    staged_text = _stage(env, sinks=[env.orders_sink(key=["id", "version"])])
    old = env.load()  # what a process that read the file before the promotion holds

    # The live pipeline runs on under its own key while the change waits.
    assert list(config.load_all(env.dir)[0]) == ["orders"]
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(6,)]
    assert _pkey(env) == [("PRIMARY KEY (id)",)]

    # The preview changes nothing and holds nothing.
    proc = _cli(env, "sink", "rebuild", "orders", "main", "--staged", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "dry run: nothing was committed" in proc.stdout, proc.stdout
    assert "with its staged version" in proc.stderr and "it changes main" in proc.stderr
    assert _pkey(env) == [("PRIMARY KEY (id)",)]
    assert env.ledger("SELECT count(*) FROM tidemark.staged_holds") == [(0,)]
    assert (env.dir / "orders.next.yaml").exists()

    cps = env.checkpoints()
    proc = _cli(env, "sink", "rebuild", "orders", "main", "--staged")
    assert proc.returncode == 0, proc.stderr
    run_id = env.ledger("SELECT max(run_id) FROM tidemark.runs WHERE mode = 'rebuild'")[0][0]
    kept = env.dir / f"orders.yaml.before-run{run_id}"
    assert f"the staged version is live ({env.dir / 'orders.yaml'})" in proc.stdout, proc.stdout
    assert str(kept) in proc.stdout
    # Table and pipeline version swapped: the new key, the staged file live, the old kept.
    assert _pkey(env) == [("PRIMARY KEY (id, version)",)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(12,)]
    assert (env.dir / "orders.yaml").read_text() == staged_text
    assert not (env.dir / "orders.next.yaml").exists()
    assert kept.exists() and env.load().sinks[0].key == ["id", "version"]
    assert env.checkpoints() == cps
    assert_exactly_once(env)

    # A run of the replaced version (read before the promotion) never writes into the table
    # rebuilt for the new one; a run of the file as it is now delivers on.
    env.append_orders([6], version=3)
    from tidemark.driver.run import Run

    with pytest.raises(LeaseHeld, match="the staged one replaced"):
        Run(
            old, env.settings(), ledger_dsn=env.ledger_dsn, spark=spark, log=lambda m: None
        ).execute()
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(13,)]
    assert_exactly_once(env)

    # Promoting again (as after a crash between the rename and the ledger) says it is done.
    with pytest.raises(Exception, match="nothing staged"):
        staging.promote(env.ledger_dsn, env.dir, "orders")


def test_a_held_sink_takes_no_run_of_the_live_file_until_unstaged(env, spark):
    """Between a staged rebuild's start and its promotion the live file's runs are refused
    for the sink (its table may be the staged version's); one that did not commit is
    released by `tidemark pipelines unstage`, and a committed one is refused release."""
    env.pipeline()
    env.append_orders(range(4))
    _stage(env, sinks=[env.orders_sink(key=["id", "version"])])
    live = env.load()
    staged = config.load_staged(env.dir, "orders")
    staging.held_for(env.ledger_dsn, live, staged, "main")
    with pytest.raises(LeaseHeld, match="held for the staged version of orders"):
        env.run(spark)
    r = staging.readiness(env.ledger_dsn, env.dir, "orders")
    assert r.changed == ["main"] and not r.ready
    assert "tidemark sink rebuild orders main --staged" in r.waiting[0]
    proc = _cli(env, "pipelines", "promote", "orders")
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "tidemark: error: the staged version of orders cannot go live yet: sink main: not "
            "rebuilt"
        )
    ), proc.stderr
    proc = _cli(env, "pipelines", "unstage", "orders")
    assert proc.returncode == 0, proc.stderr
    assert "released main" in proc.stdout
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(4,)]
    assert_exactly_once(env)


def test_pipelines_validate_checks_a_staged_file_against_its_live_one(env):
    from tests.test_cli import tm

    env.pipeline()
    _stage(env, sinks=[env.orders_sink(key=["id", "version"])])
    staged = str(env.dir / "orders.next.yaml")
    code, out, err = tm(env.cli_env(), "pipelines", "validate", "--offline", staged)
    assert code == 0 and out.strip() == f"ok      {staged}", (out, err)
    # Against the world, the live table's other key is what the rebuild changes: said, not
    # a failure (docs/operations.md step 1 has the user validate the staged file).
    import psycopg

    with psycopg.connect(env.sink_dsn, autocommit=True) as conn:  # the live table, key (id)
        conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    code, out, err = tm(env.cli_env(), "pipelines", "validate", staged)
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[-1] == f"ok      {staged}" and lines[0].startswith(f"rebuild {staged}: sink "), out
    # The live pipelines are the live files only: the staged one is no pipeline of its own.
    code, out, err = tm(env.cli_env(), "pipelines", "list")
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()] == ["orders"], out
    _stage(env, source={**env.source(), "table": "src.other"})
    code, out, err = tm(env.cli_env(), "pipelines", "validate", "--offline", staged)
    assert code == 2
    assert f"invalid {staged}: source: a staged version must read the live pipeline's source" in (
        out
    ), out


def test_promote_after_a_rename_by_hand_checks_the_held_sinks_were_rebuilt(env):
    """A folder deployed from version control: the staged file is renamed into place by a
    commit. Promote then only notes it, and not before each held sink's rebuild committed."""
    env.pipeline()
    _stage(env, sinks=[env.orders_sink(key=["id", "version"])])
    live, staged = env.load(), config.load_staged(env.dir, "orders")
    staging.held_for(env.ledger_dsn, live, staged, "main")
    (env.dir / "orders.next.yaml").replace(env.dir / "orders.yaml")
    with pytest.raises(Exception, match=r"sink\(s\) main held for it were not rebuilt"):
        staging.promote(env.ledger_dsn, env.dir, "orders")
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders') ON CONFLICT DO NOTHING")
        run_id = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES ('orders', 'rebuild', "
            "'h:1') RETURNING run_id"
        ).fetchone()[0]
        c.execute(
            "INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch) "
            "VALUES (%s, 'main', 'committed', 1)",
            (run_id,),
        )
    done = staging.promote(env.ledger_dsn, env.dir, "orders")
    assert done.already and done.kept is None
    assert env.ledger("SELECT promoted_at IS NOT NULL FROM tidemark.staged_holds") == [(True,)]


def test_status_says_which_sinks_a_staged_version_holds_and_how_to_release_them(env):
    """A held sink refuses the live file's runs: without a line in `tidemark status` the
    pipeline just looks stalled."""
    from tests.test_cli import tm

    env.pipeline()
    _stage(env, sinks=[env.orders_sink(key=["id", "version"])])
    staging.held_for(env.ledger_dsn, env.load(), config.load_staged(env.dir, "orders"), "main")
    code, out, err = tm(env.cli_env(), "status", "orders")
    assert code == 0, err
    assert "HELD: sink main for the staged version" in out, out
    assert "`tidemark pipelines unstage orders`" in out, out
    code, out, err = tm(env.cli_env(), "status", "orders", "--json")
    assert code == 0 and '"sink": "main"' in out, out
    code, out, err = tm(env.cli_env(), "pipelines", "unstage", "orders")
    assert code == 0, err
    code, out, err = tm(env.cli_env(), "status", "orders")
    assert "HELD" not in out and "never run" in out, out
