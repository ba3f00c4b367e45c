"""tidemark/core/ahead.py: the local runner's read-ahead hands over exactly what its iterator
yields, raises what it raised where it raised it, and ends its thread (and closes its
iterator there) before close() returns."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tidemark.core.ahead import Ahead


def test_every_item_in_order_then_the_end():
    with Ahead(lambda: iter(range(1000)), 3, "t").start() as items:
        assert list(items) == list(range(1000))


class Boom(Exception):
    pass


def test_a_failure_in_the_producer_is_raised_after_the_items_before_it_never_an_early_end():
    def make():
        yield from range(5)
        raise Boom("source went away")

    with Ahead(make, 2, "t").start() as items:
        got = []
        with pytest.raises(Boom, match="source went away"):
            for x in items:
                got.append(x)
    assert got == [0, 1, 2, 3, 4]


def test_a_failure_before_the_first_item_is_raised_too():
    def make():
        raise Boom("no connection")

    with Ahead(make, 2, "t").start() as items, pytest.raises(Boom):
        next(iter(items))


def test_close_stops_the_producer_and_closes_its_iterator_in_its_own_thread_first():
    closed_in: list[str] = []
    made = []

    def make():
        try:
            for i in range(10**9):
                made.append(i)
                yield i
        finally:
            closed_in.append(threading.current_thread().name)

    ahead = Ahead(make, 2, "producer").start()
    it = iter(ahead)
    assert next(it) == 0
    ahead.close()
    assert closed_in == ["producer"]  # done before close() returned
    assert not ahead._thread.is_alive()
    assert len(made) <= 4  # it stopped at its bound: one taken, two queued, one in hand


def test_a_signal_while_waiting_for_the_next_item_is_raised_in_the_consumer():
    """SIGTERM's handler raises Terminated in the main thread wherever it is: also while it
    waits on a producer that has nothing yet."""
    release = threading.Event()

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop

    def make():
        release.wait()  # a slow read
        yield 1

    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        with Ahead(make, 2, "t").start() as items:
            timer.start()
            with pytest.raises(Stop):
                next(iter(items))
            release.set()  # close() waits for the producer to end
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
