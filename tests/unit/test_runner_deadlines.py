"""The runner's deadline thread (sandlot.runner._contexts.Deadlines), in-process.

It enforces every cell's timeout, so it must call what is due, in order, never what
was cancelled, and must not grow with the number of cells that ended in time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sandlot.runner._contexts import Deadlines


def _collect() -> tuple[Deadlines, list[str], list[Callable[[], None]], threading.Event]:
    submitted: list[Callable[[], None]] = []
    deadlines = Deadlines(submitted.append)
    fired: list[str] = []
    done = threading.Event()
    return deadlines, fired, submitted, done


def test_due_callbacks_run_in_order_and_cancelled_ones_never() -> None:
    deadlines, fired, submitted, done = _collect()
    deadlines.start()
    now = time.monotonic()

    def note(name: str) -> Callable[[], Callable[[], None] | None]:
        def callback() -> Callable[[], None] | None:
            fired.append(name)
            if name == "last":
                done.set()
                return lambda: None  # a task for a worker
            return None

        return callback

    deadlines.add(now + 0.30, note("last"))
    deadlines.add(now + 0.10, note("first"))
    cancelled = deadlines.add(now + 0.05, note("cancelled"))
    deadlines.add(now + 0.20, note("second"))  # not the earliest: no wake needed
    deadlines.cancel(cancelled)
    assert done.wait(10)
    assert fired == ["first", "second", "last"]
    assert len(submitted) == 1
    assert time.monotonic() - now >= 0.30


def test_an_earlier_deadline_wakes_the_thread() -> None:
    deadlines, fired, _, done = _collect()
    deadlines.start()
    deadlines.add(time.monotonic() + 3600, lambda: None)  # the thread now sleeps an hour

    def due() -> None:
        fired.append("due")
        done.set()

    started = time.monotonic()
    deadlines.add(time.monotonic() + 0.05, lambda: due())
    assert done.wait(10)
    assert time.monotonic() - started < 5


def test_cells_that_end_in_time_do_not_pile_up() -> None:
    deadlines, _, _, _ = _collect()  # (no thread: only the bookkeeping)
    far = time.monotonic() + 3600
    for _ in range(10_000):
        deadlines.cancel(deadlines.add(far, lambda: None))
    assert len(deadlines.heap) <= 2 * 65
