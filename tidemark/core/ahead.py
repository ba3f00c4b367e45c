"""An iterator made in a thread of its own, a few items ahead of the one consuming it.

The local runner's write task (tidemark/driver/runners.py) reads, decodes and transforms its
records (ADBC, Arrow's JSON parser and kernels: C++ that releases the GIL) while the task's
own thread encodes and waits on PostgreSQL's COPY: the two overlap instead of taking turns.

What the consumer sees is exactly what the iterator yields, in order, nothing more: an
exception in the producer is raised in the consumer where the items stop (never an early end,
which would read as the data being done), and :meth:`Ahead.close` stops the producer and waits
for it, its iterator closed in its own thread (a reader's ``finally`` runs there), before the
caller may touch what the producer used (the runner's shared reader connection).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")


class Ahead(Generic[T]):
    """Up to ``depth`` items of ``make()`` made ahead, in a thread started by :meth:`start`
    (its owner first keeps it where a signal's cleanup finds it). Iterate it once; close it
    (or use it as a context manager) whatever happens."""

    def __init__(self, make: Callable[[], Iterator[T]], depth: int, name: str) -> None:
        assert depth >= 1, depth
        # Called in the consumer's thread when it reaches the end of the items, the
        # producer's iterator closed by then: what may use what the producer used next.
        self.then: Callable[[], None] | None = None
        self._depth = depth
        self._items: deque[T] = deque()
        self._done = False  # the producer ended: every item made is in _items
        self._failure: BaseException | None = None  # why it ended, if not at the end
        self._stopped = False  # the consumer is gone: the producer stops at its next item
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._produce, args=(make,), name=name, daemon=True)

    def start(self) -> Ahead[T]:
        self._thread.start()
        return self

    def _produce(self, make: Callable[[], Iterator[T]]) -> None:
        try:
            items = make()
            try:
                for item in items:
                    with self._cond:
                        self._cond.wait_for(lambda: len(self._items) < self._depth or self._stopped)
                        if self._stopped:
                            return
                        self._items.append(item)
                        self._cond.notify_all()
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # a generator's finally (a reader's cleanup) runs in this thread
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            with self._cond:
                self._failure = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def __iter__(self) -> Iterator[T]:
        while True:
            with self._cond:
                # Interruptible: a signal handler's exception (SIGTERM: Terminated) is raised
                # here in the main thread as it would be anywhere else.
                self._cond.wait_for(lambda: self._items or self._done)
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify_all()
                elif self._failure is not None:
                    raise self._failure
                else:
                    break
            yield item
        if self.then is not None:
            self.then()

    def close(self) -> None:
        """Stops the producer and waits until it has ended (and closed its iterator)."""
        with self._cond:
            self._stopped = True
            self._items.clear()
            self._cond.notify_all()
        if self._thread.ident is None:
            return  # never started
        try:
            self._thread.join()
        except BaseException:
            self._thread.join()  # a signal during the wait: the producer still ends first
            raise

    def __enter__(self) -> Ahead[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
