"""The states of a run (tidemark.runs.state): its own module so that the ledger's modules
that only name a state (staging.py) need not import the state machine (state.py), which
calls them.
"""

from __future__ import annotations

import enum


class RunState(enum.StrEnum):
    PLANNED = "planned"
    WRITING = "writing"
    PREPARED = "prepared"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    DQ_FAILED = "dq_failed"
    # Decided, some participants committed, another rolled back by someone else: its ranges
    # must be re-delivered (`tidemark settle RUN`), which makes it committed.
    LOST = "lost"
    # A dry run's sink that would commit: prepared, then rolled back instead of decided.
    PREVIEWED = "previewed"
