"""How far each sink is behind its source, per partition: the records between its checkpoint
and the source's settled end (what a run could read now), and when the first of them was
appended. The maintenance DAG alerts on it and emits it as metrics (docs/operations.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg

from tidemark import config, sources
from tidemark.ledger import checkpoints

_ALL = 2**62  # no limit: the settled end from the checkpoint on (as Planner.latest)


@dataclass(frozen=True)
class Lag:
    sink: str
    partition: int
    checkpoint: int  # the sink's next offset to deliver
    head: int  # the source's settled end (exclusive)
    oldest: datetime | None  # when the first undelivered record was appended (None: unknown)

    @property
    def records(self) -> int:
        return max(self.head - self.checkpoint, 0)

    def age_seconds(self, now: datetime | None = None) -> float:
        """Age of the oldest undelivered record (0 when nothing is undelivered or unknown)."""
        if not self.records or self.oldest is None:
            return 0.0
        return max(((now or datetime.now(UTC)) - self.oldest).total_seconds(), 0.0)


def measure(conn: psycopg.Connection, pipeline: config.Pipeline) -> list[Lag]:
    """Every (sink, partition) of the pipeline. A partition a sink has no checkpoint in yet
    counts from where it will begin (sources.first_offset), unless the pipeline starts at
    ``latest`` (it would skip that history)."""
    at = checkpoints.positions(conn, pipeline.name)
    planner = sources.planner(pipeline)
    out = []
    try:
        for part in planner.partitions():
            ends: dict[int, tuple[int, datetime | None]] = {}  # sinks often share a checkpoint
            for sink in pipeline.sinks:
                ck = at.get(sink.name, {}).get(part)
                if ck is None:
                    ck = (
                        None
                        if pipeline.start == "latest"
                        else sources.first_offset(pipeline, planner, part)
                    )
                    if ck is None:
                        continue
                if ck not in ends:
                    head = planner.safe_end(part, ck, _ALL)
                    ends[ck] = (head, planner.record_time(part, ck) if head > ck else None)
                head, oldest = ends[ck]
                out.append(Lag(sink.name, part, ck, head, oldest))
    finally:
        planner.close()
    return out
