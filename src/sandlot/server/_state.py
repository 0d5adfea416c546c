"""The server's state and the per-request dependencies every router shares.

:class:`ServerState` (settings, store, sandbox manager, metrics, worker threads) hangs on
the app; :func:`state_of` finds it from a request and :func:`authenticate` turns the
request's API key into a :class:`~sandlot.server._store.Principal`. They live apart from
``_app`` so the routers (``_routes``, ``_e2b``) depend on them and ``_app`` depends on
the routers, never the other way round.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, ParamSpec, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import exc as sa_exc
from starlette.requests import HTTPConnection

from sandlot.safetext import escape
from sandlot.server._manager import ApiError, SandboxManager
from sandlot.server._metrics import Metrics
from sandlot.server._settings import ServerSettings
from sandlot.server._store import Principal, Store

log = logging.getLogger("sandlot.server")

P = ParamSpec("P")
T = TypeVar("T")

bearer = HTTPBearer(
    auto_error=False,
    description="An API key from `sandlot keys create --tenant NAME` "
    "(also accepted as `X-API-Key`, or as the password of HTTP Basic auth).",
)


@dataclass
class ServerState:
    settings: ServerSettings
    store: Store
    manager: SandboxManager
    metrics: Metrics
    executor: ThreadPoolExecutor

    async def blocking(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking sandbox or database call in the server's worker threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(function, *args, **kwargs)
        )


async def principal_for(state: ServerState, key: str) -> Principal | None:
    """Check an API key against the key store (on every request: a revoked key is
    refused from the next request on). On SQLite the lookup runs in place (tens of
    microseconds, less than a hop to a worker thread); elsewhere in a worker thread.

    A store that cannot be reached (PostgreSQL down, SQLite locked past its busy
    timeout) is :class:`ApiError` 503 ``StoreUnavailable``: every route answers it
    typed, and the client may retry."""
    try:
        if state.store.embedded:
            return state.store.authenticate(key)
        return await state.blocking(state.store.authenticate, key)
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sqlite3.OperationalError) as exc:
        log.warning("the key store is unavailable: %s", escape(exc, 512))
        raise ApiError(
            503,
            "StoreUnavailable",
            "the server's key store is unavailable; try again shortly",
        ) from None


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.sandlot
    return state


def api_key_of(request: HTTPConnection) -> str | None:
    """The key from ``Authorization: Bearer``, ``X-API-Key`` or Basic auth (user or password)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if scheme.lower() == "basic" and value.strip():
        # Lets a client put the key in its URL (http://sandlot:KEY@host/...), which is how
        # the E2B client, configured only by E2B_SANDBOX_URL, can authenticate.
        try:
            user, _, password = base64.b64decode(value.strip()).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or user or None
    return request.headers.get("x-api-key") or None


def key_refused(state: ServerState, key: str | None) -> str:
    """Count a request refused for its key and say why (no key, or not a live one)."""
    state.metrics.requests_rejected.labels("auth").inc()
    if key is None:
        return "a valid API key is required (Authorization: Bearer KEY)"
    return "invalid or revoked API key"


async def authenticate(
    request: Request,
    # Declares the scheme in the OpenAPI document; the key is read by api_key_of.
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None,
) -> Principal:
    state = state_of(request)
    key = api_key_of(request)
    principal = await principal_for(state, key) if key else None
    if principal is None:
        raise ApiError(401, "AuthenticationError", key_refused(state, key))
    return principal
