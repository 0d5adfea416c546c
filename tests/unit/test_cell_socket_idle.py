"""The cell WebSocket's idle close (``sandlot.server._cellsocket._IdleWatch``): one
timer per connection, which must close a connection idle past ``IDLE_SECONDS`` and
never one with a cell admitted or running, or one whose next cell just arrived.

Driven by calling the timer's callback at chosen moments (its clock moved back), so
nothing here waits for a minute to pass."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from sandlot.server import _cellsocket
from sandlot.server._cellsocket import IDLE_SECONDS, _IdleWatch


def test_an_idle_connection_is_closed_and_a_busy_one_is_not() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[object] = loop.create_future()
        watch = _IdleWatch(lambda: waiting)  # type: ignore[arg-type, return-value]
        try:
            watch._fire()  # just opened: not idle yet
            assert not watch.expired and not waiting.cancelled()

            watch.busy = True  # a cell runs for longer than the idle time
            watch._since -= IDLE_SECONDS + 1
            watch._fire()
            assert not watch.expired and not waiting.cancelled()

            watch.rest()  # the cell ended: idle from now
            watch._fire()
            assert not watch.expired and not waiting.cancelled()

            done: asyncio.Future[object] = loop.create_future()
            done.set_result({"type": "websocket.receive"})
            late = _IdleWatch(lambda: done)  # type: ignore[arg-type, return-value]
            late._since -= IDLE_SECONDS + 1
            late._fire()  # a message arrived at the deadline: it is taken, not dropped
            assert not late.expired
            late.stop()

            watch._since -= IDLE_SECONDS + 1
            watch._fire()
            assert watch.expired and waiting.cancelled()
        finally:
            watch.stop()

    asyncio.run(scenario())


def test_the_idle_time_is_read_when_the_timer_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer is real: a connection left idle is closed when it fires."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[object] = loop.create_future()
        monkeypatch.setattr(_cellsocket, "IDLE_SECONDS", 0.05)
        watch = _IdleWatch(lambda: waiting)  # type: ignore[arg-type, return-value]
        try:
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(waiting, 30)
            assert watch.expired
        finally:
            watch.stop()

    asyncio.run(scenario())
