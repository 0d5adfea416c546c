"""precheck.check from several threads at once (the SDK checks each cell on the calling
thread, and a server or an async app calls it from many)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest

from sandlot import precheck

CODE = "\n".join(
    f"def f{i}(a, b):\n    return [x * {i} for x in (a, b) if x] + [{{'k': (1, 2, [3])}}]"
    for i in range(60)
)


class _Finalized:
    def __del__(self) -> None:  # Python code run by the collector, mid-parse
        sum(range(50))


@pytest.fixture
def busy_interpreter() -> Iterator[None]:
    """Thread switches and collections as often as they can come: CPython before 3.12
    shares the AST builder's depth counter between threads, and a collection that runs
    a finalizer inside one thread's parse lets another thread's parse move it."""
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50, 1, 1)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)


def test_checks_on_four_threads_at_once_all_parse(busy_interpreter: None) -> None:
    failures: list[BaseException] = []
    unparsed: list[precheck.PrecheckReport] = []

    def work() -> None:
        for _ in range(25):
            garbage: list[object] = [_Finalized() for _ in range(20)]
            garbage.append(garbage)  # a cycle: only the collector frees it
            del garbage
            try:
                report = precheck.check(CODE)
            except BaseException as exc:  # what a thread raised is the finding
                failures.append(exc)
            else:
                if not report.syntax_ok:
                    unparsed.append(report)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert unparsed == []
