"""Cells over one WebSocket per sandbox: ``GET /v1/sandboxes/{id}/cells`` (an upgrade).

The remote SDK opens one at a sandbox's second cell and sends every later cell on it,
which saves an HTTP request and response per cell (on loopback, about half of a
``1+1`` cell's time over HTTP). The protocol, text frames of JSON::

    client: {"type": "execute", "code": "1+1", "context_id": ..., "env_vars": ..., "timeout": ...}
    server: the cell's stream, as ``POST .../execute`` sends it: one or more NDJSON
            lines per frame, ending with ``end_of_execution``
    server: {"type": "refused", "status": 401, "error": {"type": ..., "message": ...}}
            instead, when the cell is refused before it starts (``status`` is what the
            HTTP route would have answered)

One cell at a time: the client sends the next once the previous one's
``end_of_execution`` has arrived; a message sent during a cell breaks the protocol
and ends the connection (the cell is interrupted, as a disconnect interrupts it).

Every cell is checked as its HTTP request is, each time: the API key (a key revoked
while a connection is open is refused from its next cell on), the sandbox's tenant,
the message's size (the server's request body limit) and shape, the cell's limits.
The handshake is checked the same way and refused with the HTTP route's status and
JSON error. A cell's audit row, metrics, interruption when its client disconnects and
cut when its client reads too slowly are the HTTP route's (:mod:`sandlot.server._cells`):
what waits for a slow reader is bounded by the same queue, and the ASGI server's
flow control stops writes to a client that does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, Literal

import pydantic
from starlette.requests import HTTPConnection
from starlette.types import Message, Receive, Scope, Send

from sandlot import SandlotError
from sandlot.server._cells import QUEUE_BYTES, CellRunner, _ndjson
from sandlot.server._manager import ApiError
from sandlot.server._routes import Execute, cell_runner
from sandlot.server._state import ServerState, api_key_of, key_refused, principal_for
from sandlot.server._store import Principal
from sandlot.server._ui_session import origin_problem

log = logging.getLogger("sandlot.server")

IDLE_SECONDS = 60.0
"""A connection with no cell for this long is closed (1001): idle connections do not
pile up (a sandbox that ended meanwhile included). The SDK opens a new one for its
next cell; it replaces its own after ``sandlot._remote.SOCKET_IDLE`` (10 s) anyway."""

CLOSE_POLICY = 1008
"""WebSocket close code: the key or the sandbox is no longer good for this connection,
or the client broke the protocol."""


class Refused(Exception):
    """A cell (or the handshake) refused with the HTTP route's status and error."""

    def __init__(self, status: int, type_: str, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.final = final  # the connection ends with it

    def body(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message}


async def serve_cells(
    state: ServerState,
    sandbox_id: str,
    scope: Scope,
    receive: Receive,
    send: Send,
    status_of: Callable[[SandlotError], int],
) -> None:
    """Serve one WebSocket connection's cells on ``sandbox_id`` until the client leaves,
    the key or the sandbox stops being good, or the client breaks the protocol."""
    if (await receive())["type"] != "websocket.connect":
        return
    # A browser opens WebSockets across origins and attaches what it holds for the
    # server (cached Basic credentials, say): a page elsewhere must not drive cells
    # here. Browsers always send Origin on a WebSocket handshake; SDK clients send none.
    problem = origin_problem(dict(scope["headers"]))
    if problem:
        await _deny(scope, send, Refused(403, "CsrfError", problem))
        return
    key = api_key_of(HTTPConnection(scope))
    try:
        principal = await _principal(state, key)
        state.manager.get(principal, sandbox_id)  # the tenant's, and live: else 404
    except Refused as exc:
        await _deny(scope, send, exc)
        return
    except ApiError as exc:
        await _deny(scope, send, Refused(exc.status, exc.type, exc.message))
        return
    await send({"type": "websocket.accept"})
    # The next message, always being waited for: during a cell, what says the client
    # left (or broke the protocol); between cells, the next cell. One task for both
    # saves making and cancelling one per cell.
    listening = asyncio.ensure_future(receive())
    idle = _IdleWatch(lambda: listening)
    try:
        while True:
            try:
                message = await listening
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not idle.expired or (task is not None and task.cancelling()):
                    raise
                await send({"type": "websocket.close", "code": 1001})
                return
            if message["type"] != "websocket.receive":
                return  # websocket.disconnect
            listening = asyncio.ensure_future(receive())
            idle.busy = True
            try:
                runner = await _admit(state, key, sandbox_id, message, status_of)
            except Refused as exc:
                await _send_refusal(send, exc)
                if exc.final:
                    await send({"type": "websocket.close", "code": CLOSE_POLICY})
                    return
                idle.rest()
                continue
            try:
                ended = await _stream(state, runner, listening, send)
            finally:
                state.manager.release(runner.cell.entry)
            if not ended:
                return
            idle.rest()
    finally:
        idle.stop()
        if not listening.done():
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening


class _IdleWatch:
    """Closes a connection that has had no cell for :data:`IDLE_SECONDS`: one timer per
    connection, re-armed when it fires early, rather than a timeout made and cancelled
    around every wait for a message (a timer handle and a loop pass per cell).

    When it expires it cancels the connection's wait for its next message (``current``
    names it) and sets :attr:`expired`, which tells that cancellation from any other."""

    def __init__(self, current: Callable[[], asyncio.Future[Message]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._current = current
        self.busy = False  # a cell is being admitted or run: never idle meanwhile
        self.expired = False
        self._since = self._loop.time()
        self._timer = self._loop.call_later(IDLE_SECONDS, self._fire)

    def rest(self) -> None:
        """A cell ended (or was refused): the connection is idle from now."""
        self.busy = False
        self._since = self._loop.time()

    def stop(self) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        left = self._since + IDLE_SECONDS - self._loop.time()
        waiting = self._current()
        if self.busy or waiting.done() or left > 0:
            # (done: a message came and is about to be taken as a cell)
            self._timer = self._loop.call_later(left if left > 0 else IDLE_SECONDS, self._fire)
            return
        self.expired = True
        waiting.cancel()


async def _principal(state: ServerState, key: str | None) -> Principal:
    try:
        principal = await principal_for(state, key) if key else None
    except ApiError as exc:  # the key store is down
        raise Refused(exc.status, exc.type, exc.message, final=True) from None
    if principal is None:
        raise Refused(401, "AuthenticationError", key_refused(state, key), final=True)
    return principal


async def _admit(
    state: ServerState,
    key: str | None,
    sandbox_id: str,
    message: Message,
    status_of: Callable[[SandlotError], int],
) -> CellRunner:
    """The cell a message asks for, checked as ``POST .../execute`` checks it and
    registered, its sandbox leased (released by the caller once the cell's stream has
    ended); or :class:`Refused`."""
    body = _parse(state, message)
    principal = await _principal(state, key)  # again: a key revoked since is refused now
    try:
        entry = state.manager.lease(principal, sandbox_id)
    except ApiError as exc:  # another tenant's, killed, reaped or expired since
        raise Refused(exc.status, exc.type, exc.message, final=True) from None
    try:
        return cell_runner(state, principal, entry, body)
    except ApiError as exc:  # e.g. shutting down
        state.manager.release(entry)
        raise Refused(exc.status, exc.type, exc.message) from None
    except SandlotError as exc:  # the cell's arguments (timeout ceiling, envs, text)
        state.manager.release(entry)
        raise Refused(status_of(exc), type(exc).__name__, str(exc)) from None
    except BaseException:
        state.manager.release(entry)
        raise


class _CellRequest(Execute):
    """A cell request frame as a whole: :class:`Execute` and its ``type``."""

    type: Literal["execute"]


def _parse(state: ServerState, message: Message) -> Execute:
    """A message's cell request, within the server's body limit; else :class:`Refused`
    (a frame that is not JSON, not a cell request, or not a valid one)."""
    text = message.get("text")
    if not isinstance(text, str):
        state.metrics.requests_rejected.labels("invalid").inc()
        raise Refused(400, "InvalidArgumentError", "cells are sent as text frames of JSON")
    limit = state.settings.max_body_bytes
    # A character is at least one byte: only a text near the limit needs encoding.
    if len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
        state.metrics.requests_rejected.labels("too_large").inc()
        raise Refused(
            413,
            "InvalidArgumentError",
            f"request body larger than this server accepts ({limit} bytes)",
        )
    # A well-formed request in one pass; anything else takes the checks below, which
    # tell what is wrong with it (the refusals are theirs).
    with contextlib.suppress(pydantic.ValidationError):
        return _CellRequest.model_validate_json(text)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (nested past the parser's limit)
        state.metrics.requests_rejected.labels("invalid").inc()
        raise Refused(422, "ValidationError", f"invalid request: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("type") != "execute":
        state.metrics.requests_rejected.labels("invalid").inc()
        raise Refused(
            400, "InvalidArgumentError", 'expected a cell request: {"type": "execute", ...}'
        )
    data.pop("type")
    try:
        return Execute.model_validate(data)
    except pydantic.ValidationError as exc:
        state.metrics.requests_rejected.labels("invalid").inc()
        summary = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
            for error in exc.errors()
        )
        raise Refused(422, "ValidationError", f"invalid request: {summary}") from None


async def _stream(
    state: ServerState, runner: CellRunner, listening: asyncio.Future[Message], send: Send
) -> bool:
    """Run the cell and send its stream; False if the connection ended meanwhile (the
    client left, or sent something mid-cell: ``listening``, the connection's next
    message, came first; the cell is interrupted either way)."""
    cell = runner.cell
    flow = _ndjson(
        runner,
        state.executor,
        lambda: state.manager.interrupt_cell(cell, "client disconnected"),
        lambda: state.manager.interrupt_cell(cell, "client too slow"),
        queue_bytes=QUEUE_BYTES,
        stall_seconds=state.settings.client_stall_timeout,
    )
    flow.start()
    stream = flow.chunks

    last = b""

    async def pump() -> None:
        nonlocal last
        try:
            async for chunk in stream:
                await send({"type": "websocket.send", "text": chunk.decode("utf-8")})
                last = chunk
        finally:
            # A failed send leaves the stream suspended: closing it now abandons the
            # cell (its finally interrupts it) rather than when it is collected.
            await stream.aclose()

    sending = asyncio.ensure_future(pump())
    try:
        await asyncio.wait((sending, listening), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not sending.done():
            sending.cancel()  # the client left (or this connection is being cancelled)
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await sending
    if sending.cancelled() or sending.exception() is not None:
        # The client left, or sent something before the cell's end (a client that had
        # the end may already have sent its next cell: that is no violation).
        violated = listening.done() and not listening.cancelled()
        if violated and listening.result()["type"] == "websocket.receive":
            log.warning("a client sent a message during its cell; its connection is closed")
            with contextlib.suppress(OSError):
                await send({"type": "websocket.close", "code": CLOSE_POLICY})
        return False  # the cell was abandoned (interrupted)
    if not last[last.rfind(b"\n", 0, -1) + 1 :].startswith(b'{"type": "end_of_execution"'):
        # Cut short (the client read too slowly): it waits for an end that will not
        # come, so the connection ends, as the HTTP response does.
        with contextlib.suppress(OSError):
            await send({"type": "websocket.close", "code": CLOSE_POLICY})
        return False
    return True


async def _send_refusal(send: Send, exc: Refused) -> None:
    frame = {"type": "refused", "status": exc.status, "error": exc.body()}
    await send({"type": "websocket.send", "text": json.dumps(frame) + "\n"})


async def _deny(scope: Scope, send: Send, exc: Refused) -> None:
    """Refuse the handshake with the HTTP route's status and JSON error where the ASGI
    server can send an HTTP response instead of the upgrade; else with a close (the
    client falls back to the HTTP route, which answers the error itself)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": CLOSE_POLICY})
        return
    data = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json")]
    if exc.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="sandlot"'))
    await send({"type": "websocket.http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": data})
