"""The Spark engine: the session, decode and transform of source records into sink rows,
and the task writer that stages, merges and PREPAREs each task's rows and dead letters.

May import: sources, protocol, ledger, config, quality, core.
"""
