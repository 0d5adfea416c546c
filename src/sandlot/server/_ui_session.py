"""The web app's sign-in sessions and their checks (CSRF, origin), shared by its routes
(``_ui``, ``_ui_chat``): see ``_ui`` for how a browser is trusted."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request

from sandlot.server._manager import ApiError
from sandlot.server._state import principal_for, state_of
from sandlot.server._store import Principal

PREFIX = "/ui"
COOKIE = "sandlot_ui"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD"})

SESSION_IDLE = 8 * 3600.0
"""Seconds a session lives without a request."""
SESSION_MAX_AGE = 24 * 3600.0
"""Seconds a session lives at most, however busy."""
MAX_SESSIONS = 10_000
"""Sessions kept at once; past it the least recently used is signed out."""


@dataclass
class UiSession:
    key: str
    """The API key signed in with; in this process's memory only."""
    tenant: str
    csrf: str
    created: float
    seen: float


class Sessions:
    """Signed-in browsers: session id -> :class:`UiSession`, in memory (a restarted
    server signs everyone out), bounded in count and lifetime."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[str, UiSession] = OrderedDict()

    def create(self, key: str, principal: Principal) -> tuple[str, UiSession]:
        now = time.monotonic()
        session_id = secrets.token_urlsafe(32)
        session = UiSession(key, principal.tenant, secrets.token_urlsafe(32), now, now)
        with self._lock:
            self._items[session_id] = session
            while len(self._items) > MAX_SESSIONS:
                self._items.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> UiSession | None:
        if not session_id:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._items.get(session_id)
            if session is None:
                return None
            if now - session.seen > SESSION_IDLE or now - session.created > SESSION_MAX_AGE:
                del self._items[session_id]
                return None
            session.seen = now
            self._items.move_to_end(session_id)
            return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._items.pop(session_id, None)

    def drop_key(self, key: str) -> None:
        """Sign out every session of ``key`` (found revoked)."""
        with self._lock:
            for session_id in [s for s, item in self._items.items() if item.key == key]:
                del self._items[session_id]


def cookie_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, item = part.strip().partition("=")
            if key == COOKIE:
                return item
    return None


def csrf_problem(method: str, headers: list[tuple[bytes, bytes]], session: UiSession) -> str | None:
    """Why a request may not change state on behalf of ``session`` (None: it may).

    GET and HEAD never change state. Anything else needs the session's CSRF token in
    ``X-CSRF-Token`` and, when the browser sends ``Origin``, this server's own origin.
    """
    if method in SAFE_METHODS:
        return None
    found = dict(headers)
    wrong_origin = origin_problem(found)
    if wrong_origin:
        return wrong_origin
    token = found.get(CSRF_HEADER.encode(), b"").decode("latin-1")
    if not token or not hmac.compare_digest(token, session.csrf):
        return "missing or wrong CSRF token (X-CSRF-Token)"
    return None


def origin_problem(headers: dict[bytes, bytes]) -> str | None:
    origin = headers.get(b"origin")
    if origin is None:
        return None
    host = headers.get(b"host", b"").decode("latin-1").lower()
    if urlsplit(origin.decode("latin-1")).netloc.lower() != host or not host:
        return "request from another origin"
    return None


def sessions_of(request: Request) -> Sessions:
    sessions: Sessions = request.app.state.ui_sessions
    return sessions


async def signed_in(request: Request) -> tuple[Principal, UiSession]:
    """The session's principal (its key checked again: a revoked key signs out), with
    the CSRF check for anything but GET/HEAD."""
    sessions = sessions_of(request)
    session_id = request.cookies.get(COOKIE)
    session = sessions.get(session_id)
    if session is None:
        raise ApiError(401, "AuthenticationError", "not signed in (POST /ui/api/session)")
    problem = csrf_problem(request.method, list(request.scope["headers"]), session)
    if problem:
        raise ApiError(403, "CsrfError", problem)
    principal = await principal_for(state_of(request), session.key)
    if principal is None:
        sessions.drop_key(session.key)
        raise ApiError(401, "AuthenticationError", "the API key was revoked: sign in again")
    return principal, session


SignedIn = Annotated[tuple[Principal, UiSession], Depends(signed_in)]
