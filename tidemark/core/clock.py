"""Where a task's time goes: seconds accumulated per named phase, cheap enough to leave on."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def waiting(self, phase: str, items: Iterable[T]) -> Iterator[T]:
        """``items``, with the time spent waiting for each next one charged to ``phase``."""
        it = iter(items)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.add(phase, time.perf_counter() - t)
                return
            self.add(phase, time.perf_counter() - t)
            yield item

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}
