"""A key change in a backfill of part of what a sink received (issue 45, case 2;
docs/design.md, "Re-delivery", step 4): the old transform is gone, so the older versions a
removed row stood for cannot be told apart, and a split would leave some placed by nothing.
The backfill refuses before anything is prepared, its preview the same; the command it names
then places every version exactly once. Real PostgreSQL and Spark."""

from __future__ import annotations

import json

from tests.test_cli import tm
from tidemark.core.ranges import Range
from tidemark.driver import windows
from tidemark.driver.modes import Backfill, Rebuild

DECODE = {"schema": {"id": "string", "region": "string", "ver": "int"}}
OLD = {"k": "id", "id": "id", "region": "region", "ver": "ver"}
SPLIT = {**OLD, "k": "concat(id, '-', region)"}
REFUSED = "a key change"


def _record(p: int, id_: str, region: str, ver: int = 1) -> tuple:
    doc = {"id": id_, "region": region, "ver": ver}
    return (p, id_.encode(), json.dumps(doc).encode(), None, None)


def _pipeline(env, select: dict, **sink) -> None:
    sinks = [{"name": "main", "dsn": env.sink_dsn, "table": "public.t", "key": ["k"], **sink}]
    env.pipeline(decode=DECODE, transform={"select": select}, sinks=sinks)


def _world(env) -> dict:
    """What a refused backfill must leave as it was."""
    return {
        "rows": env.q(env.sink_dsn, "SELECT * FROM t ORDER BY 1"),
        "letters": env.ledger("SELECT * FROM tidemark.dlq ORDER BY id"),
        "checkpoints": env.checkpoints(),
        "prepared": env.prepared(),
    }


def _placed(env) -> dict[str, tuple[int, int]]:
    return {
        k: (p, o) for k, p, o in env.q(env.sink_dsn, "SELECT k, _tm_partition, _tm_offset FROM t")
    }


def _newest(records: dict[tuple[int, int], tuple], versioned: bool) -> dict[str, tuple[int, int]]:
    """Every record's key under the split transform, with its newest version's position:
    the version column, then (partition, offset); offsets alone within one partition."""
    best: dict[str, tuple] = {}
    for (p, o), (_, _, body, _, _) in records.items():
        d = json.loads(body)
        order = (d["ver"] if versioned else 0, p, o)
        k = f"{d['id']}-{d['region']}"
        if k not in best or order > best[k]:
            best[k] = order
    return {k: (p, o) for k, (_, p, o) in best.items()}


def _assert_refused(env, report, before: dict, *examples: str) -> None:
    assert not report.ok, f"the backfill went on; the sink holds {_placed(env)}"
    error = report.sinks["main"].error or ""
    for needle in (REFUSED, *examples, "tidemark sink rebuild orders main"):
        assert needle in error, error
    assert "tidemark backfill orders --partition all --sink main" in error, error
    assert _world(env) == before
    assert before["prepared"] == []


def test_a_partial_backfill_that_splits_a_key_refuses_and_a_whole_one_places_every_version(
    env, spark
):
    """The issue's example: key id becomes id-region; v1 (offset 1, A/x) lies before the
    range, v2 (offset 2, A/y) in it. Unmodified, the backfill removed row A, placed v2 as A-y
    and left v1 (A-x now) placed by nothing."""
    recs = [_record(0, "B", "x"), _record(0, "A", "x"), _record(0, "A", "y"), _record(0, "C", "z")]
    env.append(recs)
    _pipeline(env, OLD)
    assert env.run(spark).ok
    _pipeline(env, SPLIT)
    before = _world(env)

    report = env.run(spark, mode=Backfill([Range(0, 2, 3)]))
    _assert_refused(env, report, before, "1 record(s)", "partition 0 offset 2: (A) -> (A-y)")
    preview = env.run(spark, mode=Backfill([Range(0, 2, 3)]), dry_run=True)
    _assert_refused(env, preview, before, "1 record(s)", "partition 0 offset 2: (A) -> (A-y)")
    assert "sink main: fail (aborted: " in preview.summary()
    assert preview.sinks["main"].error == report.sinks["main"].error

    # What the message says: a backfill of everything the sink received.
    ranges = windows.by_offsets(
        env.load(), windows.committed(env.ledger_dsn, env.load(), ["main"]), None, None
    )
    whole = env.run(spark, mode=Backfill(ranges))
    assert whole.ok, whole.summary()
    source = {(0, o): r for o, r in enumerate(recs)}
    assert (
        _placed(env)
        == _newest(source, versioned=False)
        == {
            "A-x": (0, 1),
            "A-y": (0, 2),
            "B-x": (0, 0),
            "C-z": (0, 3),
        }
    )
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)] and env.prepared() == []


def test_a_split_with_a_version_column_over_two_partitions_refuses_and_a_rebuild_places_all(
    env, spark
):
    """With a version column a key's older versions may lie in any partition: a backfill of
    partition 0 alone, even from its first record, does not hold them all. A-x's versions are
    (0, 0) and (1, 0); row A was (0, 1), version 3."""
    recs = {
        (0, 0): _record(0, "A", "x", 1),
        (0, 1): _record(0, "A", "y", 3),
        (1, 0): _record(1, "A", "x", 2),
        (1, 1): _record(1, "B", "x", 1),
    }
    env.append(list(recs.values()))
    _pipeline(env, OLD, version="ver")
    assert env.run(spark).ok
    assert _placed(env) == {"A": (0, 1), "B": (1, 1)}
    _pipeline(env, SPLIT, version="ver")
    before = _world(env)

    for dry_run in (False, True):
        report = env.run(spark, mode=Backfill([Range(0, 0, 2)]), dry_run=dry_run)
        _assert_refused(env, report, before, "partition 0 offset 1: (A) -> (A-y)")

    rebuilt = env.run(spark, mode=Rebuild("main"), sink_names=["main"])
    assert rebuilt.ok, rebuilt.summary()
    assert (
        _placed(env)
        == _newest(recs, versioned=True)
        == {
            "A-x": (1, 0),
            "A-y": (0, 1),
            "B-x": (1, 1),
        }
    )
    assert env.prepared() == []


def test_a_partial_backfill_that_merges_keys_is_refused_too(env, spark):
    """A merge (key id-region becomes id) looks the same from the sink as a split: the old
    keys of the versions a removed row stood for are gone. Refused alike; the whole range
    then places the newest version of each new key."""
    recs = [_record(0, "A", "x"), _record(0, "A", "y"), _record(0, "A", "x")]
    env.append(recs)
    _pipeline(env, SPLIT)
    assert env.run(spark).ok
    assert _placed(env) == {"A-x": (0, 2), "A-y": (0, 1)}
    _pipeline(env, OLD)
    before = _world(env)

    report = env.run(spark, mode=Backfill([Range(0, 1, 2)]))
    _assert_refused(env, report, before, "partition 0 offset 1: (A-y) -> (A)")
    whole = env.run(spark, mode=Backfill([Range(0, 0, 3)]))
    assert whole.ok, whole.summary()
    assert _placed(env) == {"A": (0, 2)}


def test_the_cli_refuses_a_split_backfill_and_its_preview_with_exit_1(env, spark):
    """As a rebuild's --accept-pruned refusal: the sink fails, the summary says why, exit 1."""
    env.append([_record(0, "A", "x"), _record(0, "A", "y")])
    _pipeline(env, OLD)
    assert env.run(spark).ok
    _pipeline(env, SPLIT)
    before = _world(env)
    for more in (["--dry-run"], []):
        code, out, err = tm(
            env.cli_env(),
            *["backfill", "orders", "--partition", "0", "--from", "1", "--to", "2", *more],
            cwd=env.tmp,
        )
        assert code == 1, (out, err)
        assert REFUSED in out and "tidemark sink rebuild orders main" in out, out
        assert "Traceback" not in err, err
        assert _world(env) == before


def test_a_whole_backfill_of_a_latest_sink_after_a_key_change_places_every_version(env, spark):
    """`start: latest` and a key change (issue 45 cases 1 and 2 together, found by `tidemark
    chaos --feature start --feature split`): the sink began at offset 2, so everything it
    received is [2, end), and `--partition all` (what the refusal names) backfills exactly
    that. It was refused as partial, for the versions below offset 2 the sink never had."""
    sinks = [{"name": "main", "dsn": env.sink_dsn, "table": "public.t", "key": ["k"]}]
    env.append([_record(0, "A", "w"), _record(0, "B", "w")])  # history, never delivered
    env.pipeline(start="latest", decode=DECODE, transform={"select": OLD}, sinks=sinks)
    assert env.run(spark).ok  # the sink begins at 2
    recs = [_record(0, "A", "x"), _record(0, "A", "y"), _record(0, "C", "z")]
    env.append(recs)
    assert env.run(spark).ok
    assert _placed(env) == {"A": (0, 3), "C": (0, 4)}
    env.pipeline(start="latest", decode=DECODE, transform={"select": SPLIT}, sinks=sinks)

    code, out, err = tm(
        env.cli_env(), "backfill", "orders", "--partition", "all", "--sink", "main", cwd=env.tmp
    )
    assert code == 0, out + err
    assert _placed(env) == {"A-x": (0, 2), "A-y": (0, 3), "C-z": (0, 4)}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)] and env.prepared() == []
