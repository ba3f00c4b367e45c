"""Checks of docs/design.md's invariants against the real databases."""

from __future__ import annotations

LIVE = ("quarantined", "discarded")


def assert_exactly_once(
    env,
    pipeline: str = "orders",
    sinks: dict[str, str] | None = None,
    table: str = "orders",
    tombstones: bool = False,
) -> None:
    """Invariants 1, 2 and 4, per sink: from where it began to its checkpoint each source
    offset is placed exactly once *for that sink* (its own row, or one live dead letter naming
    that sink; a version superseded by a newer one of its key may have neither), nothing
    below where it began nor at or above the checkpoint is placed, and no prepared
    transaction is left. ``tombstones``: the sinks
    delete keys, so a tombstone (a key, no payload) places itself and supersedes what is older
    in its partition."""
    sinks = sinks or {"main": env.sink_dsn}
    source = env.ledger('SELECT "partition", "offset" FROM src.log')
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE sink IS NULL") == [(0,)]
    for sink, dsn in sinks.items():
        cps = env.checkpoints(pipeline, sink)
        began = _began(env, pipeline, sink)
        below = {(p, o) for p, o in source if began.get(p, 0) <= o < cps.get(p, 0)}
        delivered = env.q(dsn, f"SELECT _tm_partition, _tm_offset FROM {table}")
        if tombstones:
            delivered += [
                (p, o)
                for p, o in env.ledger(
                    'SELECT "partition", "offset" FROM src.log WHERE payload IS NULL '
                    "AND key IS NOT NULL"
                )
                if o < cps.get(p, 0)
            ]
        dead = env.ledger(
            "SELECT source_partition, source_offset FROM tidemark.dlq WHERE pipeline = %s "
            "AND sink = %s AND status::text = ANY(%s)",
            (pipeline, sink, list(LIVE)),
        )
        placed = delivered + dead
        assert len(placed) == len(set(placed)), f"{sink}: a record is placed twice"
        superseded = _superseded(env, below, set(delivered))
        assert set(placed) | superseded >= below, (
            f"{sink}: records below the checkpoint lost: {sorted(below - set(placed))[:5]}"
        )
        assert set(placed) <= below, (
            f"{sink}: records at or above the checkpoint, or below where it began, placed: "
            f"{sorted(set(placed) - below)[:5]}"
        )
    for dsn in {env.ledger_dsn, *sinks.values()}:
        left = env.q(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        assert left == [], f"prepared transactions left: {left}"


def _began(env, pipeline: str, sink: str) -> dict[int, int]:
    """Where the sink began, per partition (a partition left out: at the source's first)."""
    return dict(
        env.ledger(
            "SELECT partition, start_offset FROM tidemark.checkpoints WHERE pipeline = %s "
            "AND sink = %s AND start_offset IS NOT NULL",
            (pipeline, sink),
        )
    )


def assert_at_least_once(
    env, pipeline: str = "orders", sinks: dict[str, str] | None = None, table: str = "orders"
) -> None:
    """What at least once promises (docs/pipelines.md, ``delivery``), per sink: every source
    offset from where it began to its checkpoint is placed (its own row or a live dead letter naming the sink,
    or superseded by a newer version of its key), maybe more than once; no prepared
    transaction is left (none is ever made)."""
    sinks = sinks or {"main": env.sink_dsn}
    source = env.ledger('SELECT "partition", "offset" FROM src.log')
    for sink, dsn in sinks.items():
        cps = env.checkpoints(pipeline, sink)
        began = _began(env, pipeline, sink)
        below = {(p, o) for p, o in source if began.get(p, 0) <= o < cps.get(p, 0)}
        delivered = set(env.q(dsn, f"SELECT _tm_partition, _tm_offset FROM {table}"))
        dead = env.ledger(
            "SELECT source_partition, source_offset FROM tidemark.dlq WHERE pipeline = %s "
            "AND sink = %s AND status::text = ANY(%s)",
            (pipeline, sink, list(LIVE)),
        )
        placed = delivered | set(dead) | _superseded(env, below, delivered)
        assert placed >= below, (
            f"{sink}: records below the checkpoint lost: {sorted(below - placed)[:5]}"
        )
    for dsn in {env.ledger_dsn, *sinks.values()}:
        left = env.q(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        assert left == [], f"prepared transactions left: {left}"


def _superseded(
    env, offsets: set[tuple[int, int]], delivered: set[tuple[int, int]]
) -> set[tuple[int, int]]:
    """Records below the checkpoint whose key's row in the sink is a newer version: a higher
    offset of the same partition, or (a sink with a version column) a row from another
    partition. Their key's place is that row's. A newer version that is not in the sink (a
    dead letter) places nothing older: the key's last good version must then be there."""
    rows = env.ledger('SELECT "partition", "offset", key FROM src.log')
    held: dict[bytes, list[tuple[int, int]]] = {}  # key -> its delivered rows
    for p, o, k in rows:
        if (p, o) in delivered and k is not None:
            held.setdefault(bytes(k), []).append((p, o))
    return {
        (p, o)
        for p, o, k in rows
        if (p, o) in offsets
        and k is not None
        and any(p2 != p or o2 > o for p2, o2 in held.get(bytes(k), ()))
    }
