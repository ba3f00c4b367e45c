"""One run end to end: claim, write (Spark tasks), the quality gate, decide per sink,
finish. Modes say what a run delivers: a delivery, a backfill, a redrive.

May import: engine, sources, protocol, ledger, config, quality, core.
"""
