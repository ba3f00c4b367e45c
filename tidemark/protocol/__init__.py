"""The commit protocol's parts (docs/design.md): global transaction ids, two-phase commit
on any PostgreSQL database, sink databases (tables, markers), the typed contract between the
driver and its Spark tasks, and recovery of what a crash left in doubt.

May import: ledger, config, quality, core.
"""
