"""Offsets of a source: a :class:`Range` of one partition, the unit every layer plans, claims,
reads and checkpoints in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    partition: int
    start: int  # inclusive
    end: int  # exclusive

    @property
    def size(self) -> int:
        return self.end - self.start

    def above(self, floor: int | None) -> Range:
        """The part at or above offset ``floor`` (empty when none is; None: all of it). A
        re-delivery takes only the part at or above where a sink began."""
        start = self.start if floor is None else max(self.start, floor)
        return Range(self.partition, start, max(start, self.end))
