"""The pipeline's checks run in the job that writes the batch (docs/quality.md, "One pass"):
the same sinks, dead letters, reasons and results as checking a cached batch first, with two
sinks at different checkpoints, a failing gate under both policies, a `mostly` row check and a
SIGKILL at any point of it. Real Spark, PostgreSQL and GX."""

from __future__ import annotations

import signal

import pytest

from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark import config
from tidemark.driver.aborting import Aborter
from tidemark.driver.run import QualityPath, Run
from tidemark.protocol import gids, sinks

AMOUNT = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
NOT_5_OR_90 = {"expect_column_values_to_not_be_in_set": {"column": "id", "value_set": [5, 90]}}
NAMES = {"expect_column_values_to_match_regex": {"column": "name", "regex": "^order-[0-9]+$"}}
# Passes only on the rows the row checks leave: ids 81..99 exceed 100.
GATE = [
    {"expect_table_row_count_to_be_between": {"min_value": 1, "max_value": 1000}},
    {"expect_column_max_to_be_between": {"column": "amount", "max_value": 100}},
    {"expect_column_mean_to_be_between": {"column": "amount", "min_value": 0, "max_value": 100}},
]
FAILING_GATE = [{"expect_column_mean_to_be_between": {"column": "amount", "max_value": 10}}]
CASES = {
    "passes": {"rows": [AMOUNT, NOT_5_OR_90, NAMES], "batch": GATE},
    "gate_halts": {"rows": [AMOUNT, NOT_5_OR_90], "batch": FAILING_GATE},
    "gate_quarantines": {
        "rows": [AMOUNT],
        "batch": FAILING_GATE,
        "on_gate_failure": "quarantine_batch",
    },
    # Rows it finds unexpected stay in the batch: the one-pass write must not quarantine them.
    "mostly": {
        "rows": [
            NOT_5_OR_90,
            {
                "expect_column_values_to_be_between": {
                    "column": "amount",
                    "max_value": 100,
                    "mostly": 0.5,
                }
            },
        ],
        "batch": GATE[:1],
    },
}
COLUMNS = [
    ("id", "integer"),
    ("name", "text"),
    ("amount", "double precision"),
    ("version", "integer"),
]
POISON = [(0, b"poison", b"{not json", None, None), (1, b"poison2", b"\xff", None, None)]


def _pipeline(env, name: str, quality: dict) -> None:
    """A pipeline of two sinks whose tables exist (a run that finds none checks first: a
    failed gate must not leave a table behind)."""
    env.pipeline(
        name=name,
        quality=quality,
        sinks=[
            {"name": "main", "dsn": env.sink_dsn, "table": f"public.{name}", "key": ["id"]},
            {"name": "second", "dsn": env.sink2_dsn, "table": f"public.{name}", "key": ["id"]},
        ],
    )
    for sink in sinks.resolve(env.load(name), None):
        sinks.ensure_table(sink, COLUMNS, f"sink {sink.name}")


def _run(env, spark, name: str, one_pass: bool, **kw):
    pipelines, _ = config.load_all(env.dir)
    lines: list[str] = []
    run = Run(
        pipelines[name],
        env.settings(),
        ledger_dsn=env.ledger_dsn,
        all_pipelines=pipelines,
        spark=spark,
        log=lines.append,
        quality=QualityPath.WHILE_WRITING if one_pass else QualityPath.FIRST,
        **kw,
    )
    return run.execute(), "\n".join(lines)


def _outcome(env, name: str) -> dict:
    """What a pipeline's runs left: rows, dead letters with reasons, states, checkpoints,
    stored results."""
    out = {
        "dlq": env.ledger(
            "SELECT sink, source_partition, source_offset, error_class::text, reason, attempts "
            "FROM tidemark.dlq WHERE pipeline = %s ORDER BY 1, 2, 3",
            (name,),
        ),
        "states": env.ledger(
            "SELECT r.run_id - min(r.run_id) OVER (), s.sink, s.state::text, s.error "
            "FROM tidemark.runs r JOIN tidemark.run_sinks s USING (run_id) "
            "WHERE r.pipeline = %s ORDER BY 1, 2",
            (name,),
        ),
        "checkpoints": {s: env.checkpoints(name, s) for s in ("main", "second")},
        "dq": env.ledger(
            "SELECT d.scope, d.success, d.rows_failed, d.results FROM tidemark.dq_results d "
            "JOIN tidemark.runs r USING (run_id) WHERE r.pipeline = %s ORDER BY d.run_id, 1",
            (name,),
        ),
    }
    for s, dsn in (("main", env.sink_dsn), ("second", env.sink2_dsn)):
        exists = env.q(dsn, "SELECT to_regclass(%s)", (f"public.{name}",))[0][0]
        out[s] = (
            env.q(
                dsn, f"SELECT id, name, amount, _tm_partition, _tm_offset FROM {name} ORDER BY id"
            )
            if exists
            else []
        )
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_checking_while_writing_leaves_what_checking_first_leaves(env, spark, case):
    """Sink main first takes ids 0..59; then both sinks run, second catching up from the
    start: two sinks at different checkpoints, the same outcome either way."""
    for name in ("one_pass", "first"):
        _pipeline(env, name, CASES[case])
    env.append_orders(range(60))
    env.append(POISON[:1])
    logs = {}
    for name in ("one_pass", "first"):
        logs[name] = [_run(env, spark, name, name == "one_pass", sink_names=["main"])[1]]
    env.append_orders(range(60, 100))
    env.append(POISON[1:])
    for name in ("one_pass", "first"):
        logs[name].append(_run(env, spark, name, name == "one_pass")[1])

    one, first = _outcome(env, "one_pass"), _outcome(env, "first")
    assert one == first
    # The one-pass write is undone where it did not do what checking first does: a failed
    # gate, or (in the second step, ids 81..99) rows a `mostly` row check tolerates.
    for step, log in enumerate(logs["one_pass"]):
        assert "checking data quality (Great Expectations) while writing" in log
        undone = "rolled back the write, checking the batch before writing it again" in log
        assert undone == (
            case in ("gate_halts", "gate_quarantines") or (case, step) == ("mostly", 1)
        ), log
    for log in logs["first"]:
        assert "while writing" not in log
    if case == "passes":
        # ids 81..99 exceed 100, 5 and 90 are forbidden, one poison record per step.
        assert [len(one[s]) for s in ("main", "second")] == [80, 80]
        reasons = {(r[0], r[3]): r[4] for r in one["dlq"]}
        assert {c for _, c in reasons} == {"decode", "validation"}
        assert len(one["dlq"]) == 2 * 22
        assert [r for r in one["dq"] if r[0] == ""][-1][1:3] == (True, 20)
    if case == "gate_halts":
        assert {s for _, _, s, _ in one["states"]} == {"dq_failed"}
    if case == "mostly":
        assert {r[4] for r in one["dlq"] if r[3] == "validation"} == {
            "expect_column_values_to_not_be_in_set(column=id): 5 in forbidden set",
            "expect_column_values_to_not_be_in_set(column=id): 90 in forbidden set",
        }
    for name in ("one_pass", "first"):
        assert_exactly_once(
            env, name, sinks={"main": env.sink_dsn, "second": env.sink2_dsn}, table=name
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "case"),
    [
        ("task_after_prepare", "passes"),
        ("before_verdict", "gate_halts"),
        ("before_verdict", "gate_quarantines"),
        ("after_prepare", "passes"),
        ("after_prepare", "gate_quarantines"),
    ],
)
def test_a_crash_in_a_run_checked_while_writing(env, spark, point, case):
    """SIGKILL of the whole job inside the one-pass write, between it and its verdict (the
    failing gates: before their write is undone), or after the decision's prerequisites (for
    the failing gate: after its write was undone and the batch written again), then recovery
    and a rerun: each record placed once per sink, or (halt) nothing placed at all."""
    _pipeline(env, "orders", CASES[case])
    env.append_orders(range(100))
    env.append(POISON)
    sinks = {"main": env.sink_dsn, "second": env.sink2_dsn}
    job = JobProcess(env.cli_argv("run", "orders"), env.cli_env(), crash_at=point)
    assert job.wait() == -signal.SIGKILL, job.output()
    assert "while writing" in job.output()
    assert env.prepared(), "expected prepared transactions before recovery"
    assert env.recover().ok
    assert env.prepared() == []
    report = env.run(spark)
    classes = env.ledger(
        "SELECT sink, error_class::text, count(*), max(attempts) "
        "FROM tidemark.dlq GROUP BY 1, 2 ORDER BY 1, 2"
    )
    if case == "gate_halts":
        assert {s.state for s in report.sinks.values()} == {"dq_failed"}, report.summary()
        assert classes == []
        for sink, dsn in sinks.items():
            assert env.checkpoints(sink=sink) == {0: 0, 1: 0}
            assert env.q(dsn, "SELECT count(*) FROM orders") == [(0,)]
        assert env.prepared() == []
        return
    assert report.ok, report.summary()
    if case == "passes":
        assert classes == [
            (s, c, n, 1) for s in sinks for c, n in (("decode", 2), ("validation", 20))
        ]
    else:
        assert classes == [
            (s, c, n, 1) for s in sinks for c, n in (("decode", 2), ("dq_gate", 100))
        ]
    for sink in sinks:
        assert env.checkpoints(sink=sink) == {0: 51, 1: 51}
    assert_exactly_once(env, sinks=sinks)


def test_a_write_left_prepared_by_an_undone_one_pass_write_does_not_block_the_second(
    env, spark, monkeypatch
):
    """The second write of a run has write number 1 in its gids (gids.Gid.write): they are
    new, and each of its tasks first rolls back what the first write left of it, which would
    otherwise hold the rows' locks until recovery. Here the rollback of the one-pass write
    reached no database (each was unreachable for a moment): its transactions stay
    prepared."""
    skipped: list[frozenset[str]] = []
    roll_back = Aborter.roll_back

    def first_reaches_nothing(self, keep=frozenset()):
        if not skipped:
            skipped.append(keep)
            return
        roll_back(self, keep)

    monkeypatch.setattr(Aborter, "roll_back", first_reaches_nothing)
    _pipeline(env, "orders", CASES["gate_quarantines"])
    env.append_orders(range(100))
    env.append(POISON)
    pipelines, _ = config.load_all(env.dir)
    lines: list[str] = []
    run = Run(
        pipelines["orders"],
        env.settings(lock_timeout_ms=5_000),
        ledger_dsn=env.ledger_dsn,
        all_pipelines=pipelines,
        spark=spark,
        log=lines.append,
    )
    report = run.execute()
    assert report.ok, report.summary() + "\n" + "\n".join(lines)
    assert len(skipped) == 1
    assert "rolled back the write, checking the batch before writing it again" in "\n".join(lines)
    assert env.prepared() == []
    chosen = {
        (gid.attempt, gid.write)
        for (g,) in env.ledger("SELECT gid FROM tidemark.participants")
        if (gid := gids.parse(g, "tm"))
    }
    assert chosen == {(0, 1)}
    assert env.ledger(
        "SELECT sink, error_class::text, count(*) FROM tidemark.dlq GROUP BY 1, 2 ORDER BY 1, 2"
    ) == [(s, c, n) for s in ("main", "second") for c, n in (("decode", 2), ("dq_gate", 100))]
    assert_exactly_once(env, sinks={"main": env.sink_dsn, "second": env.sink2_dsn})
