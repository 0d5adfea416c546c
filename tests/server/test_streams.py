"""The NDJSON streams the server sends cells and commands in (``sandlot.server._cells``),
driven as the ASGI server drives a response."""

from __future__ import annotations

import asyncio
import contextlib
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


def test_send_to_ends_the_body_with_its_last_chunk() -> None:
    """The short cell path's ``send_to``: the chunk that carries the stream's end also
    ends the HTTP body (one write, not the chunk and then an empty end)."""

    def work(push: Push) -> None:
        push({"type": "stdout", "text": "a"})
        push({"type": "end_of_execution"}, last=True)

    async def main() -> list[Message]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        with ThreadPoolExecutor(1) as pool:
            await EagerNdjson(work, pool, lambda: None).send_to(send)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start"
    bodies = sent[1:]
    assert all(m["more_body"] for m in bodies[:-1])
    assert bodies[-1]["more_body"] is False
    assert bodies[-1]["body"].endswith(b'{"type": "end_of_execution"}\n')
    assert b"".join(m["body"] for m in bodies).count(b"\n") == 2


def test_send_to_cuts_the_body_where_before_end_raises() -> None:
    """E2B ends a killed sandbox's stream by dropping the connection: ``before_end``
    raising keeps the last chunk (and the body's end) from going out."""

    def work(push: Push) -> None:
        push({"type": "end_of_execution"}, last=True)

    def killed() -> None:
        raise LookupError("killed")

    async def main() -> list[Message]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        with ThreadPoolExecutor(1) as pool, pytest.raises(LookupError):
            await EagerNdjson(work, pool, lambda: None).send_to(send, before_end=killed)
        return sent

    assert [m["type"] for m in asyncio.run(main())] == ["http.response.start"]


def test_a_cell_queued_behind_busy_workers_never_runs_once_its_client_has_left() -> None:
    """Every worker thread busy, a cell waits in the executor's queue; its client leaves
    meanwhile. The cell must not run then (for nobody: a client could queue cells and
    leave, and the server would run them all), nor its abandonment interrupt the
    sandbox (what runs there then is another cell); its ``skip`` runs instead."""
    busy = threading.Event()
    ran = threading.Event()
    skipped = threading.Event()
    abandoned = threading.Event()

    class Cell:
        def __call__(self, push: Push) -> None:
            ran.set()
            push(None)

        def skip(self) -> None:
            skipped.set()

    async def main() -> None:
        headers = asyncio.Event()

        async def send(message: Message) -> None:
            headers.set()

        with ThreadPoolExecutor(1) as pool:
            pool.submit(busy.wait, 30)  # the only worker is taken
            response = EagerNdjson(Cell(), pool, abandoned.set)
            sending = asyncio.ensure_future(response.send_to(send))
            await headers.wait()  # the response waits for the cell's first message
            sending.cancel()  # the client left
            with contextlib.suppress(asyncio.CancelledError):
                await sending
            busy.set()
        # The pool is shut down: the queued job has been taken and has returned.

    asyncio.run(main())
    assert not ran.is_set()
    assert skipped.is_set()
    assert not abandoned.is_set()
