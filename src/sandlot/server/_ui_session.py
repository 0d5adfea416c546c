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
MAX_SESSIONS_PER_KEY = 32
"""Sessions one API key may hold; past it the key's own least recently used is signed
out, so that signing in over and over with one key cannot push other users' sessions
out of the store (only :data:`MAX_SESSIONS` divided by this many keys could)."""


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
        self._by_key: dict[str, OrderedDict[str, None]] = {}
        """Each key's session ids, least recently used first (the cap per key)."""

    def create(self, key: str, principal: Principal) -> tuple[str, UiSession]:
        now = time.monotonic()
        session_id = secrets.token_urlsafe(32)
        session = UiSession(key, principal.tenant, secrets.token_urlsafe(32), now, now)
        with self._lock:
            own = self._by_key.setdefault(key, OrderedDict())
            while len(own) >= MAX_SESSIONS_PER_KEY:
                self._remove(next(iter(own)))
            self._items[session_id] = session
            self._by_key.setdefault(key, own)[session_id] = None
            while len(self._items) > MAX_SESSIONS:
                self._remove(next(iter(self._items)))
        return session_id, session

    def _remove(self, session_id: str) -> None:
        """Forget one session (the lock held)."""
        session = self._items.pop(session_id, None)
        if session is None:
            return
        own = self._by_key.get(session.key)
        if own is not None:
            own.pop(session_id, None)
            if not own:
                del self._by_key[session.key]

    def get(self, session_id: str | None) -> UiSession | None:
        if not session_id:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._items.get(session_id)
            if session is None:
                return None
            if now - session.seen > SESSION_IDLE or now - session.created > SESSION_MAX_AGE:
                self._remove(session_id)
                return None
            session.seen = now
            self._items.move_to_end(session_id)
            self._by_key[session.key].move_to_end(session_id)
            return session

    def drop(self, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._remove(session_id)

    def drop_key(self, key: str) -> None:
        """Sign out every session of ``key`` (found revoked)."""
        with self._lock:
            for session_id in list(self._by_key.get(key, ())):
                self._remove(session_id)

    def count(self, key: str | None = None) -> int:
        """Sessions kept (of ``key`` only, if given)."""
        with self._lock:
            return len(self._items) if key is None else len(self._by_key.get(key, ()))


def cookie_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The session id a request carries: the one parser of the session cookie for the
    gateway and the routes alike. None when there is none, or more than one: a page
    on another port of the same host (cookies ignore ports) or a sibling domain can
    plant a second ``sandlot_ui`` cookie with a longer ``Path``, which the browser
    sends first; the app would otherwise act as one session and show another."""
    found: list[str] = []
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, item = part.strip().partition("=")
            if key.strip() == COOKIE:
                found.append(item.strip())
    return found[0] if len(found) == 1 else None


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
    session = sessions.get(cookie_of(list(request.scope["headers"])))
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
