"""A cell on a short path: ``POST .../execute``, the call clients make most, served
without FastAPI's routing, dependency solving and response machinery.

Both cell routes take it: sandlot's ``POST /v1/sandboxes/{id}/execute``
(:class:`ExecuteShortcut`, an ASGI middleware) and E2B's ``POST /execute``
(:mod:`sandlot.server._e2b_plane`). Measured on loopback at ``1+1``, those layers were
about a third of a cell's time on the server.

Only a well-formed call stays on it. Anything else (no or a wrong API key, a sandbox
the caller may not use, a body that does not validate, a cell that ``execute``
refuses) is handed to the app with the body replayed, so its checks, answers and
metrics stay the app's, defined once. The one exception is a body over the server's
limit (:class:`sandlot.server._app.BodyLimit` raises while it is read): it cannot be
replayed, so it is answered here, in the caller's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot import SandlotError
from sandlot.server._cellsocket import serve_cells
from sandlot.server._manager import ApiError, ManagedSandbox
from sandlot.server._routes import Execute, execute
from sandlot.server._state import ServerState, api_key_of, principal_for
from sandlot.server._store import Principal
from sandlot.validate import DEFAULT_CELL_TIMEOUT

SendJson = Callable[[Send, int, dict[str, Any]], Awaitable[None]]


def posts_json(scope: Scope) -> bool:
    """A POST whose body says it is JSON (anything else: the app's answer)."""
    return scope["method"] == "POST" and any(
        name == b"content-type" and value.split(b";")[0].strip().lower() == b"application/json"
        for name, value in scope.get("headers", ())
    )


async def read_body(receive: Receive) -> bytes | None:
    """The request's whole body; None if the client left first. Raises the body limit's
    :class:`ApiError`."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for an app that reads a body already read: that body, then the
    connection's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def until_disconnect(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, *, body_read: bool = False
) -> None:
    """Run ``app``, cancelled if its client disconnects.

    An app that reads the request and then only writes (a cell, a Connect stream of a
    quiet command) would never notice its client is gone, and would hold the sandbox's
    lease (out of the idle reaper's reach) and a server thread until the work ended.
    Once the body is read (at once with ``body_read``: the caller has read it), this
    listens for ``http.disconnect`` as Starlette's streaming responses do."""
    read = asyncio.Event()
    if body_read:
        read.set()

    async def tracked() -> Message:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            read.set()
        return message

    async def disconnected() -> None:
        await read.wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    call = asyncio.ensure_future(app(scope, tracked, send))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((call, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not call.done():
            call.cancel()  # the client left (or this request is being cancelled)
        with contextlib.suppress(asyncio.CancelledError):
            await call
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def short_execute(
    state: ServerState,
    principal: Principal,
    entry: ManagedSandbox,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    error: Callable[[ApiError], tuple[int, dict[str, Any]]],
    send_json: SendJson,
    default_timeout: float = DEFAULT_CELL_TIMEOUT,
    adapt_result: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    before_end: Callable[[], None] | None = None,
) -> None:
    """Stream one cell on ``entry`` (leased by the caller), or hand the call to ``app``.

    ``error``: an over-limit body's answer in the caller's shape; ``before_end``: runs
    before the response's last chunk, and what it raises cuts the response (E2B cuts a
    killed sandbox's stream)."""
    try:
        body = await read_body(receive)
    except ApiError as exc:
        await send_json(send, *error(exc))
        return
    if body is None:
        return  # the client left before its body arrived
    try:
        cell = Execute.model_validate_json(body)
        response = await execute(state, principal, entry, cell, default_timeout, adapt_result)
    except Exception:  # answered by the app, whose checks raise it again
        await app(scope, replay(body, receive), send)
        return

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        await response.send_to(send, before_end=before_end)

    await until_disconnect(respond, scope, receive, send, body_read=True)


async def prefetched(
    receive: Receive,
    send: Send,
    send_json: SendJson,
    error: Callable[[ApiError], tuple[int, dict[str, Any]]],
) -> Receive | None:
    """Read the request's body now; ``receive`` replaying it, or None once answered
    (a body over the limit: ``error``'s answer) or the client left."""
    try:
        body = await read_body(receive)
    except ApiError as exc:
        await send_json(send, *error(exc))
        return None
    return None if body is None else replay(body, receive)


def _native_error(exc: ApiError) -> tuple[int, dict[str, Any]]:
    return exc.status, {"type": exc.type, "message": exc.message}


_NATIVE = re.compile(r"/v1/sandboxes/([^/]+)/execute")


_CELLS = re.compile(r"/v1/sandboxes/([^/]+)/cells")


class ExecuteShortcut:
    """ASGI middleware: ``POST /v1/sandboxes/{id}/execute`` on the short path when its
    caller's key is valid and the sandbox is the caller's; every other request, and
    every refusal, goes to the app. Also serves ``/v1/sandboxes/{id}/cells``, the
    WebSocket the remote SDK sends a sandbox's cells on (:mod:`._cellsocket`).

    ``status_of``: the HTTP status the app answers a :class:`SandlotError` with."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        send_json: SendJson,
        status_of: Callable[[SandlotError], int],
    ) -> None:
        self.app = app
        self.state = state
        self.send_json = send_json
        self.status_of = status_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            cells = _CELLS.fullmatch(scope["path"])
            if cells is None:
                await self.app(scope, receive, send)
                return
            await serve_cells(self.state, cells.group(1), scope, receive, send, self.status_of)
            return
        named = _NATIVE.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if named is None or not posts_json(scope):
            await self.app(scope, receive, send)
            return
        state = self.state
        key = api_key_of(Request(scope))
        try:
            principal = await principal_for(state, key) if key else None
        except ApiError as exc:  # the key store is down
            await self.send_json(send, *_native_error(exc))
            return
        if principal is None:
            await self.app(scope, receive, send)  # the app's 401, counted as ever
            return
        # The body before the lease: a lease keeps the idle reaper off the sandbox, and
        # a client that sent its headers and then nothing must not hold it meanwhile.
        replayed = await prefetched(receive, send, self.send_json, _native_error)
        if replayed is None:
            return
        receive = replayed
        entry: ManagedSandbox | None = None
        with contextlib.suppress(Exception):  # the app's answer, below
            entry = state.manager.lease(principal, named.group(1))
        if entry is None:
            await self.app(scope, receive, send)  # the app's 404, counted as ever
            return
        try:
            await short_execute(
                state,
                principal,
                entry,
                self.app,
                scope,
                receive,
                send,
                error=_native_error,
                send_json=self.send_json,
            )
        finally:
            state.manager.release(entry)
