"""The ASGI app: state, authentication, body limits, error mapping, lifespan (reaper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import sandlot
from sandlot.safetext import escape
from sandlot.server._e2b import e2b_routers
from sandlot.server._e2b_control import WireRegistry, control_router
from sandlot.server._e2b_plane import E2bWire, connect_unavailable, plane_app
from sandlot.server._manager import ApiError, SandboxManager
from sandlot.server._metrics import Metrics
from sandlot.server._routes import router
from sandlot.server._settings import ServerSettings
from sandlot.server._shortcut import ExecuteShortcut
from sandlot.server._state import ServerState, authenticate, state_of
from sandlot.server._store import Principal, Store

log = logging.getLogger("sandlot.server")

_STATUS: tuple[tuple[type[sandlot.SandlotError], int], ...] = (
    # First match wins: subclasses before their parents.
    (sandlot.NotFoundError, 404),
    (sandlot.ContextNotFoundError, 404),
    (sandlot.ProcessNotFoundError, 404),
    (sandlot.ProcessLimitError, 409),
    (sandlot.SandboxClosed, 404),
    (sandlot.InvalidArgumentError, 400),
    (sandlot.PolicyError, 400),
    (sandlot.FileOperationError, 400),
    (sandlot.TemplateError, 400),
    (sandlot.QuotaExceeded, 429),
    (sandlot.AuthenticationError, 401),
    # A sandbox that cannot be paused, snapshotted or forked (not started so, a call
    # running in it): the request's, not the server's, unless CRIU failed (it says).
    (sandlot.CheckpointError, 400),
    (sandlot.BackendError, 503),
    (sandlot.SandboxLost, 503),
)


def status_of(exc: sandlot.SandlotError) -> int:
    """The HTTP status a sandlot exception is answered with (500: not the client's)."""
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)


def _error(status: int, type_: str, message: str, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="sandlot"'} if status == 401 else None
    return JSONResponse(
        {"type": type_, "message": message, **extra}, status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.type, exc.message)

    @app.exception_handler(sandlot.SandlotError)
    async def sandlot_error(request: Request, exc: sandlot.SandlotError) -> JSONResponse:
        entry = getattr(request.state, "sandbox", None)
        if (
            isinstance(exc, sandlot.SandboxLost | sandlot.SandboxClosed)
            and entry is not None
            and not state_of(request).manager.registered(entry)
        ):
            # Killed (or expired) while this request was using it: the client's race.
            return _error(404, "SandboxNotFound", f"sandbox {entry.sandbox_id!r} was killed")
        status = status_of(exc)
        if status == 500:
            # The message may quote what a sandbox sent: escaped, one line, capped.
            log.error("unexpected %s: %s", type(exc).__name__, escape(exc, 1024))
        return _error(status, type(exc).__name__, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        state_of(request).metrics.requests_rejected.labels("invalid").inc()
        details = [
            {"loc": list(item.get("loc", ())), "msg": item.get("msg", ""), "type": item.get("type")}
            for item in exc.errors()
        ]
        summary = "; ".join(
            f"{'.'.join(str(part) for part in d['loc'])}: {d['msg']}" for d in details
        )
        return _error(422, "ValidationError", f"invalid request: {summary}", detail=details)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "ServerError", "internal server error")


class BodyLimit:
    """Refuses request bodies over a size limit with 413, before they are buffered.

    Uploads (``POST .../files``) may be up to ``max_upload_bytes``; everything else is
    JSON and may be up to ``max_body_bytes``. Counted as the body arrives, so a
    chunked body without ``Content-Length`` is caught too.
    """

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].endswith("/files")
        limit = self.settings.max_upload_bytes if upload else self.settings.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit + 1
                if declared > limit:
                    await _send_json(send, 413, _too_large(limit))
                    return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ApiError(413, "InvalidArgumentError", _too_large(limit)["message"])
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int) -> dict[str, str]:
    return {
        "type": "InvalidArgumentError",
        "message": f"request body larger than this server accepts ({limit} bytes)",
    }


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": data})


def create_app(
    settings: ServerSettings | None = None, *, recover: bool = True, store: Store | None = None
) -> FastAPI:
    """Build the server's ASGI app. Opens the database and, unless ``recover=False``
    (e.g. only to print the OpenAPI document), cleans up after a crash now; the reaper
    runs while the app's lifespan does. ``store``: a store opened by the caller (a
    cluster node's, which scopes crash recovery to its own sandboxes) instead of one
    opened from ``settings``; the app closes it at the end of its lifespan."""
    settings = settings or ServerSettings()
    store = store or Store(
        settings.resolved_database_url,
        audit_max_age=settings.audit_max_age,
        audit_max_rows=settings.audit_max_rows,
        audit_sync=settings.audit_sync,
    )
    metrics = Metrics()
    manager = SandboxManager(settings, store)
    if recover:
        manager.recover()
        _prune(store)
    manager.on_change.append(metrics.sandboxes_live.set)
    metrics.watch_pool(lambda: None if manager.pool is None else manager.pool.stats())
    metrics.watch_calls(manager.calls_in_progress)

    def count_end(reason: str) -> None:
        if reason in _ENDED:
            metrics.sandboxes_ended.labels(_ENDED[reason]).inc()

    manager.on_end.append(count_end)
    state = ServerState(
        settings=settings,
        store=store,
        manager=manager,
        metrics=metrics,
        executor=ThreadPoolExecutor(settings.worker_threads, thread_name_prefix="sandlot-api"),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.blocking(manager.warm_pool)  # after recover(): orphans are gone
        reaper = asyncio.create_task(_reap_forever(state))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            if not manager.closing:
                await asyncio.to_thread(manager.drain, 0.0)
            state.executor.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(manager.egress.close)  # writes the last egress records
            store.close()

    app = FastAPI(
        title="sandlot",
        version=sandlot.__version__,
        description="Run untrusted, LLM-generated Python in OS sandboxes. E2B-shaped: "
        "cells stream as NDJSON with E2B's message types; `/e2b` serves the unmodified "
        "`e2b_code_interpreter` client (see docs/server.md).",
        lifespan=lifespan,
        openapi_url=None,  # served below, behind the API key like everything but /health
        docs_url=None,
        redoc_url=None,
    )
    app.state.sandlot = state
    install_error_handlers(app)
    # E2B's wire: requests naming a sandbox in E2B's headers go to the sandbox plane
    # (inside BodyLimit, which therefore bounds their bodies too).
    registry = WireRegistry()
    app.state.e2b_wire = registry
    # The cell call on a short path (inside E2bWire: it sees no request for E2B's wire).
    app.add_middleware(ExecuteShortcut, state=state, send_json=_send_json, status_of=status_of)
    app.add_middleware(
        E2bWire,
        state=state,
        registry=registry,
        plane=plane_app(_STATUS),
        connect=_connect_apps(settings.max_body_bytes),
    )
    app.add_middleware(BodyLimit, settings=settings)
    # The web app (/ui); its gateway goes outermost, so what it forwards to /v1 meets
    # every check above.
    from sandlot.server._ui import install_ui

    install_ui(app)
    app.include_router(router)
    app.include_router(control_router(_STATUS))
    for e2b_router in e2b_routers():
        app.include_router(e2b_router)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(principal: Annotated[Principal, Depends(authenticate)]) -> JSONResponse:
        return JSONResponse(app.openapi())

    return app


def _connect_apps(read_max_bytes: int) -> Callable[[str], ASGIApp | None]:
    """envd's Connect services, served with the stubs of the ``e2b`` package; without
    it (an install without the server extra) their paths answer 501 saying so."""
    try:
        from sandlot.server import _e2b_envd
    except ImportError as exc:
        return connect_unavailable(str(exc))
    return _e2b_envd.apps(read_max_bytes)


_ENDED = {"killed": "killed", "idle": "reaped", "expired": "reaped"}
"""Sandbox end reasons -> the ``sandlot_sandboxes_ended`` label they count under."""


async def _reap_forever(state: ServerState) -> None:
    pruned = time.monotonic()
    while True:
        await asyncio.sleep(state.settings.reap_interval)
        if time.monotonic() - pruned >= state.settings.audit_prune_interval:
            pruned = time.monotonic()
            await state.blocking(_prune, state.store)
        try:
            reaped = await state.blocking(state.manager.reap)
            await state.blocking(state.manager.warm_pool)
        except Exception:
            log.exception("reaper failed")
            continue
        if reaped:
            log.info("reaped %d sandbox(es)", len(reaped))


def _prune(store: Store) -> None:
    """Apply the audit trail's retention (age and row caps); log what it deleted."""
    try:
        deleted = store.prune()
    except Exception:
        log.exception("could not apply the audit retention")
        return
    if any(deleted.values()):
        log.info("audit retention: deleted %s", deleted)
