"""Each sink remembers where it began (issue 45, case 1; docs/design.md, "Re-delivery"): the
ledger records, per partition, the offset a sink's checkpoint started at when it was first
made (`start: latest` skips the history), and no re-delivery reaches below it: not a backfill
by offsets, by time window or of every partition, not a rebuild, not a fallback.
Real PostgreSQL and Spark; the backfills and the rebuild run as `tidemark` processes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import yaml

from tests.invariants import assert_exactly_once
from tests.test_cli import assert_one_clear_line, tm
from tidemark.core.ranges import Range
from tidemark.driver.modes import Backfill

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROWS = "expect_column_values_to_be_between"


def _order(partition: int, i: int, minute: int, amount: float | None = None, version: int = 1):
    body = {"id": i, "name": f"order-{i}", "amount": amount or i * 1.25, "version": version}
    ts = T0 + timedelta(minutes=minute)
    return (partition, str(i).encode(), json.dumps(body).encode(), None, ts)


def _held(env) -> list[tuple]:
    """What the sink holds: (id, partition, offset), each row."""
    return env.q(env.sink_dsn, "SELECT id, _tm_partition, _tm_offset FROM orders ORDER BY id")


def _latest_world(env, spark) -> list[tuple]:
    """A `start: latest` pipeline over partitions 0 and 1 with history (ids 0-4, never
    delivered), then orders 5-9; partition 2 appears later with a history of its own (ids
    10, 11) and then order 12. Returns what the sink must hold: 5-9 and 12."""
    env.pipeline(start="latest")
    env.append([_order(i % 2, i, i) for i in range(5)])  # p0: 0, 2, 4; p1: 1, 3
    assert env.run(spark).ok  # nothing delivered: the sink begins at the end
    assert env.checkpoints() == {0: 3, 1: 2}
    env.append([_order(i % 2, i, 10 + i) for i in range(5, 10)])  # p0: 6, 8; p1: 5, 7, 9
    env.append([_order(2, 10, 20), _order(2, 11, 21)])
    assert env.run(spark).ok  # 5-9; partition 2 begins at its end
    env.append([_order(2, 12, 30)])
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 5, 1: 5, 2: 3}
    want = [
        (5, 1, 2),
        (6, 0, 3),
        (7, 1, 3),
        (8, 0, 4),
        (9, 1, 4),
        (12, 2, 2),
    ]
    assert _held(env) == want
    assert_exactly_once(env)
    return want


def test_no_re_delivery_reaches_below_where_a_latest_sink_began(env, spark):
    """Backfill of every partition, backfill by time window (its window reaching back into
    the history) and a rebuild: the sink holds exactly the records at or after where it
    began, each once; status shows where it began."""
    want = _latest_world(env, spark)
    code, out, err = tm(env.cli_env(), "backfill", "orders", "--partition", "all", cwd=env.tmp)
    assert code == 0, out + err
    assert _held(env) == want
    assert_exactly_once(env)

    since, until = T0.isoformat(), (T0 + timedelta(hours=1)).isoformat()
    code, out, err = tm(
        env.cli_env(), "backfill", "orders", "--since", since, "--until", until, cwd=env.tmp
    )
    assert code == 0, out + err
    assert _held(env) == want
    assert_exactly_once(env)

    code, out, err = tm(env.cli_env(), "sink", "rebuild", "orders", "main", cwd=env.tmp)
    assert code == 0, out + err
    assert _held(env) == want
    assert_exactly_once(env)
    assert env.checkpoints() == {0: 5, 1: 5, 2: 3}

    code, out, err = tm(env.cli_env(), "status", "orders", "--json", cwd=env.tmp)
    assert code == 0, out + err
    began = {(c["sink"], c["partition"]): c["start_offset"] for c in json.loads(out)["checkpoints"]}
    assert began == {("main", 0): 3, ("main", 1): 2, ("main", 2): 2}
    code, out, err = tm(env.cli_env(), "status", "orders", cwd=env.tmp)
    assert code == 0, out + err
    assert "main             partition 0               5  began at 3" in out, out
    assert "main             partition 2               3  began at 2" in out, out


def test_an_offset_backfill_below_where_the_sink_began_is_clamped_or_refused(env, spark):
    """--from below where the sink began re-delivers from where it began (said on stderr);
    a range wholly below it is refused in one line, and nothing runs. The fallback of a key
    whose version now fails never reaches a version below where the sink began: key 6's
    history (version 1, offset 0 of partition 0) was never delivered, so key 6 has no row."""
    env.pipeline(start="latest")
    env.append([_order(0, 6, 0, amount=1.0), _order(0, 0, 1)])  # history: never delivered
    assert env.run(spark).ok
    env.append([_order(0, 6, 2, amount=50.0, version=2), _order(0, 7, 3)])
    assert env.run(spark).ok
    assert _held(env) == [(6, 0, 2), (7, 0, 3)]

    code, out, err = tm(
        env.cli_env(), "backfill", "orders", "--partition", "0", "--from", "0", "--to", "2",
        cwd=env.tmp,
    )  # fmt: skip
    assert code == 2, out + err
    assert_one_clear_line(err, "partition 0 [0, 2)", "sink main began at offset 2")
    assert env.ledger("SELECT count(*) FROM tidemark.runs WHERE mode = 'backfill'") == [(0,)]

    # Version 2 of key 6 now fails; version 1 passes but lies below where the sink began.
    env.pipeline(start="latest", quality={"rows": [{ROWS: {"column": "amount", "max_value": 9}}]})
    report = env.run(spark, mode=Backfill([Range(0, 0, 4)]))
    assert report.ok, report.summary()
    assert _held(env) == [(7, 0, 3)]
    assert env.ledger(
        "SELECT source_offset, status::text FROM tidemark.dlq WHERE sink = 'main'"
    ) == [(2, "quarantined")]
    assert env.ledger(
        "SELECT from_offset, to_offset FROM tidemark.run_ranges rr JOIN tidemark.runs r "
        "USING (run_id) WHERE r.mode = 'backfill'"
    ) == [(2, 4)]
    assert_exactly_once(env)


def test_a_rebuild_leaves_out_rows_placed_below_where_the_sink_began(env, spark):
    """A ledger from before V009 that could not tell where the sink began (NULL) let a
    backfill place the history; once the start is known, a rebuild leaves those rows out
    without --accept-pruned (they were never delivered to the sink, nothing was pruned)."""
    from tidemark.driver.modes import Rebuild
    from tidemark.driver.run import Run

    want = _latest_world(env, spark)
    env.ledger("UPDATE tidemark.checkpoints SET start_offset = NULL RETURNING 1")
    ends = env.checkpoints()
    assert env.run(spark, mode=Backfill([Range(p, 0, e) for p, e in ends.items()])).ok
    assert [i for i, _, _ in _held(env)] == list(range(13))  # the bug, as it was
    env.ledger(
        "UPDATE tidemark.checkpoints SET start_offset = (ARRAY[3, 2, 2])[partition + 1] RETURNING 1"
    )
    report = env._execute(Run, spark, "orders", mode=Rebuild("main"), sink_names=["main"])
    assert report.ok, report.summary()
    assert _held(env) == want


def test_each_sink_gets_the_part_of_a_backfill_at_or_above_where_it_began():
    """Pure planning: the CLI cuts what was asked at the lowest start of the chosen sinks
    (and says what each sink gets), the claim's planner cuts each sink's own range; a
    partition whose start is not known (NULL) is not cut."""
    from types import SimpleNamespace

    from tidemark.driver.windows import below_start

    pipeline = SimpleNamespace(name="orders")
    asked = [Range(0, 0, 10), Range(1, 0, 4), Range(2, 0, 5)]
    began = {"a": {0: 3, 1: 6}, "b": {0: 5, 1: 4}}
    ranges, notes = below_start(pipeline, asked, began, ["a", "b"])
    assert ranges == [Range(0, 3, 10), Range(2, 0, 5)]
    assert notes == [
        "backfill of orders partition 0 [0, 10): sink a began at offset 3: it gets [3, 10); "
        "sink b began at offset 5: it gets [5, 10) (nothing below where a sink began was "
        "delivered to it)",
        "backfill of orders partition 1 [0, 4): sink a began at offset 6: it gets none of it; "
        "sink b began at offset 4: it gets none of it (nothing below where a sink began was "
        "delivered to it)",
    ]
    plan, _ = Backfill([Range(0, 0, 10), Range(2, 0, 5)]).planner(pipeline)
    assert plan({"a": {0: 10, 2: 5}, "b": {0: 10, 2: 5}}, {"a": {0: 3}, "b": {0: 5, 2: 5}}) == {
        "a": [Range(0, 3, 10), Range(2, 0, 5)],
        "b": [Range(0, 5, 10)],
    }


def test_a_sink_starts_at_an_offset_and_no_re_delivery_reaches_below_it(env, spark):
    """`start: {0: 2, 1: 5}` (an offset per partition): partition 0 begins at offset 2;
    partition 1's source has not reached offset 5 yet, so it begins only once it has, at 5
    (not at its end). A backfill of every partition and a rebuild stay at or above where the
    sink began; status shows it."""
    env.pipeline(start={0: 2, 1: 5})
    env.append([_order(i % 2, i, i) for i in range(6)])  # p0: 0, 2, 4; p1: 1, 3, 5
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 3}
    assert _held(env) == [(4, 0, 2)]
    env.append([_order(1, i, 10 + i) for i in (7, 9, 11, 13)])  # p1 offsets 3-6
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 3, 1: 7}
    want = [(4, 0, 2), (11, 1, 5), (13, 1, 6)]
    assert _held(env) == want
    assert_exactly_once(env)

    code, out, err = tm(env.cli_env(), "backfill", "orders", "--partition", "all", cwd=env.tmp)
    assert code == 0, out + err
    code, out, err = tm(env.cli_env(), "sink", "rebuild", "orders", "main", cwd=env.tmp)
    assert code == 0, out + err
    assert _held(env) == want
    assert_exactly_once(env)
    code, out, err = tm(env.cli_env(), "status", "orders", cwd=env.tmp)
    assert code == 0, out + err
    assert "main             partition 0               3  began at 2" in out, out
    assert "main             partition 1               7  began at 5" in out, out


def test_start_takes_an_offset_or_a_mapping_and_refuses_anything_else_in_one_line(tmp_path):
    from tidemark.config import parse

    base = (
        "name: a\nsource: {type: postgres_log, dsn: 'postgresql://h/d', table: t}\n"
        "decode: {schema: {id: int}}\nsinks: [{name: s, dsn: 'postgresql://h/d', table: t, "
        "key: [id]}]\n"
    )
    assert parse(base + "start: 1200\n", "a.yaml").start_at(3) == 1200
    mapped = parse(base + "start: {0: 1200, 1: 800}\n", "a.yaml")
    assert [mapped.start_at(p) for p in (0, 1, 2)] == [1200, 800, "earliest"]
    assert parse(base + "start: {'0': 7}\n", "a.yaml").start_at(0) == 7
    assert parse(base + "start: latest\n", "a.yaml").start_at(0) == "latest"
    # One process validates them all (a file each): each says its one line.
    bads = ("-1", "first", "yes", "{0: -5}", "{a: 5}", "{}", "1.5")
    paths = [tmp_path / f"a{i}.yaml" for i in range(len(bads))]
    for path, bad in zip(paths, bads, strict=True):
        path.write_text(base + f"start: {bad}\n")
    code, out, err = tm({"PATH": "/usr/bin:/bin"}, "pipelines", "validate", *map(str, paths))
    assert code == 2, out + err
    assert out.splitlines() == [
        f"invalid {path}: start: must be earliest, latest, an offset (an integer >= 0) or "
        f"a mapping of partition to offset (e.g. {{0: 1200, 1: 800}}), not "
        + repr(yaml.safe_load(f"v: {bad}")["v"])
        for path, bad in zip(paths, bads, strict=True)
    ], out
