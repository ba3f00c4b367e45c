"""The local task runner (tidemark/driver/runners.py): chosen once from Settings.engine, and
refusing, before it claims anything, what only Spark can run. What it runs is proven by the
protocol, crash and composition tests that take the engine fixture."""

from __future__ import annotations

import pytest

from tidemark.core.engines import Engine
from tidemark.core.errors import BadInput
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver.run import Backfill
from tidemark.driver.runners import LocalRunner, SparkRunner, runner_for


def test_the_engine_is_one_setting_spark_by_default(monkeypatch):
    monkeypatch.delenv("TIDEMARK_ENGINE", raising=False)
    assert Settings().engine is Engine.SPARK
    assert isinstance(runner_for(Settings(), None, "t"), SparkRunner)  # no session yet
    monkeypatch.setenv("TIDEMARK_ENGINE", "local")
    assert isinstance(runner_for(Settings(), None, "t"), LocalRunner)
    monkeypatch.setenv("TIDEMARK_ENGINE", "flink")
    with pytest.raises(ValueError, match="engine"):
        Settings()


@pytest.mark.parametrize(
    "overrides, mode, why",
    [
        ({"transform": {"select": {"id": "id * 2"}}}, None, "is an expression"),
        ({"transform": {"python": "tests.nothing:fn"}}, None, "Python function"),
        (
            {"quality": {"rows": [{"expect_column_values_to_not_be_null": {"column": "id"}}]}},
            None,
            "data-quality checks",
        ),
        ({}, Backfill([Range(0, 0, 5)]), "fallback versions"),
        (
            {
                "corrections": [
                    {"name": "cents", "partitions": [0], "offsets": [0, 5], "set": {"amount": "0"}}
                ]
            },
            None,
            "corrections",
        ),
    ],
    ids=["expression", "python", "checks", "backfill", "corrections"],
)
def test_the_local_engine_refuses_what_needs_spark_before_it_claims(env, overrides, mode, why):
    env.append_orders(range(10))
    env.pipeline(**overrides)
    kw = {"mode": mode} if mode else {}
    with pytest.raises(BadInput, match=f"engine local cannot run this .*{why}.*engine spark"):
        env.run(LocalRunner(), **kw)
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]
