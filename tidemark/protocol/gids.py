"""Global transaction ids: ``<prefix>:<run>:<stage>:<task>:<attempt>[:<write>]``.

Stages: ``s.<sink>`` rows for a sink (on the sink database) and ``d.<sink>`` that sink's dead
letters (on the ledger database). Every participant belongs to exactly one sink.

``write`` numbers the writes of one run: a run writes its batch a second time when its
one-pass write is undone (docs/quality.md, "One pass"), and that write's gids must be new so
that each of its tasks can roll back what the first write left of it. The first write (0)
leaves the field out, so its gids read as they always have. Releases before the field
numbered a second write's attempts from 100 instead (``tm:7:s.main:3:100``): such a gid parses
as write 0, attempt 100, which is all anyone reads of it once its run is gone (run, stage
and task; a run never mixes gids of two releases).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    attempt: int  # Spark's attempt number of the task
    write: int = 0  # which write of the run's batch (docs/quality.md, "One pass")

    def __str__(self) -> str:
        base = f"{self.prefix}:{self.run_id}:{self.stage}:{self.task}:{self.attempt}"
        return f"{base}:{self.write}" if self.write else base

    @property
    def on_ledger(self) -> bool:
        return not self.stage.startswith("s.")

    @property
    def sink(self) -> str:
        return self.stage[2:]

    def earlier_than(self, other: Gid) -> bool:
        """Whether this is an earlier try of the same task: an earlier write, or an earlier
        attempt of the same write."""
        return self.task == other.task and (self.write, self.attempt) < (
            other.write,
            other.attempt,
        )


def parse(gid: str, prefix: str) -> Gid | None:
    parts = gid.split(":")
    if len(parts) not in (5, 6) or parts[0] != prefix:
        return None
    try:
        write = int(parts[5]) if len(parts) == 6 else 0
        if len(parts) == 6 and write < 1:
            return None  # the first write leaves the field out: not one of ours
        return Gid(prefix, int(parts[1]), parts[2], int(parts[3]), int(parts[4]), write)
    except ValueError:
        return None


def like_run(prefix: str, run_id: int) -> str:
    return f"{prefix}:{run_id}:%"


def like_task(prefix: str, run_id: int, stage: str, task: int) -> str:
    return f"{prefix}:{run_id}:{stage}:{task}:%"
