"""What a run claimed (ledger/state.py ``claim``): per sink its lease epoch and ranges."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidemark.core.ranges import Range


@dataclass
class SinkClaim:
    sink: str
    epoch: int
    ranges: list[Range]


@dataclass
class Claim:
    run_id: int
    pipeline: str
    mode: str
    sinks: dict[str, SinkClaim] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # sink -> why it was not claimed

    def read_ranges(self) -> list[Range]:
        """One read per partition, from the minimum over the claimed sinks."""
        by_part: dict[int, Range] = {}
        for sc in self.sinks.values():
            for r in sc.ranges:
                if r.size == 0:
                    continue
                cur = by_part.get(r.partition)
                by_part[r.partition] = (
                    r
                    if cur is None
                    else Range(r.partition, min(cur.start, r.start), max(cur.end, r.end))
                )
        return [by_part[p] for p in sorted(by_part)]
