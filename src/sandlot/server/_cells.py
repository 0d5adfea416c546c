"""Running a cell for an HTTP client: audit rows, metrics, and the NDJSON message stream.

The stream uses E2B's message types, so the unmodified ``e2b_code_interpreter``
client parses it, with sandlot's extras in ``end_of_execution`` (status, duration,
truncation, the final error) that the SDK's remote mode uses to rebuild the very
``Execution`` local mode returns::

    {"type": "stdout", "text": "hi\\n", "timestamp": 1732262400000000000}
    {"type": "result", "text": "42", "is_main_result": true}
    {"type": "error", "name": "ZeroDivisionError", "value": "...", "traceback": "..."}
    {"type": "number_of_executions", "execution_count": 3}
    {"type": "end_of_execution", "status": "ok", "duration": 0.01, ...}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple, Protocol

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sandlot import Execution, ExecutionError, OutputMessage, Result, SandlotError, stream_only
from sandlot.server._manager import RunningCell, SandboxManager
from sandlot.server._metrics import Metrics
from sandlot.server._store import Principal, Store

log = logging.getLogger("sandlot.server")


class Push(Protocol):
    """Hands a stream a message; ``None`` ends the stream. ``last=True``: this message
    ends it too, delivered with the end in one step (the client has the whole
    response at once, not the message and then, a moment later, the end).
    ``more=True``: another push follows at once; this message waits for it and goes
    with it (the caller must make that push)."""

    def __call__(
        self, item: dict[str, Any] | None, /, *, last: bool = False, more: bool = False
    ) -> None: ...


OUTCOME = {
    "ok": "ok",
    "error": "error",
    "timeout": "timeout",
    "oom": "oom",
    "interrupted": "killed",
    "died": "killed",
}
"""``Execution.status`` -> audit outcome."""


def result_message(result: Result) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "result", "is_main_result": result.is_main_result}
    for name in ("text", *(name for name in result.formats() if name not in result.extra)):
        value = getattr(result, name)
        if value is not None:
            message[name] = value
    if result.extra:
        message["extra"] = result.extra
    return message


def error_dict(error: ExecutionError | None) -> dict[str, str] | None:
    if error is None:
        return None
    return {"name": error.name, "value": error.value, "traceback": error.traceback}


def jsonable(value: Any) -> Any:
    """Best effort: a dataclass, an object with ``to_dict()``, or plain JSON data."""
    if value is None:
        return None
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def exception_message(exc: SandlotError) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)}


class CellRunner:
    """Runs one cell in a worker thread, streaming messages and writing the audit row."""

    def __init__(
        self,
        *,
        manager: SandboxManager,
        store: Store,
        metrics: Metrics,
        keep_code: bool,
        principal: Principal,
        cell: RunningCell,
        code: str,
        envs: Mapping[str, str] | None,
        timeout: float,
        adapt_result: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.adapt_result = adapt_result
        self.manager = manager
        self.store = store
        self.metrics = metrics
        self.keep_code = keep_code
        self.principal = principal
        self.cell = cell
        self.code = code
        self.envs = envs
        self.timeout = timeout

    def skip(self) -> None:
        """Its client left while the cell waited for a worker thread: it never runs
        (and has no audit row: nothing ran)."""
        log.debug("cell %s skipped: its client left before it started", self.cell.execution_id)
        self.manager.end_cell(self.cell)

    def __call__(self, push: Push) -> None:
        cell, entry = self.cell, self.cell.entry
        sizes = {"stdout_bytes": 0, "stderr_bytes": 0, "result_count": 0, "result_bytes": 0}

        def on_output(message: OutputMessage) -> None:
            kind = "stderr" if message.error else "stdout"
            sizes[f"{kind}_bytes"] += len(message.line.encode("utf-8", "replace"))
            push({"type": kind, "text": message.line, "timestamp": message.timestamp})

        # The cell's main result (its last expression's value) comes just before its
        # end, as the runner sends it: held to go out with the end (one write, one
        # wake-up of the client) rather than alone a moment before it.
        held: list[dict[str, Any]] = []

        def on_result(result: Result) -> None:
            message = result_message(result)
            if self.adapt_result is not None:
                message = self.adapt_result(message)
            sizes["result_count"] += 1
            sizes["result_bytes"] += len(json.dumps(message))
            if result.is_main_result and not held:
                held.append(message)
                return
            push(message)

        def with_held(*ending: dict[str, Any]) -> None:
            """Push what was held, then ``ending``, the stream's last messages, together."""
            for message in (*held, *ending[:-1]):
                push(message, more=True)
            held.clear()
            push(ending[-1], last=True)

        def on_error(error: ExecutionError) -> None:
            push({"type": "error", **(error_dict(error) or {})})

        # Everything is forwarded to the client as it comes; the Execution keeps only
        # the outcome, so a cell's cost to the server does not grow with its output.
        forward_output, forward_result = stream_only(on_output), stream_only(on_result)
        self.manager.touch(entry, +1)
        try:
            self.store.execution_started(
                execution_id=cell.execution_id,
                principal=self.principal,
                sandbox_id=entry.sandbox_id,
                context=cell.context,
                code=self.code,
                keep_code=self.keep_code,
            )
            # DEBUG: the audit row is the record of a cell's start; a log line per cell
            # at INFO cost about a tenth of a `1+1` cell's time on the server.
            log.debug(
                "cell %s started on sandbox %s (tenant %s, %d bytes of code)",
                cell.execution_id,
                entry.sandbox_id,
                self.principal.tenant,
                len(self.code),
            )
            try:
                execution = entry.sandbox.run_code(
                    self.code,
                    context=cell.context,
                    envs=self.envs,
                    timeout=self.timeout,
                    on_stdout=forward_output,
                    on_stderr=forward_output,
                    on_result=forward_result,
                    on_error=on_error,
                )
            except SandlotError as exc:
                # E.g. the sandbox was killed meanwhile: the client gets the error typed.
                self.store.execution_finished(
                    cell.execution_id,
                    {"outcome": "killed", "status": "died", "error_name": type(exc).__name__},
                )
                self.metrics.executions.labels("killed").inc()
                with_held({"type": "end_of_execution", "exception": exception_message(exc)})
                return
            self._finish(execution, sizes, with_held)
        except Exception:
            log.exception("cell %s failed in the server", cell.execution_id)
            with_held(
                {
                    "type": "end_of_execution",
                    "exception": {"type": "ServerError", "message": "internal server error"},
                }
            )
        finally:
            self.manager.touch(entry, -1)
            self.manager.end_cell(cell)
            push(None)

    def _finish(
        self,
        execution: Execution,
        sizes: dict[str, int],
        with_held: Callable[..., None],
    ) -> None:
        cell = self.cell
        outcome = OUTCOME.get(execution.status, "killed")
        precheck = jsonable(getattr(execution, "precheck", None))
        usage = jsonable(getattr(execution, "usage", None))
        self.store.execution_finished(
            cell.execution_id,
            {
                "outcome": outcome,
                "status": execution.status,
                "duration": execution.duration,
                "error_name": execution.error.name if execution.error else None,
                "truncated": execution.truncated,
                "precheck": precheck,
                "usage": usage,
                **sizes,
            },
        )
        count = (
            ()
            if execution.execution_count is None
            else ({"type": "number_of_executions", "execution_count": execution.execution_count},)
        )
        with_held(
            *count,
            {
                "type": "end_of_execution",
                "execution_id": cell.execution_id,
                "status": execution.status,
                "duration": execution.duration,
                "truncated": execution.truncated,
                "error": error_dict(execution.error),
                "precheck": precheck,
                "usage": usage,
                "network": None
                if execution.network is None
                else [event.to_dict() for event in execution.network],
            },
        )
        # After the end went out (its audit row was written before): the client does
        # not wait for the bookkeeping.
        self.metrics.executions.labels(outcome).inc()
        self.metrics.execution_seconds.observe(execution.duration)
        # A cell that ran its course (ok or its own error) at DEBUG, as its start: the
        # audit row records it, and this thread would otherwise hold the interpreter
        # for the line while the event loop sends the cell's end. The others (a
        # timeout, memory, an interruption) stay at INFO.
        log.log(
            logging.DEBUG if outcome in ("ok", "error") else logging.INFO,
            "cell %s ended: %s in %.3f s%s",
            cell.execution_id,
            outcome,
            execution.duration,
            f" (interrupted: {cell.interrupted_by})" if cell.interrupted_by else "",
        )


QUEUE_BYTES = 8 * 1024 * 1024
"""Bytes of a stream's messages that may wait for a slow client; past it the cell's
worker waits (and with it the sandbox, see ``backends._channel.QUEUE_COST``)."""
BATCH_BYTES = 256 * 1024
"""Messages already waiting are sent together up to about this many bytes per chunk."""
STALL_SECONDS = 60.0
"""How long a client may leave the queue full before its cell is cut."""


def ndjson(
    work: Callable[[Push], None],
    executor: Executor,
    on_abandon: Callable[[], None],
    on_stall: Callable[[], None] | None = None,
    *,
    queue_bytes: int = QUEUE_BYTES,
    stall_seconds: float = STALL_SECONDS,
) -> AsyncIterator[bytes]:
    """Run ``work(push)`` in ``executor`` once the stream is first read, and yield what
    it pushes, one JSON line each.

    ``push(None)`` ends the stream. If the stream is abandoned first (the client
    disconnected, or the server is cancelling the request), ``on_abandon`` runs in a
    thread of its own: the generator cannot await anything once it is cancelled.

    The messages waiting for the client are bounded: ``push`` blocks while more than
    ``queue_bytes`` wait. A client that takes nothing for ``stall_seconds`` while the
    queue is full gets a last ``error`` message (``ClientTooSlow``), everything after
    it is dropped, and ``on_stall`` (default ``on_abandon``) runs to cut the work short.
    """
    return _ndjson(
        work,
        executor,
        on_abandon,
        on_stall,
        queue_bytes=queue_bytes,
        stall_seconds=stall_seconds,
    ).chunks


class EagerNdjson(StreamingResponse):
    """An NDJSON response whose work starts now, while the response is still being
    made and its headers sent (a cell's first message is then often ready when the
    stream is first read). As :func:`ndjson` otherwise; a response that ends without
    ever reading its stream (the client left before its headers went out) abandons the
    work as a disconnect does. A response never sent at all (a server error between
    this and sending it) leaves the work to end on its own or to stall, as a client
    that reads nothing would."""

    def __init__(
        self,
        work: Callable[[Push], None],
        executor: Executor,
        on_abandon: Callable[[], None],
        on_stall: Callable[[], None] | None = None,
        *,
        stall_seconds: float = STALL_SECONDS,
        media_type: str = "application/x-ndjson",
    ) -> None:
        self._flow = _ndjson(
            work,
            executor,
            on_abandon,
            on_stall,
            queue_bytes=QUEUE_BYTES,
            stall_seconds=stall_seconds,
        )
        super().__init__(self._flow.chunks, media_type=media_type)
        self._flow.start()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._flow.unread()

    async def send_to(self, send: Send, *, before_end: Callable[[], None] | None = None) -> None:
        """Send the response, listening for nothing: for a caller that watches for the
        client's disconnect itself and cancels this when it comes.

        Unlike Starlette's way, the last chunk carries the body's end: one write, and
        one wake-up of the client, fewer. ``before_end`` runs before the last chunk
        goes; what it raises cuts the response there (its body stays unfinished)."""
        flow = self._flow
        chunks = flow.chunks
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            last = False
            async for chunk in chunks:
                last = flow.last
                if last and before_end is not None:
                    before_end()
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            flow.unread()
            await chunks.aclose()


class _Flow(NamedTuple):
    """What :func:`_ndjson` makes."""

    start: Callable[[], None]
    """Start the work (once; reading ``chunks`` starts it too)."""
    chunks: AsyncGenerator[bytes, None]
    unread: Callable[[], None]
    """Abandon the work if ``chunks`` was never read."""
    final: list[bool]
    """``[True]`` once the chunk ``chunks`` last yielded is the stream's last."""

    @property
    def last(self) -> bool:
        return self.final[0]


def _ndjson(
    work: Callable[[Push], None],
    executor: Executor,
    on_abandon: Callable[[], None],
    on_stall: Callable[[], None] | None,
    *,
    queue_bytes: int,
    stall_seconds: float,
) -> _Flow:
    """The machinery of :func:`ndjson`."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    final = [False]  # the chunk yielded last ends the stream
    room = threading.Condition()
    waiting = 0  # bytes queued for the client, guarded by room
    gone = False  # the client left: drop everything
    # Work that can be skipped (a cell: ``work.skip``) is, if its client left while it
    # waited for a worker thread; it is then never told it was abandoned either.
    skip: Callable[[], None] | None = getattr(work, "skip", None)
    running = False  # the work began (guarded by room)
    cut = False  # the client was too slow: drop everything after the notice

    # Messages on their way to the loop. One wake-up of the loop carries all that
    # gathered meanwhile: each wake-up is a write to the loop's self-pipe and a handover
    # of the GIL, about as dear as a message (a cell's last two, the execution count and
    # its end, often travel together).
    pending: list[bytes | None] = []
    scheduled = False
    handover = threading.Lock()

    def put() -> None:
        nonlocal scheduled
        with handover:
            items = pending.copy()
            pending.clear()
            scheduled = False
        for item in items:
            queue.put_nowait(item)

    def deliver(*items: bytes | None) -> None:
        nonlocal scheduled
        with handover:
            pending.extend(items)
            if scheduled:
                return
            scheduled = True
        # RuntimeError: the event loop is gone (server stopped); nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(put)

    ended = False  # the stream's end was delivered: nothing after it is

    def hold(data: bytes) -> None:
        """Queue ``data`` for the next delivery, waking nothing (see Push's ``more``)."""
        with handover:
            pending.append(data)

    def push(item: dict[str, Any] | None, /, *, last: bool = False, more: bool = False) -> None:
        nonlocal waiting, cut, ended
        if ended:
            # E.g. the work's closing push(None) after a last=True message: waking the
            # event loop for it would cost as much as a message, for nothing.
            return
        if item is None:
            ended = True
            deliver(None)
            return
        data = (json.dumps(item) + "\n").encode("utf-8")
        stalled = False
        with room:
            deadline = time.monotonic() + stall_seconds
            while not (gone or cut) and waiting and waiting + len(data) > queue_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    stalled = cut = True
                    break
                room.wait(left)
            if gone or (cut and not stalled):
                return
            if not stalled:
                waiting += len(data)
        if stalled:
            log.warning("a client took nothing for %g s; its stream is cut", stall_seconds)
            notice = {
                "type": "error",
                "name": "ClientTooSlow",
                "value": f"the client read nothing for {stall_seconds:g} s while "
                f"{queue_bytes} bytes waited for it; the rest of this stream was dropped",
                "traceback": "",
            }
            deliver((json.dumps(notice) + "\n").encode("utf-8"))
            threading.Thread(
                target=on_stall or on_abandon, name="sandlot-stall", daemon=True
            ).start()
            return
        if last:
            ended = True
            deliver(data, None)
        elif more:
            hold(data)
        else:
            deliver(data)

    def taken(size: int) -> None:
        nonlocal waiting
        with room:
            waiting -= size
            room.notify_all()

    def leave() -> bool:
        """The client left: whether the work is to be told (it began, or it cannot be
        skipped; else it will be skipped when a worker thread takes it)."""
        nonlocal gone
        with room:
            gone = True
            room.notify_all()
            return running or skip is None

    def job() -> None:
        nonlocal running
        with room:
            running = not (gone and skip is not None)
        if not running:
            assert skip is not None
            skip()
            return
        work(push)

    started = read = False

    def start() -> None:
        nonlocal started
        if not started:
            started = True
            # Not loop.run_in_executor: its future would wake the event loop once more
            # when the work returns, after the stream has already ended (push(None)).
            executor.submit(job).add_done_callback(_log_failure)

    def unread() -> None:
        if started and not read and leave():
            threading.Thread(target=on_abandon, name="sandlot-abandon", daemon=True).start()

    async def chunks() -> AsyncGenerator[bytes, None]:
        nonlocal read
        read = True
        start()
        finished = False
        try:
            async for chunk in _batches(queue, taken, final):
                yield chunk
            finished = True
        finally:
            if leave() and not finished:
                threading.Thread(target=on_abandon, name="sandlot-abandon", daemon=True).start()

    return _Flow(start, chunks(), unread, final)


def _log_failure(future: Future[None]) -> None:
    """A stream's work raised (a bug: a cell's work answers its own errors)."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("a stream's work failed", exc_info=exc)


async def _batches(
    queue: asyncio.Queue[bytes | None], taken: Callable[[int], None], final: list[bool]
) -> AsyncIterator[bytes]:
    """The queue's messages until its None; what else is already waiting goes out with
    each one, as one chunk: one write (and one read by the client) instead of one per
    message. ``final[0]`` is True while the chunk yielded is the last (its batch
    reached the None)."""
    while True:
        item = await queue.get()
        batch: list[bytes] = []
        size = 0
        while item is not None:
            batch.append(item)
            size += len(item)
            if size >= BATCH_BYTES or queue.empty():
                break
            item = queue.get_nowait()
        if batch:
            chunk = b"".join(batch)
            # Counted as taken once handed on: the server's own buffers downstream are
            # bounded by the transport's flow control.
            taken(len(chunk))
            final[0] = item is None
            yield chunk
        if item is None:
            return
