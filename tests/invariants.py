"""Checks of DESIGN.md's invariants against the real databases."""

from __future__ import annotations


def assert_exactly_once(env, pipeline: str = "orders", sinks: dict[str, str] | None = None,
                        table: str = "orders") -> None:
    """Invariant 1, 2 and 4: below every checkpoint each source offset is in the sink exactly
    once or in the DLQ exactly once, nothing else is, and no prepared transaction is left."""
    sinks = sinks or {"main": env.sink_dsn}
    source = env.ledger('SELECT "partition", "offset" FROM src.log')
    for sink, dsn in sinks.items():
        cps = env.checkpoints(pipeline, sink)
        below = {(p, o) for p, o in source if o < cps.get(p, 0)}
        delivered = env.q(dsn, f"SELECT _tm_partition, _tm_offset FROM {table}")
        # A redriven dead letter's record is in the sink now.
        dead = env.ledger(
            "SELECT source_partition, source_offset FROM tidemark.dlq WHERE pipeline = %s "
            "AND (sink IS NULL OR sink = %s) AND status <> 'redriven'", (pipeline, sink))
        placed = delivered + dead
        assert len(placed) == len(set(placed)), f"{sink}: a record is placed twice"
        # Superseded versions of a key are placed by their newer version (keyed sink).
        superseded = _superseded(env, below)
        assert set(placed) | superseded >= below, f"{sink}: records below the checkpoint lost"
        assert set(placed) <= below, f"{sink}: records above the checkpoint delivered"
    for dsn in {env.ledger_dsn, *sinks.values()}:
        left = env.q(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        assert left == [], f"prepared transactions left: {left}"


def _superseded(env, offsets: set[tuple[int, int]]) -> set[tuple[int, int]]:
    rows = env.ledger('SELECT "partition", "offset", key FROM src.log')
    newest: dict[bytes, tuple[int, int]] = {}
    for p, o, k in rows:
        if (p, o) in offsets and k is not None:
            k = bytes(k)
            newest[k] = max(newest.get(k, (p, o)), (p, o))
    return {(p, o) for p, o, k in rows
            if (p, o) in offsets and k is not None and newest[bytes(k)] != (p, o)}
