"""Global transaction ids: ``<prefix>:<run>:<stage>:<task>:<attempt>``.

Stages: ``s.<sink>`` rows for a sink (on the sink database) and ``d.<sink>`` that sink's dead
letters (on the ledger database). Every participant belongs to exactly one sink.
"""

from __future__ import annotations

from dataclasses import dataclass

# A run writes its batch a second time when its one-pass write is undone (docs/quality.md,
# "One pass"): that write's attempts are numbered from here, past any Spark retry of the first,
# so its gids are new and each of its tasks first rolls back what the first write left of it.
REWRITE_ATTEMPT = 100


def sink_stage(sink: str) -> str:
    return f"s.{sink}"


def dlq_stage(sink: str) -> str:
    return f"d.{sink}"


@dataclass(frozen=True)
class Gid:
    prefix: str
    run_id: int
    stage: str
    task: int
    attempt: int

    def __str__(self) -> str:
        return f"{self.prefix}:{self.run_id}:{self.stage}:{self.task}:{self.attempt}"

    @property
    def on_ledger(self) -> bool:
        return not self.stage.startswith("s.")

    @property
    def sink(self) -> str:
        return self.stage[2:]


def parse(gid: str, prefix: str) -> Gid | None:
    parts = gid.split(":")
    if len(parts) != 5 or parts[0] != prefix:
        return None
    try:
        return Gid(prefix, int(parts[1]), parts[2], int(parts[3]), int(parts[4]))
    except ValueError:
        return None


def like_run(prefix: str, run_id: int) -> str:
    return f"{prefix}:{run_id}:%"


def like_task(prefix: str, run_id: int, stage: str, task: int) -> str:
    return f"{prefix}:{run_id}:{stage}:{task}:%"
