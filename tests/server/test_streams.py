"""The NDJSON streams the server sends cells and commands in (``sandlot.server._cells``),
driven as the ASGI server drives a response."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from starlette.types import Message

from sandlot.server._cells import EagerNdjson, Push

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}


async def _no_disconnect() -> Message:
    await asyncio.Event().wait()  # the client never leaves
    raise AssertionError("unreachable")


def test_a_cell_starts_before_its_response_is_sent() -> None:
    started = threading.Event()

    def work(push: Push) -> None:
        started.set()
        push(None)

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, lambda: None)
            # Nothing sent yet, and the work is under way.
            assert await asyncio.to_thread(started.wait, 10)
            sent: list[Message] = []

            async def send(message: Message) -> None:
                sent.append(message)

            await response(SCOPE, _no_disconnect, send)
            assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]

    asyncio.run(main())


def test_a_response_whose_client_left_before_the_headers_abandons_its_cell() -> None:
    """The stream is never read (sending the headers fails): the cell is abandoned as a
    disconnect abandons it, and what it pushes after is dropped, not queued."""
    abandoned = threading.Event()
    release = threading.Event()
    pushed_after: list[bool] = []

    def work(push: Push) -> None:
        release.wait(10)
        push({"type": "stdout", "text": "x" * 1000})
        pushed_after.append(True)
        push(None)

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, abandoned.set)

            async def send(message: Message) -> None:
                raise OSError("the client is gone")

            with pytest.raises(OSError):
                await response(SCOPE, _no_disconnect, send)
            assert await asyncio.to_thread(abandoned.wait, 10)
            release.set()

    asyncio.run(main())
    assert pushed_after == [True]  # the push returned at once: nobody reads, nothing waits


def test_messages_already_waiting_go_out_as_one_chunk() -> None:
    pushed = threading.Event()

    def work(push: Push) -> None:
        for n in range(5):
            push({"type": "stdout", "text": str(n)})
        pushed.set()
        push(None)

    async def main() -> list[bytes]:
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, lambda: None)
            # The loop runs the pushes' deliveries (FIFO) before this wait's own.
            assert await asyncio.to_thread(pushed.wait, 10)
            return [chunk async for chunk in response.body_iterator]  # type: ignore[misc]

    chunks = asyncio.run(main())
    lines = b"".join(chunks).splitlines()
    assert [json.loads(line)["text"] for line in lines] == ["0", "1", "2", "3", "4"]
    assert len(chunks) == 1


def test_a_last_message_ends_the_stream_with_it() -> None:
    """``push(message, last=True)``: the client has the whole response then, not when
    the work gets round to ``push(None)``."""
    streamed = threading.Event()

    def work(push: Push) -> None:
        push({"type": "end_of_execution"}, last=True)
        streamed.wait(10)  # still busy (bookkeeping) while the client reads
        push(None)

    async def main() -> list[bytes]:
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, lambda: None)
            try:
                return await asyncio.wait_for(_read(response), 10)
            finally:
                streamed.set()

    async def _read(response: EagerNdjson) -> list[bytes]:
        return [chunk async for chunk in response.body_iterator]  # type: ignore[misc]

    assert asyncio.run(main()) == [b'{"type": "end_of_execution"}\n']


def test_a_message_pushed_with_more_goes_with_the_next_one() -> None:
    """``push(message, more=True)``: no delivery of its own, even when the loop is idle
    and would take it at once; it goes out with the next push, in one chunk."""
    pushed = threading.Event()
    go_on = threading.Event()

    def work(push: Push) -> None:
        push({"type": "result", "text": "2"}, more=True)
        pushed.set()
        go_on.wait(10)
        push({"type": "end_of_execution"}, last=True)

    async def main() -> list[bytes]:
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, lambda: None)
            chunks = response.body_iterator
            first = asyncio.ensure_future(chunks.__anext__())  # type: ignore[attr-defined]
            assert await asyncio.to_thread(pushed.wait, 10)
            await asyncio.sleep(0.05)  # the loop is free: nothing came to it
            assert not first.done()
            go_on.set()
            return [await first, *[chunk async for chunk in chunks]]  # type: ignore[attr-defined]

    chunks = asyncio.run(main())
    assert chunks == [b'{"type": "result", "text": "2"}\n{"type": "end_of_execution"}\n']


def test_messages_pushed_while_the_loop_is_busy_wake_it_once() -> None:
    """Each wake-up of the event loop from the cell's thread costs a self-pipe write
    and a GIL handover: what is pushed before the loop gets round to it travels in one."""
    pushed = threading.Event()

    def work(push: Push) -> None:
        for n in range(5):
            push({"type": "stdout", "text": str(n)})
        push({"type": "end_of_execution"}, last=True)
        pushed.set()

    async def main() -> tuple[int, list[bytes]]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args: object, **kwargs: object) -> object:
            nonlocal wakeups
            wakeups += 1
            return call_soon_threadsafe(*args, **kwargs)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        with ThreadPoolExecutor(1) as pool:
            response = EagerNdjson(work, pool, lambda: None)
            assert pushed.wait(10)  # blocks the loop while every message is pushed
            chunks = [chunk async for chunk in response.body_iterator]  # type: ignore[misc]
        return wakeups, chunks

    wakeups, chunks = asyncio.run(main())
    lines = [json.loads(line) for line in b"".join(chunks).splitlines()]
    assert [m.get("text") for m in lines] == ["0", "1", "2", "3", "4", None]
    # One for the messages, one for the worker's future completing.
    assert wakeups <= 2, wakeups
