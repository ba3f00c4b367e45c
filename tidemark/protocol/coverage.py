"""Which offsets of a spread run's ranges each task saw, and whether together they saw each once.

A spread run (tidemark/driver/modes.py, Layout) hands every task records from anywhere in the
run's ranges, so no task can tell alone that a record is missing. Each task returns a bitmap
per partition of the offsets it saw (exactly once, or it fails its own accounting); the
driver checks that no offset was seen by two tasks and, for a source holding every offset,
that none was seen by no task. The bitmaps are packed and compressed: an eighth of a byte
per offset at most, so the driver's memory stays flat in the records per run.
"""

from __future__ import annotations

import base64
import zlib

import numpy as np

from tidemark.protocol.taskspec import Span


def encode(seen: np.ndarray) -> str:
    """A boolean array (offset - span start -> seen) as text for a TaskResult."""
    return base64.b64encode(zlib.compress(np.packbits(seen).tobytes(), 1)).decode("ascii")


def decode(text: str, size: int) -> np.ndarray:
    """The packed bitmap of ``encode`` (size bits, padded to bytes)."""
    packed = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    if len(packed) != (size + 7) // 8:
        raise ValueError(f"a bitmap of {len(packed)} bytes for {size} offsets")
    return packed


def problem(spans: list[Span], seen: list[dict[int, str]]) -> str | None:
    """What is wrong with the tasks' bitmaps ``seen`` (one dict per task) over ``spans``."""
    for s in spans:
        once = np.zeros((s.size + 7) // 8, np.uint8)
        twice = np.zeros_like(once)
        for task in seen:
            text = task.get(s.partition)
            if text is None:
                continue
            bits = decode(text, s.size)
            twice |= once & bits
            once |= bits
        extra = int(np.unpackbits(twice, count=s.size).sum())
        missing = s.size - int(np.unpackbits(once, count=s.size).sum()) if s.dense else 0
        if extra or missing:
            bad = np.unpackbits(twice if extra else ~once, count=s.size)
            first = s.start + int(np.argmax(bad))
            return (
                f"partition {s.partition} [{s.start}, {s.end}): {missing} record(s) "
                f"missing, {extra} seen by two tasks (first at offset {first})"
            )
    return None
