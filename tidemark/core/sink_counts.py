"""What one sink's run counts, one type from the Spark task (TaskResult) through the driver
(RunReport) to the ledger (``tidemark.run_sinks.counts``, by :meth:`SinkCounts.to_json` and
:meth:`SinkCounts.from_json`). The task-accounting rule is :meth:`SinkCounts.unbalanced`
(docs/design.md, "Task accounting")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class SinkCounts:
    records: int = 0  # records of the sink's range seen
    rows: int = 0  # rows written (inserted or replaced)
    dead: int = 0  # records quarantined for the sink
    superseded: int = 0  # versions not written: a newer one of their key won
    removed: int = 0  # re-delivery: rows of the range removed (then placed again)
    resolved: int = 0  # re-delivery: dead letters resolved (their records now delivered)
    fallback: int = 0  # backfill: older versions examined for keys that lost their row
    tombstones: int = 0  # tombstones that delete their key (tombstones: delete)

    def __add__(self, other: SinkCounts) -> SinkCounts:
        return SinkCounts(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @staticmethod
    def total(many: Iterable[SinkCounts]) -> SinkCounts:
        """The sum of ``many`` (a sink's tasks' counts)."""
        return sum(many, SinkCounts())

    def unbalanced(self) -> str | None:
        """Why the records (and fallback versions) are not all written, quarantined,
        superseded or applied as tombstones; None when they are."""
        placed = self.rows + self.dead + self.superseded + self.tombstones
        if self.records + self.fallback == placed:
            return None
        return (
            f"{self.records} records"
            + (f" and {self.fallback} fallback versions" if self.fallback else "")
            + f" but {self.rows} written + {self.dead} quarantined + "
            f"{self.superseded} superseded + {self.tombstones} tombstones"
        )

    def to_json(self) -> dict[str, int]:
        """The ledger's shape: one number per count."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> SinkCounts:
        """The ledger's counts of a sink, rows of every version: a count a row predates is 0,
        an aborted run may hold ``records`` only, and before dead letters were per sink
        (V004) ``dead`` was ``sink_dead`` + ``source_dead``."""
        data = data or {}
        known = {f.name: int(data[f.name]) for f in fields(cls) if data.get(f.name) is not None}
        if "dead" not in known:
            known["dead"] = int(data.get("sink_dead") or 0) + int(data.get("source_dead") or 0)
        return cls(**known)
