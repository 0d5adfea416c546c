"""The web app at ``/ui``: sign-in sessions, CSRF, security headers, and the gateway
through which the page calls the API.

How a browser is trusted, and how little:

* **Sign-in** trades an API key for a server-side session: a random id in an
  ``HttpOnly``, ``SameSite=Strict`` cookie scoped to ``/ui``. The key stays in this
  process's memory (never on disk, never sent back to the page); the page's
  JavaScript never holds it after the sign-in request.
* **The API, unchanged**: the page calls ``/ui/api/v1/...``; :class:`UiGateway`
  checks the session (and, for anything but GET/HEAD, the CSRF token and the
  ``Origin``), then hands the request to the very ``/v1/...`` route an SDK client
  calls, with the session's key as its bearer token. Every check the API makes
  (tenant, quotas, limits, audit, a revoked key refused from the next request on)
  therefore applies to the page as it does to code. ``/v1`` itself never reads the
  cookie, so it stays free of CSRF.
* **CSRF**: a per-session token the page reads from ``GET /ui/api/session`` (a
  same-origin read a foreign page cannot make) and sends as ``X-CSRF-Token`` on every
  state-changing call, compared in constant time; the cookie's ``SameSite=Strict``
  is a second layer, the ``Origin`` check a third.
* **Content-Security-Policy** on every ``/ui`` response: scripts and styles only
  from this server's files (no inline script, no ``eval``), no plug-ins, no framing
  of the app, and Trusted Types so that only the one policy that fills sandboxed
  frames may create HTML from a string. What a sandbox outputs as HTML or SVG is
  shown only in an ``<iframe sandbox>`` (no scripts, an opaque origin).
* **Downloads**: every ``/ui/api/`` answer is an attachment under a CSP with
  ``sandbox``, so a file a sandbox wrote never becomes a page of this origin.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.server._manager import ApiError
from sandlot.server._state import ServerState, principal_for, state_of
from sandlot.server._store import OUTCOMES, Principal
from sandlot.server._ui_chat import ChatConfig, Chats, chat_router
from sandlot.server._ui_session import (
    COOKIE,
    PREFIX,
    SESSION_MAX_AGE,
    Sessions,
    SignedIn,
    cookie_of,
    csrf_problem,
    origin_problem,
    sessions_of,
)

STATIC = Path(__file__).with_name("ui")
"""The app's files: plain ES modules, CSS and one HTML page (no build step)."""

API_PREFIX = PREFIX + "/api/v1/"

CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        # Charts arrive as base64 PNG/JPEG and are shown as data: URLs.
        "img-src 'self' data:",
        "connect-src 'self'",
        # Sandbox HTML/SVG lives in srcdoc frames (which inherit this policy).
        "frame-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types sandlot-frame",
    )
)
"""The app's Content-Security-Policy: no inline script, no eval, nothing from elsewhere."""

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), payment=(), usb=()"),
)

API_CSP = CSP + "; sandbox"
"""The policy of ``/ui/api/`` answers (JSON, NDJSON, downloads), which the page only
fetches: should a browser ever show one as a document (a download opened in a tab, a
sniffing bug), it gets an opaque origin and runs no script."""

_REPLACED = frozenset({name for name, _ in SECURITY_HEADERS} | {b"content-disposition"})

_FORWARDED = frozenset(
    {
        b"host",
        b"content-type",
        b"content-length",
        b"transfer-encoding",
        b"accept",
        b"accept-encoding",
        b"user-agent",
    }
)
"""Request headers the gateway passes on to ``/v1``; the rest (cookies, any
``Authorization`` or E2B routing header) are dropped and the session's key added."""


def _problem(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse({"type": type_, "message": message}, status_code=status)


class UiGateway:
    """ASGI middleware: security headers on ``/ui``, and ``/ui/api/v1/...`` turned into
    the ``/v1/...`` request a client with the session's key would send."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            await self.app(scope, receive, send)
            return

        api = path.startswith(PREFIX + "/api/")

        async def secured(message: Any) -> None:
            if message["type"] == "http.response.start":
                given = message.get("headers", [])
                headers = [(name, value) for name, value in given if name not in _REPLACED]
                headers.extend(SECURITY_HEADERS)
                if api:
                    headers = [
                        (name, API_CSP.encode() if name == b"content-security-policy" else value)
                        for name, value in headers
                    ]
                    headers.append((b"cache-control", b"no-store"))
                    # Bytes from a sandbox (a file downloaded through the gateway) are
                    # saved, never shown: whatever its name or content, no browser
                    # renders it under this origin.
                    headers.append((b"content-disposition", b"attachment"))
                message = {**message, "headers": headers}
            await send(message)

        if not path.startswith(API_PREFIX):
            await self.app(scope, receive, secured)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        session = self.sessions.get(cookie_of(headers))
        if session is None:
            response = _problem(401, "AuthenticationError", "not signed in (POST /ui/api/session)")
            await response(scope, receive, secured)
            return
        problem = csrf_problem(scope["method"], headers, session)
        if problem:
            await _problem(403, "CsrfError", problem)(scope, receive, secured)
            return
        rest = path[len(API_PREFIX) :]
        forwarded = [(name, value) for name, value in headers if name in _FORWARDED]
        forwarded.append((b"authorization", f"Bearer {session.key}".encode("latin-1")))
        inner = {
            **scope,
            "path": f"/v1/{rest}",
            "raw_path": f"/v1/{rest}".encode(),
            "headers": forwarded,
        }

        async def revoked(message: Any) -> None:
            # The API refused the key (revoked since sign-in): sign its sessions out.
            if message["type"] == "http.response.start" and message["status"] == 401:
                self.sessions.drop_key(session.key)
            await secured(message)

        await self.app(inner, receive, revoked)


# --- routes ------------------------------------------------------------------------------


class SignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str = Field(..., min_length=1, max_length=256)


router = APIRouter(prefix=PREFIX, include_in_schema=False)


@router.get("")
async def ui_root() -> RedirectResponse:
    return RedirectResponse(PREFIX + "/", status_code=308)


@router.get("/")
async def ui_page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


@router.get("/api/session")
async def get_session(signed: SignedIn) -> dict[str, str]:
    principal, session = signed
    return {"tenant": principal.tenant, "key_id": principal.key_id, "csrf": session.csrf}


@router.post("/api/session")
async def sign_in(request: Request, body: SignIn) -> JSONResponse:
    """Trade an API key for a session cookie. A JSON body (which a foreign page cannot
    send without CORS, which this server never grants) from this server's origin."""
    problem = origin_problem(dict(request.scope["headers"]))
    if problem:
        raise ApiError(403, "CsrfError", problem)
    state = state_of(request)
    principal = await principal_for(state, body.api_key)
    if principal is None:
        state.metrics.requests_rejected.labels("auth").inc()
        raise ApiError(401, "AuthenticationError", "invalid or revoked API key")
    old = cookie_of(list(request.scope["headers"]))
    sessions = sessions_of(request)
    sessions.drop(old)  # a new id on every sign-in: no session fixation
    session_id, session = sessions.create(body.api_key, principal)
    response = JSONResponse(
        {"tenant": principal.tenant, "key_id": principal.key_id, "csrf": session.csrf}
    )
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=int(SESSION_MAX_AGE),
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.delete("/api/session", status_code=204)
async def sign_out(request: Request, signed: SignedIn) -> Response:
    sessions_of(request).drop(cookie_of(list(request.scope["headers"])))
    response = Response(status_code=204)
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


@router.get("/api/console/sandboxes")
async def console_sandboxes(request: Request, signed: SignedIn) -> list[dict[str, Any]]:
    """The tenant's live sandboxes with their age and what they use (cgroup figures,
    None where the backend cannot tell)."""
    state = state_of(request)
    principal, _ = signed
    return await state.blocking(_sandboxes_with_usage, state, principal)


def _sandboxes_with_usage(state: ServerState, principal: Principal) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    for entry in state.manager.owned_by(principal):
        info = entry.info()
        handle = entry.sandbox.handle
        usage = None
        if handle is not None:
            try:
                measured = handle.usage()
            except OSError:  # the sandbox went away while being measured
                measured = None
            usage = None if measured is None else measured.to_dict()
        rows.append(
            {
                **info,
                "age": max(0.0, now - entry.created_at),
                "idle": max(0.0, now - entry.last_used) if entry.active == 0 else 0.0,
                "usage": usage,
            }
        )
    return rows


@router.get("/api/console/audit")
async def console_audit(
    request: Request,
    signed: SignedIn,
    sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
    outcome: Annotated[str | None, Query(max_length=16)] = None,
    text: Annotated[str | None, Query(max_length=200)] = None,
    since: Annotated[float | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """The tenant's executions, newest last: filtered by sandbox, outcome, start time,
    and text found in the code or error name (among the ``limit`` newest matches of
    the other filters)."""
    if outcome is not None and outcome not in OUTCOMES:
        raise ApiError(400, "InvalidArgumentError", f"outcome must be one of {OUTCOMES}")
    state = state_of(request)
    principal, _ = signed

    def query() -> list[dict[str, Any]]:
        rows = state.store.query_executions(
            tenant=principal.tenant,
            sandbox_id=sandbox_id or None,
            outcome=outcome or None,
            since=since,
            limit=limit,
        )
        needle = (text or "").lower()
        return [
            row
            for row in rows
            if not needle
            or needle in (row.get("code") or "").lower()
            or needle in (row.get("error_name") or "").lower()
        ]

    return await state.blocking(query)


@router.get("/api/console/egress")
async def console_egress(
    request: Request,
    signed: SignedIn,
    sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
    verdict: Annotated[str | None, Query(max_length=16)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """The tenant's egress records (connections its sandboxes asked for), newest last."""
    state = state_of(request)
    principal, _ = signed
    return await state.blocking(
        state.store.query_network,
        tenant=principal.tenant,
        sandbox_id=sandbox_id or None,
        verdict=verdict or None,
        limit=limit,
    )


@router.get("/api/console/keys")
async def console_keys(request: Request, signed: SignedIn) -> list[dict[str, Any]]:
    """The tenant's keys: ids and dates only (a key's secret is never stored)."""
    state = state_of(request)
    principal, _ = signed
    keys = await state.blocking(state.store.list_keys)
    return [
        {**row, "current": row["key_id"] == principal.key_id}
        for row in keys
        if row["tenant"] == principal.tenant
    ]


@router.get("/api/console/metrics")
async def console_metrics(request: Request, signed: SignedIn) -> list[dict[str, Any]]:
    """The server's Prometheus samples (what ``/metrics`` serves any key), as JSON;
    histogram buckets left out (their sums and counts kept)."""
    state = state_of(request)
    samples = []
    for family in state.metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            samples.append({"name": sample.name, "labels": sample.labels, "value": sample.value})
    return samples


def install_ui(app: FastAPI) -> None:
    """Serve the web app under ``/ui`` (call after the app's other middleware, so the
    gateway is outermost and its rewritten requests meet every check ``/v1`` has)."""
    sessions = Sessions()
    app.state.ui_sessions = sessions
    app.include_router(router)
    app.include_router(chat_router(Chats(ChatConfig.from_env())))
    app.mount(PREFIX + "/static", StaticFiles(directory=STATIC / "static"), name="ui-static")
    app.add_middleware(UiGateway, sessions=sessions)
