"""E2B's sandbox plane: envd and the code interpreter, on this server's root URL.

With ``E2B_SANDBOX_URL`` set to this server, the E2B SDKs send every call meant for a
sandbox here, naming it in headers: ``E2b-Sandbox-Id`` (which sandbox),
``E2b-Sandbox-Port`` (49983 envd, 49999 the code interpreter) and ``X-Access-Token``
/ ``E2B-Traffic-Access-Token`` (the token the control plane handed out,
:mod:`sandlot.server._e2b_control`). :class:`E2bWire` routes such requests here
before the app sees them:

* envd's HTTP API: ``GET/POST /files`` (streamed download, gzip when asked;
  multipart upload of several files, or one octet-stream body, gzip or not),
  ``GET /health``;
* envd's Connect services, served by the ``connectrpc`` package with the stubs the
  ``e2b`` package ships: ``filesystem.Filesystem`` (Stat, ListDir, MakeDir, Move,
  Remove) and ``process.Process`` (Start, Connect, List, SendInput, StreamInput,
  SendSignal, CloseStdin, Update: sandlot's background processes and terminals);
* the code interpreter: ``/execute``, ``/contexts``.

A request is served only with the sandbox's token or an API key of its tenant, and
holds a lease on the sandbox (the reaper never takes it from under the request). An
unknown or killed sandbox answers as E2B's proxy does (502 "... was not found"), which
the SDK turns into ``SandboxNotRunningException`` (and ``is_running()`` into False).

The debug mode's ``/e2b`` prefix (:mod:`sandlot.server._e2b`) gets the same Connect
services, authenticated by API key as the rest of ``/e2b``.
"""

from __future__ import annotations

import base64
import contextvars
import dataclasses
import hashlib
import hmac
import json
import logging
import re
import time
import urllib.parse
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot import InvalidArgumentError, SandlotError
from sandlot.server._e2b import DEBUG_SANDBOX_ID, e2b_result
from sandlot.server._e2b_control import (
    TOKEN_HEADER,
    TRAFFIC_TOKEN_HEADER,
    E2bRoute,
    WireRegistry,
    token_matches,
)
from sandlot.server._manager import ApiError, ManagedSandbox
from sandlot.server._routes import (
    DOWNLOAD_HEADERS,
    ContextInfo,
    CreateContext,
    Execute,
    create_context,
    download,
    execute,
    list_contexts,
    upload,
    upload_metadata,
)
from sandlot.server._shortcut import posts_json, prefetched, short_execute, until_disconnect
from sandlot.server._state import ServerState, api_key_of, principal_for
from sandlot.server._store import Principal

log = logging.getLogger("sandlot.server")

ENVD_PORT = "49983"
JUPYTER_PORT = "49999"
CONNECT_SERVICES = ("/filesystem.Filesystem/", "/process.Process/")


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """The sandbox a sandbox-plane request acts on, leased for the request."""

    state: ServerState
    entry: ManagedSandbox
    principal: Principal


_TARGET: contextvars.ContextVar[Target | ApiError] = contextvars.ContextVar("e2b_target")


def current() -> Target:
    """The request's sandbox (for the HTTP routes: raises the resolution's ApiError)."""
    target = _TARGET.get(None)
    if target is None:
        raise ApiError(500, "ServerError", "no sandbox resolved for this request")
    if isinstance(target, ApiError):
        raise target
    return target


def not_found(sandbox_id: str) -> ApiError:
    # E2B's proxy wording: the SDK recognises "was not found" as a sandbox gone.
    return ApiError(502, "SandboxNotFound", f"The sandbox {sandbox_id} was not found")


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


SANDBOX_USER = "user"
"""The one user a sandlot sandbox has (unprivileged; no root, no sudo)."""


def requested_user(headers: dict[str, str], scope: Scope) -> str | None:
    """The user an E2B call asks to run as (``user=`` in the SDK): the ``username`` of
    a file URL's query, else the name of envd's ``Authorization: Basic NAME:`` header
    (an empty password: with one, the header carries an API key instead). None: unnamed."""
    raw_query: bytes = scope.get("query_string", b"")
    named = (urllib.parse.parse_qs(raw_query.decode("latin-1")).get("username") or [""])[0]
    if named:
        return named
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        name, _, password = base64.b64decode(value.strip()).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (name or None) if not password else None


def check_user(user: str | None) -> None:
    """Refuse a user the sandbox does not have, rather than run as another one."""
    if user is None or user == SANDBOX_USER:
        return
    why = (
        "a sandlot sandbox has no root and no sudo"
        if user == "root"
        else "a sandlot sandbox has one user"
    )
    raise ApiError(
        400,
        "InvalidArgumentError",
        f"user {user[:64]!r} is not available: {why}; everything runs as the unprivileged "
        f"{SANDBOX_USER!r} (leave user unset, or pass user={SANDBOX_USER!r})",
    )


class _HeaderRequest:
    """Just enough of a Request for :func:`api_key_of`."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


async def _principal_by_key(state: ServerState, headers: dict[str, str]) -> Principal | None:
    key = api_key_of(_HeaderRequest(headers))  # type: ignore[arg-type]
    if not key:
        return None
    return await principal_for(state, key)


async def resolve_normal(
    state: ServerState, registry: WireRegistry, headers: dict[str, str]
) -> tuple[ManagedSandbox, Principal]:
    """Normal mode: the sandbox named by ``E2b-Sandbox-Id``, with its token (or an API
    key of its tenant); leased."""
    sandbox_id = headers.get("e2b-sandbox-id", "")
    offered = headers.get(TOKEN_HEADER) or headers.get(TRAFFIC_TOKEN_HEADER)
    record = registry.get(sandbox_id)
    if offered is not None:
        # A wrong token answers as an unknown id does (and costs the same comparison):
        # neither may tell a caller which sandbox ids are live.
        if not token_matches(record, offered) or record is None:
            raise not_found(sandbox_id)
        principal = record.principal
    else:
        found = await _principal_by_key(state, headers)
        if found is None:
            raise ApiError(
                401,
                "AuthenticationError",
                "this sandbox needs its access token (X-Access-Token, from Sandbox.create "
                "or Sandbox.connect) or an API key of its tenant",
            )
        principal = found
    try:
        entry = state.manager.lease(principal, sandbox_id)
    except ApiError:
        raise not_found(sandbox_id) from None
    if entry.expires_at <= time.time():
        # Past its timeout, though the reaper has not come by yet: gone, as in E2B
        # (is_running() is False from the moment the timeout passes).
        state.manager.release(entry)
        raise not_found(sandbox_id)
    return entry, principal


def resolve_signed(
    state: ServerState, registry: WireRegistry, scope: Scope
) -> tuple[ManagedSandbox, Principal]:
    """A signed file URL (E2B's ``download_url``/``upload_url``): ``/files`` with
    ``signature`` (and ``signature_expiration``) in its query and no headers. The
    signature is ``v1_`` + base64(SHA-256 of ``path:operation:user:token[:expiry]``),
    made with the sandbox's access token; the sandbox is the one whose token makes it.
    Leased."""
    raw_query: bytes = scope.get("query_string", b"")
    query: dict[str, list[str]] = urllib.parse.parse_qs(raw_query.decode("latin-1"))

    def one(name: str) -> str:
        return (query.get(name) or [""])[0]

    signature, expiry = one("signature"), one("signature_expiration")
    operation = "write" if scope.get("method") == "POST" else "read"
    if expiry and not expiry.lstrip("-").isdigit():
        raise ApiError(400, "InvalidArgumentError", "signature_expiration must be an integer")
    for sandbox_id, record in registry.records():
        raw = f"{one('path')}:{operation}:{one('username')}:{record.token}"
        if expiry:
            raw += f":{expiry}"
        digest = hashlib.sha256(raw.encode()).digest()
        expected = "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")
        if hmac.compare_digest(expected.encode(), signature.encode()):
            if expiry and int(expiry) < time.time():
                raise ApiError(401, "AuthenticationError", "signature is already expired")
            try:
                return state.manager.lease(record.principal, sandbox_id), record.principal
            except ApiError:
                raise not_found(sandbox_id) from None
    raise ApiError(401, "AuthenticationError", "invalid signature for this file URL")


_NAMED = re.compile(r"^/e2b/sandboxes/([^/]+)(/.*)$")


async def resolve_debug(
    state: ServerState, headers: dict[str, str], path: str
) -> tuple[ManagedSandbox, Principal, str]:
    """Debug mode (``/e2b`` prefix, API key): the sandbox the path names, else the one
    ``E2b-Sandbox-Id`` names (after ``Sandbox.connect(id)``), else the tenant's default;
    leased. Returns it and the path without the prefix."""
    principal = await _principal_by_key(state, headers)
    if principal is None:
        # The E2B SDK sends its debug-mode Connect calls without the URL's credentials.
        raise ApiError(
            401,
            "AuthenticationError",
            "a valid API key is required; in debug mode the E2B SDK sends none to envd's "
            "Connect services (files.list/exists/get_info/make_dir/rename/remove, "
            "commands): use E2B's normal mode (E2B_API_URL and E2B_SANDBOX_URL set to this "
            "server, E2B_API_KEY a sandlot key; see docs/e2b.md)",
        )
    named = _NAMED.match(path)
    if named:
        return state.manager.lease(principal, named.group(1)), principal, named.group(2)
    rest = path.removeprefix("/e2b")
    header_id = headers.get("e2b-sandbox-id")
    if header_id and header_id != DEBUG_SANDBOX_ID:
        return state.manager.lease(principal, header_id), principal, rest
    return await state.blocking(state.manager.tenant_default, principal), principal, rest


class E2bWire:
    """ASGI middleware: requests for a sandbox (``E2b-Sandbox-Id``, outside ``/e2b``)
    go to the sandbox plane; Connect calls under ``/e2b`` to the Connect services."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        registry: WireRegistry,
        plane: ASGIApp,
        connect: Callable[[str], ASGIApp | None],
    ) -> None:
        self.app = app
        self.state = state
        self.registry = registry
        self.plane = plane
        self.connect = connect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        debug = path == "/e2b" or path.startswith("/e2b/")
        if debug and not any(service in path for service in CONNECT_SERVICES):
            await self.app(scope, receive, send)  # the debug-mode routes (_e2b.py)
            return
        signed = not debug and path == "/files" and b"signature=" in scope.get("query_string", b"")
        # ASGI header names are lower case. Most requests (the native API, E2B's
        # control plane) name no sandbox: they pass on without the header dict.
        named = any(name == b"e2b-sandbox-id" for name, _ in scope.get("headers", ()))
        if not debug and not named and not signed:
            await self.app(scope, receive, send)
            return
        if not debug and path == "/execute" and posts_json(scope):
            # A cell's body before its sandbox is leased (resolved below): a client that
            # sent its headers and then nothing must not keep the idle reaper off it.
            prefetch = await prefetched(receive, send, _send_json, _e2b_error)
            if prefetch is None:
                return
            receive = prefetch
        headers = _headers(scope)
        entry: ManagedSandbox | None = None
        target: Target | ApiError
        try:
            if signed and "e2b-sandbox-id" not in headers:
                entry, principal = resolve_signed(self.state, self.registry, scope)
            elif debug:
                entry, principal, path = await resolve_debug(self.state, headers, path)
            else:
                entry, principal = await resolve_normal(self.state, self.registry, headers)
            if not debug:
                check_user(requested_user(headers, scope))
            target = Target(self.state, entry, principal)
        except (ApiError, SandlotError) as exc:
            # SandlotError: the default sandbox could not start (debug mode).
            target = (
                exc if isinstance(exc, ApiError) else ApiError(503, type(exc).__name__, str(exc))
            )
            if debug:  # the Connect app answers the error in Connect's shape
                path = _connect_suffix(path)
        token = _TARGET.set(target)
        try:
            connect = self.connect(path)
            app = connect or (None if debug else self.plane)
            if app is None:
                await _send_json(send, 404, {"code": 404, "message": f"no route {path}"})
                return
            scope = {**scope, "path": path, "raw_path": path.encode(), "root_path": ""}
            if connect is not None:
                await until_disconnect(connect, scope, receive, send)
            elif path == "/execute" and isinstance(target, Target) and posts_json(scope):
                await short_execute(
                    target.state,
                    target.principal,
                    target.entry,
                    app,
                    scope,
                    receive,
                    send,
                    error=_e2b_error,
                    send_json=_send_json,
                    default_timeout=target.state.settings.e2b_cell_timeout,
                    adapt_result=e2b_result,
                    before_end=lambda: _raise_if_killed(target.state, target.entry),
                )
            else:
                await app(scope, receive, send)
        except SandboxKilledError as exc:
            # Returning with the body unfinished makes the ASGI server drop the
            # connection (it logs one line saying so); no traceback for an expected end.
            log.info("cut the response to %s: %s", scope["path"], exc)
        finally:
            _TARGET.reset(token)
            if entry is not None:
                self.state.manager.release(entry)


def _e2b_error(exc: ApiError) -> tuple[int, dict[str, Any]]:
    return exc.status, {"code": exc.status, "message": exc.message}


def _connect_suffix(path: str) -> str:
    """``/e2b[/sandboxes/ID]/filesystem.Filesystem/Stat`` -> ``/filesystem.Filesystem/Stat``."""
    for service in CONNECT_SERVICES:
        if service in path:
            return path[path.index(service) :]
    return path


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


# --- envd HTTP and the code interpreter -------------------------------------------------

Current = Annotated[Target, Depends(current)]


def plane_app(status_table: tuple[tuple[type[Exception], int], ...]) -> FastAPI:
    """The HTTP half of the sandbox plane (envd's ``/files`` and ``/health``, the code
    interpreter's ``/execute`` and ``/contexts``). Errors: ``{"code", "message"}``."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    route_class = type("E2bPlaneRoute", (E2bRoute,), {"status_table": status_table})
    app.router.route_class = route_class

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": 400, "message": str(exc.errors())}, status_code=400)

    @app.get("/health", status_code=204)
    async def health(target: Current) -> Response:
        return Response(status_code=204)

    @app.get("/files")
    async def read(
        request: Request, target: Current, path: Annotated[str, Query(min_length=1)]
    ) -> StreamingResponse:
        response = await download(target.state, target.entry, path, principal=target.principal)
        if "gzip" not in request.headers.get("accept-encoding", ""):
            return response
        return StreamingResponse(
            _gzip(response.body_iterator),  # type: ignore[arg-type]
            media_type="application/octet-stream",
            headers={**DOWNLOAD_HEADERS, "content-encoding": "gzip"},
        )

    @app.post("/files")
    async def write(
        request: Request,
        target: Current,
        path: Annotated[str | None, Query(min_length=1)] = None,
    ) -> list[dict[str, Any]]:
        # envd's: every file of the upload gets the same metadata, and replaces its own.
        metadata = upload_metadata(request)
        state, entry = target.state, target.entry
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise InvalidArgumentError(f"unsupported Content-Encoding {encoding!r}")
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            if path is None:
                raise InvalidArgumentError("path is required for an octet-stream upload")
            chunks: AsyncIterator[bytes] = request.stream()
            if encoding == "gzip":
                chunks = _gunzip(chunks)
            principal = target.principal
            return [
                _written(await upload(state, entry, path, chunks, metadata, principal=principal))
            ]
        written: list[dict[str, Any]] = []
        async with request.form(max_files=1000) as form:
            files = [part for part in form.getlist("file") if isinstance(part, UploadFile)]
            if not files:
                raise InvalidArgumentError("a multipart upload needs at least one 'file' part")
            for part in files:
                target_path = path if path is not None and len(files) == 1 else part.filename
                if not target_path:
                    raise InvalidArgumentError("each uploaded file needs a path (its filename)")
                info = await upload(
                    state, entry, target_path, _parts(part), metadata, principal=target.principal
                )
                written.append(_written(info))
        return written

    @app.post("/execute")
    async def run(target: Current, body: Execute) -> StreamingResponse:
        state = target.state
        response = await execute(
            state, target.principal, target.entry, body, state.settings.e2b_cell_timeout, e2b_result
        )
        response.body_iterator = _cut_if_killed(state, target.entry, response.body_iterator)
        return response

    @app.post("/contexts")
    async def new_context(target: Current, body: CreateContext) -> ContextInfo:
        return ContextInfo(**await create_context(target.state, target.entry, body))

    @app.get("/contexts")
    async def contexts(target: Current) -> list[ContextInfo]:
        return [ContextInfo(**c) for c in await list_contexts(target.state, target.entry)]

    @app.post("/contexts/{context_id}/restart", status_code=204)
    async def restart(target: Current, context_id: str) -> Response:
        await target.state.blocking(target.entry.sandbox.restart_code_context, context_id)
        return Response(status_code=204)

    @app.delete("/contexts/{context_id}", status_code=204)
    async def remove(target: Current, context_id: str) -> Response:
        await target.state.blocking(target.entry.sandbox.remove_code_context, context_id)
        return Response(status_code=204)

    _ = (invalid, health, read, write, run, new_context, contexts, restart, remove)
    return app


class SandboxKilledError(Exception):
    """The sandbox ended while a cell streamed: the response is cut, not finished."""


async def _cut_if_killed(
    state: ServerState, entry: ManagedSandbox, chunks: AsyncIterable[Any]
) -> AsyncIterator[Any]:
    """End the ``/execute`` stream as E2B's does when its sandbox is killed mid-cell:
    by dropping the connection, not with a complete body. The E2B client then asks
    whether the sandbox still runs and raises its "sandbox was killed" timeout; a
    complete body would read as a cell that merely failed."""
    async for chunk in chunks:
        yield chunk
    _raise_if_killed(state, entry)


def _raise_if_killed(state: ServerState, entry: ManagedSandbox) -> None:
    """:class:`SandboxKilledError` if ``entry`` ended (see :func:`_cut_if_killed`)."""
    if not state.manager.registered(entry):
        raise SandboxKilledError(f"sandbox {entry.sandbox_id} ended during the cell")


def _written(info: dict[str, Any]) -> dict[str, Any]:
    written = {"name": info["name"], "type": info["type"] or "file", "path": info["path"]}
    if info.get("metadata"):
        written["metadata"] = info["metadata"]
    return written


async def _parts(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(1024 * 1024):
        yield chunk


async def _gzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    async for chunk in chunks:
        if packed := packer.compress(chunk):
            yield packed
    yield packer.flush()


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Inflate a gzip body as it arrives; the output is bounded per step, so a small
    bomb cannot allocate more than a chunk at a time (the upload's size limit applies to
    what comes out)."""
    unpacker = zlib.decompressobj(31)
    try:
        async for chunk in chunks:
            data = chunk
            while data:
                out = unpacker.decompress(data, 1024 * 1024)
                if out:
                    yield out
                data = unpacker.unconsumed_tail
        if tail := unpacker.flush():
            yield tail
    except zlib.error as exc:
        raise InvalidArgumentError(f"the gzip body is corrupt: {exc}") from None
    if not unpacker.eof:
        raise InvalidArgumentError("the gzip body is truncated")


# --- envd's Connect services ---------------------------------------------------------------


def connect_unavailable(missing: str) -> Callable[[str], ASGIApp | None]:
    """What answers the Connect paths when the server lacks the ``e2b`` package (whose
    stubs :mod:`sandlot.server._e2b_envd` serves): 501, saying so."""

    async def unavailable(scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(
            send,
            501,
            {
                "code": "unimplemented",
                "message": "envd's Connect services need the 'e2b' package on the server "
                f"(pip install 'sandlot[server]'): {missing}",
            },
        )

    return lambda path: unavailable if path.startswith(CONNECT_SERVICES) else None
