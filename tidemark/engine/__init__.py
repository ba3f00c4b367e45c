"""The Spark engine: the session, decode and transform of source records into sink rows,
and the task writer that stages, merges and PREPAREs each task's rows and dead letters
(writer: the task; accounts, placement, redelivery: what it accounts for and places; sink_task,
sink_writer, dead_letters, transactions: per sink, its rows and letters and how they prepare).

May import: sources, protocol, ledger, config, quality, core.
"""
