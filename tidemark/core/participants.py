"""The participants of a decision (docs/design.md, "Commit protocol"): prepared transactions,
each in the ledger's database or in one sink's. The ledger stores a target as text
(``ledger`` or ``sink:<name>``); it is parsed once, where the ledger is read. A task's result
carries it as the model's JSON (tidemark/protocol/taskspec.py: Prepared.target)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TargetKind(StrEnum):
    LEDGER = "ledger"
    SINK = "sink"


@dataclass(frozen=True)
class Target:
    """The database a participant's transaction is prepared in: the ledger's, or sink
    ``name``'s."""

    kind: TargetKind
    name: str | None = None  # the sink's (None: the ledger)

    def __post_init__(self) -> None:
        if (self.kind is TargetKind.SINK) != bool(self.name):
            raise ValueError(f"participant target {self.kind}: sink name {self.name!r}")

    @classmethod
    def ledger(cls) -> Target:
        return cls(TargetKind.LEDGER)

    @classmethod
    def sink(cls, name: str) -> Target:
        return cls(TargetKind.SINK, name)

    @classmethod
    def parse(cls, text: str) -> Target:
        """``ledger`` or ``sink:<name>``, as the ledger spells it."""
        if text == TargetKind.LEDGER:
            return cls.ledger()
        kind, sep, name = text.partition(":")
        if kind != TargetKind.SINK or not sep or not name:
            raise ValueError(f"participant target {text!r}: not 'ledger' or 'sink:<name>'")
        return cls.sink(name)

    def __str__(self) -> str:
        return str(self.kind) if self.name is None else f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Participant:
    gid: str
    target: Target
    task: int
    rows: int
