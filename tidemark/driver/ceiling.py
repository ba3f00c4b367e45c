"""The quarantine ceiling (``quality.max_quarantined``): a run that would send more than that
share of a sink's records to the DLQ (and at least ``max_quarantined_min`` of them) halts
before its decision, nothing committed, and says why; the pipeline stays halted until
`tidemark resume` (driver/verifying.py). A whole batch the gate quarantines on purpose
(``dq_gate``) does not count.

May import: protocol, config, core.
"""

from __future__ import annotations

from collections import Counter

from tidemark.config import Pipeline
from tidemark.protocol.taskspec import SinkResult

SHOWN = 3  # reasons the message names


def breach(pipeline: Pipeline, sink: str, results: list[SinkResult]) -> str | None:
    """The message when ``results`` (the sink's, from every task) quarantine more than the
    ceiling allows; None otherwise."""
    share = pipeline.quality.max_quarantined
    records = sum(r.counts.records for r in results)
    reasons: Counter[str] = Counter()
    for r in results:
        reasons.update(r.reasons)
    dead = sum(r.counts.dead - r.classes.get("dq_gate", 0) for r in results)
    least = pipeline.quality.max_quarantined_min
    if share >= 1 or records == 0 or dead <= share * records or dead < least:
        return None
    top = [(why, n) for why, n in reasons.most_common() if not why.startswith("dq_gate:")]
    named = "; ".join(f"{n:,} x {why}" for why, n in top[:SHOWN])
    return (
        f"sink {sink}: {dead:,} of {records:,} records ({dead / records:.0%}) would go to the "
        f"dead-letter queue, over quality.max_quarantined ({share:.0%}); nothing was "
        f"committed. Top reasons: {named}. Fix the cause (docs/quality.md, 'Quarantine "
        f"ceiling'), or raise max_quarantined if this is the data"
    )
