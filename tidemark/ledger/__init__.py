"""The ledger: every statement against the ``tidemark.*`` tables lives here, with the
migrations (``sql/``, shipped in the wheel). The run state machine (state.py: one enum, one
function per transition, each one ledger transaction), checkpoints, dead letters, status.

May import: config, quality, core.
"""
