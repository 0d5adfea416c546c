"""The native HTTP API (``/v1``), plus ``/health`` and ``/metrics``.

Routes only translate HTTP to calls on :class:`sandlot.Sandbox` objects held by the
:class:`SandboxManager`; every blocking call runs in the server's worker threads.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import tempfile
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as FastPath
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, create_model

from sandlot import (
    EntryInfo,
    FilesystemEvent,
    InvalidArgumentError,
    PtySize,
    SandlotError,
    stream_only,
)
from sandlot.policy import MiB, Resources
from sandlot.protocol import METADATA_HEADER
from sandlot.server._cells import CellRunner, EagerNdjson, exception_message, ndjson
from sandlot.server._manager import ApiError, ManagedSandbox
from sandlot.server._state import ServerState, authenticate, state_of
from sandlot.server._store import Principal
from sandlot.validate import (
    DEFAULT_CELL_TIMEOUT,
    DEFAULT_COMMAND_TIMEOUT,
    cell_context,
    check_envs,
    check_metadata,
    check_path,
    seconds,
)

MAX_CELL_TIMEOUT = 86400.0
"""Longest cell or command a client may ask for (one day)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_TiB_IN_MiB = 1024 * 1024
_RESOURCE_BOUNDS: dict[str, float] = {
    "memory_mb": _TiB_IN_MiB,
    "cpu_seconds": 366 * 86400,
    "pids": 32768,
    "cpus": 1024,
    "disk_mb": _TiB_IN_MiB,
    "tmp_mb": _TiB_IN_MiB,
    "file_size_mb": _TiB_IN_MiB,
    "open_files": 16384,
    "max_results": 10000,
    "background_processes": 1024,
}
"""Upper bounds that keep a request within what a host can be asked for (larger values
are refused with 422 rather than failing the sandbox's start). Byte fields: 1 TiB."""


def _resources_model() -> type[BaseModel]:
    """``sandlot.Resources`` as a request model, built from its fields so it cannot drift.

    A field left out takes the tenant's ceiling; ``null`` and a value above the ceiling
    are refused (400, see ``SandboxManager.resources_for``).
    """
    hints = typing.get_type_hints(Resources)
    fields: dict[str, Any] = {}
    for item in dataclasses.fields(Resources):
        kind: Any = float if float in typing.get_args(hints[item.name]) else int
        bound = _RESOURCE_BOUNDS.get(item.name, float(_TiB_IN_MiB * MiB))
        # strict: JSON true is not a size (lax mode would read it as 1).
        fields[item.name] = (kind | None, Field(None, gt=0, le=bound, strict=True))
    return create_model(
        "ResourcesIn",
        __config__=ConfigDict(extra="forbid"),
        __doc__="sandlot.Resources, each at most the server's ceiling for the tenant; a field "
        "left out takes the ceiling; null (no limit) is refused.",
        **fields,
    )


ResourcesIn = _resources_model()


_Entry = Annotated[str, Field(min_length=1, max_length=300)]
_Cap = Annotated[int, Field(gt=0, le=2**62, strict=True)]


class NetworkIn(Strict):
    """sandlot.NetworkPolicy: where the sandbox may connect out, within what this server
    allows (else 400). No ``allow_out``: no network. A cap left out takes sandlot's
    default or the server's cap, whichever is lower; null asks for no cap."""

    allow_out: list[_Entry] = Field(default_factory=list, max_length=256)
    deny_out: list[_Entry] = Field(default_factory=list, max_length=256)
    max_bytes_out: _Cap | None = None
    max_bytes_in: _Cap | None = None
    max_connections: _Cap | None = None


class CreateSandbox(Strict):
    template: str = Field("python-data", min_length=1, max_length=128)
    timeout: float | None = Field(300.0, gt=0, description="Seconds until the sandbox is killed.")
    envs: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    resources: ResourcesIn | None = None  # type: ignore[valid-type]
    network: NetworkIn | None = None


class NetworkInfo(BaseModel):
    allow_out: list[str]
    deny_out: list[str]
    max_bytes_out: int | None
    max_bytes_in: int | None
    max_connections: int | None


class SandboxInfo(BaseModel):
    sandbox_id: str
    template: str
    metadata: dict[str, str]
    resources: dict[str, int | float | None]
    started_at: float
    expires_at: float
    running: bool
    restarts: int
    network: NetworkInfo | None = Field(
        None, description="The network policy in force (null: no network)."
    )


class SetTimeout(Strict):
    timeout: float | None = Field(..., gt=0)


class Execute(Strict):
    code: str
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None
    timeout: float | None = Field(
        None, gt=0, le=MAX_CELL_TIMEOUT, description="Seconds (default 60)."
    )


class CreateContext(Strict):
    cwd: str | None = None
    language: str | None = None


class ContextInfo(BaseModel):
    id: str
    language: str
    cwd: str


class Interrupt(Strict):
    context_id: str | None = None


class Rename(Strict):
    old_path: str
    new_path: str


class RunCommand(Strict):
    cmd: str
    cwd: str | None = None
    envs: dict[str, str] | None = None
    timeout: float | None = Field(60.0, gt=0, le=MAX_CELL_TIMEOUT)


class Entry(BaseModel):
    name: str
    type: Literal["file", "dir"] | None
    path: str
    size: int = 0
    mode: int = 0
    permissions: str = ""
    modified_time: float = 0.0
    symlink_target: str | None = None
    metadata: dict[str, str] | None = None


class WriteResult(BaseModel):
    name: str
    type: Literal["file", "dir"] | None
    path: str
    metadata: dict[str, str] | None = None


class Health(BaseModel):
    status: Literal["ok"]
    version: str


NDJSON = "application/x-ndjson"
_NDJSON_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {NDJSON: {"schema": {"type": "string"}}}, "description": "NDJSON stream"}
}
_BYTES_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The file's bytes",
    }
}

Auth = Annotated[Principal, Depends(authenticate)]
router = APIRouter()


@router.get("/health", tags=["operations"])
async def health() -> Health:
    """Liveness; the only route that needs no API key."""
    import sandlot

    return Health(status="ok", version=sandlot.__version__)


@router.get("/metrics", tags=["operations"], response_class=Response)
async def metrics(request: Request, principal: Auth) -> Response:
    """Prometheus metrics (sandboxes live, executions by outcome, latencies, pool)."""
    state = state_of(request)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- sandboxes ------------------------------------------------------------------------


async def sandbox_of(
    request: Request, sandbox_id: str, principal: Auth
) -> AsyncIterator[ManagedSandbox]:
    """The caller's sandbox, leased for the request (never reaped from under it)."""
    manager = state_of(request).manager
    # Kept for the operations audit (see :func:`principal_of`).
    request.state.principal = principal
    async with leased(request, manager.lease(principal, sandbox_id)) as entry:
        yield entry


def principal_of(request: Request) -> Principal:
    """Who asked for a request on an :data:`Owned` sandbox (the operations audit's who)."""
    principal: Principal = request.state.principal
    return principal


@contextlib.asynccontextmanager
async def leased(request: Request, entry: ManagedSandbox) -> AsyncIterator[ManagedSandbox]:
    # Kept on the request: the error handler tells "killed while in use" (404) apart
    # from a fault of a live sandbox (503).
    request.state.sandbox = entry
    try:
        yield entry
    finally:
        state_of(request).manager.release(entry)


async def known_sandbox(request: Request, sandbox_id: str, principal: Auth) -> ManagedSandbox:
    """The caller's sandbox, not leased: reading or managing it is not using it (a client
    polling its info does not keep it from the idle reaper)."""
    return state_of(request).manager.get(principal, sandbox_id)


Owned = Annotated[ManagedSandbox, Depends(sandbox_of)]
Known = Annotated[ManagedSandbox, Depends(known_sandbox)]


@router.post("/v1/sandboxes", status_code=201, tags=["sandboxes"])
async def create_sandbox(request: Request, body: CreateSandbox, principal: Auth) -> SandboxInfo:
    state = state_of(request)
    started = time.monotonic()
    entry = await state.blocking(
        state.manager.create,
        principal,
        template=body.template,
        timeout=body.timeout,
        envs=body.envs,
        metadata=body.metadata,
        resources=None if body.resources is None else body.resources.model_dump(exclude_unset=True),
        network=None if body.network is None else body.network.model_dump(exclude_unset=True),
    )
    state.metrics.sandboxes_created.inc()
    state.metrics.sandbox_start_seconds.observe(time.monotonic() - started)
    return SandboxInfo(**entry.info())


@router.get("/v1/sandboxes", tags=["sandboxes"])
async def list_sandboxes(request: Request, principal: Auth) -> list[SandboxInfo]:
    return [SandboxInfo(**entry.info()) for entry in state_of(request).manager.owned_by(principal)]


@router.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
async def get_sandbox(entry: Known) -> SandboxInfo:
    return SandboxInfo(**entry.info())


@router.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
async def kill_sandbox(request: Request, entry: Known) -> None:
    state = state_of(request)
    # Counted by the manager; its processes are reaped in the background.
    state.manager.kill(entry, "killed")


@router.post("/v1/sandboxes/{sandbox_id}/timeout", status_code=204, tags=["sandboxes"])
async def set_timeout(request: Request, entry: Known, body: SetTimeout) -> None:
    state_of(request).manager.set_timeout(entry, body.timeout)


# --- code -----------------------------------------------------------------------------


def _within_cell_ceiling(state: ServerState, tenant: str, timeout: float, default: bool) -> float:
    """``timeout``, if within the tenant's cell-timeout ceiling; a default above the
    ceiling is lowered to it, an explicit one is refused (400)."""
    ceiling = state.manager.cell_timeout_ceiling(tenant)
    if timeout <= ceiling:
        return timeout
    if default:
        return ceiling
    raise InvalidArgumentError(
        f"timeout={timeout:g} is above this server's cell timeout ceiling of {ceiling:g} "
        f"seconds for tenant {tenant!r}"
    )


def _check_text(*texts: str) -> None:
    """Refuse a string no UTF-8 text holds: JSON may spell a lone surrogate
    (``"\\ud800"``), which the audit trail and the sandbox cannot take, so the cell
    would fail inside the server (a 500 in a 200 stream) instead of being a 400."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(
                "the cell's code and environment must be Unicode text (no lone surrogates)"
            ) from None


async def execute(
    state: ServerState,
    principal: Principal,
    entry: ManagedSandbox,
    body: Execute,
    default_timeout: float = DEFAULT_CELL_TIMEOUT,
    adapt_result: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> EagerNdjson:
    """Validate, then stream the cell. Shared by the native and the E2B routes."""
    runner = cell_runner(state, principal, entry, body, default_timeout, adapt_result)
    cell = runner.cell
    # The cell starts now, while the response's headers go out.
    return EagerNdjson(
        runner,
        state.executor,
        lambda: state.manager.interrupt_cell(cell, "client disconnected"),
        lambda: state.manager.interrupt_cell(cell, "client too slow"),
        stall_seconds=state.settings.client_stall_timeout,
        media_type=NDJSON,
    )


def cell_runner(
    state: ServerState,
    principal: Principal,
    entry: ManagedSandbox,
    body: Execute,
    default_timeout: float = DEFAULT_CELL_TIMEOUT,
    adapt_result: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> CellRunner:
    """Check a cell's request and register the cell; raises what the client is told
    (a 400, or 503 while shutting down). Shared by every cell route (HTTP, WebSocket)."""
    # The same checks run_code makes, made before the 200 is sent so that they can
    # still be a 400.
    context = cell_context(body.language, body.context_id)
    timeout = seconds(body.timeout) if body.timeout is not None else default_timeout
    timeout = _within_cell_ceiling(state, entry.tenant, timeout, body.timeout is None)
    envs = check_envs(body.env_vars)
    _check_text(body.code, *envs, *envs.values())
    cell = state.manager.new_cell(entry, context)
    return CellRunner(
        manager=state.manager,
        store=state.store,
        metrics=state.metrics,
        keep_code=state.settings.keep_code,
        principal=principal,
        cell=cell,
        code=body.code,
        envs=envs,
        timeout=timeout,
        adapt_result=adapt_result,
    )


@router.post(
    "/v1/sandboxes/{sandbox_id}/execute",
    tags=["code"],
    response_class=StreamingResponse,
    responses=_NDJSON_DOC,
)
async def run_code(
    request: Request, entry: Owned, body: Execute, principal: Auth
) -> StreamingResponse:
    """Run a cell; the result streams as NDJSON (E2B's message types). Disconnecting
    interrupts the cell."""
    return await execute(state_of(request), principal, entry, body)


@router.post("/v1/sandboxes/{sandbox_id}/interrupt", status_code=204, tags=["code"])
async def interrupt(request: Request, entry: Owned, body: Interrupt) -> None:
    await state_of(request).blocking(entry.sandbox.interrupt, body.context_id)


async def create_context(state: ServerState, entry: ManagedSandbox, body: CreateContext) -> Any:
    context = await state.blocking(entry.sandbox.create_code_context, body.cwd, body.language)
    return dataclasses.asdict(context)


async def list_contexts(state: ServerState, entry: ManagedSandbox) -> list[Any]:
    contexts = await state.blocking(entry.sandbox.list_code_contexts)
    return [dataclasses.asdict(context) for context in contexts]


@router.post("/v1/sandboxes/{sandbox_id}/contexts", status_code=201, tags=["code"])
async def create_code_context(request: Request, entry: Owned, body: CreateContext) -> ContextInfo:
    return ContextInfo(**await create_context(state_of(request), entry, body))


@router.get("/v1/sandboxes/{sandbox_id}/contexts", tags=["code"])
async def list_code_contexts(request: Request, entry: Owned) -> list[ContextInfo]:
    return [ContextInfo(**item) for item in await list_contexts(state_of(request), entry)]


@router.post("/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart", status_code=204)
async def restart_code_context(request: Request, entry: Owned, context_id: str) -> None:
    await state_of(request).blocking(entry.sandbox.restart_code_context, context_id)


@router.delete("/v1/sandboxes/{sandbox_id}/contexts/{context_id}", status_code=204)
async def remove_code_context(request: Request, entry: Owned, context_id: str) -> None:
    await state_of(request).blocking(entry.sandbox.remove_code_context, context_id)


# --- files ------------------------------------------------------------------------------


DOWNLOAD_HEADERS = {
    "cache-control": "no-store",
    # A file from a sandbox is the sandbox's choice of bytes, served from the same origin
    # as the web app: a browser that opens its URL must neither sniff it into a page nor
    # run it as one.
    "x-content-type-options": "nosniff",
    "content-security-policy": "sandbox; default-src 'none'",
    "content-disposition": "attachment",
}


async def download(
    state: ServerState, entry: ManagedSandbox, path: str, *, principal: Principal
) -> StreamingResponse:
    """Stream a file out of the sandbox; errors (404...) are raised before the 200.
    Audited (a ``download`` operation) as it opens."""
    chunks: Iterator[bytes] = await state.blocking(
        state.manager.audited,
        principal,
        entry,
        "download",
        path,
        entry.sandbox.files.read,
        path,
        "stream",
    )
    first = await state.blocking(next, chunks, b"")

    async def body() -> AsyncIterator[bytes]:
        # The stream outlives the request's lease: hold the sandbox while a slow client
        # reads, or the idle reaper would cut the file short.
        state.manager.touch(entry, +1)
        try:
            yield first
            while True:
                chunk = await state.blocking(next, chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            state.manager.touch(entry, -1)

    return StreamingResponse(
        body(), media_type="application/octet-stream", headers=DOWNLOAD_HEADERS
    )


def upload_metadata(request: Request) -> dict[str, str]:
    """The file metadata an upload's ``X-Metadata-<key>`` headers carry, checked (400
    otherwise); the first of repeated headers counts."""
    prefix = METADATA_HEADER.lower().encode("latin-1")
    found: dict[str, str] = {}
    for name, value in request.headers.raw:
        if name.lower().startswith(prefix):
            key = name[len(prefix) :].decode("latin-1").lower()
            found.setdefault(key, value.decode("latin-1"))
    return check_metadata(found)


async def upload(
    state: ServerState,
    entry: ManagedSandbox,
    path: str,
    chunks: AsyncIterator[bytes],
    metadata: dict[str, str] | None = None,
    *,
    principal: Principal,
) -> dict[str, Any]:
    """Spool an upload to disk (never all in memory), then write it into the sandbox
    with ``metadata`` (none: the file keeps none), audited as a ``write`` operation.

    Refused with 413 as soon as it passes the server's upload limit or the
    sandbox's workspace size (``disk_mb``).
    """
    check_path(path)
    limit = state.settings.max_upload_bytes
    if entry.resources.upload_bytes is not None:
        limit = min(limit, entry.resources.upload_bytes)
    if entry.resources.disk_mb is not None:
        limit = min(limit, entry.resources.disk_mb * MiB)
    with tempfile.SpooledTemporaryFile(
        max_size=4 * MiB, dir=str(state.settings.spool_dir), prefix="upload-"
    ) as spool:
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                state.metrics.requests_rejected.labels("too_large").inc()
                raise ApiError(
                    413,
                    "InvalidArgumentError",
                    f"{path}: upload larger than {limit} bytes (the sandbox's upload_bytes "
                    "or workspace, disk_mb, or the server's upload limit)",
                )
            await state.blocking(spool.write, chunk)
        spool.seek(0)
        info = await state.blocking(
            functools.partial(
                state.manager.audited,
                principal,
                entry,
                "write",
                path,
                entry.sandbox.files.write,
                path,
                spool,
                metadata,
                size=size,
            )
        )
    return {"name": info.name, "type": info.type, "path": info.path, "metadata": info.metadata}


@router.get(
    "/v1/sandboxes/{sandbox_id}/files",
    tags=["files"],
    response_class=StreamingResponse,
    responses=_BYTES_DOC,
)
async def read_file(
    request: Request, entry: Owned, path: Annotated[str, Query(min_length=1)]
) -> StreamingResponse:
    """Download a file (streamed)."""
    return await download(state_of(request), entry, path, principal=principal_of(request))


@router.post(
    "/v1/sandboxes/{sandbox_id}/files",
    tags=["files"],
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "required": True,
        }
    },
)
async def write_file(
    request: Request, entry: Owned, path: Annotated[str, Query(min_length=1)]
) -> WriteResult:
    """Upload a file: the request body is its bytes (streamed). ``X-Metadata-<key>:
    <value>`` headers are the file's metadata (replacing what it had)."""
    state = state_of(request)
    metadata = upload_metadata(request)
    principal = principal_of(request)
    return WriteResult(
        **await upload(state, entry, path, request.stream(), metadata, principal=principal)
    )


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
async def remove_file(
    request: Request, entry: Owned, path: Annotated[str, Query(min_length=1)]
) -> None:
    manager = state_of(request).manager
    await state_of(request).blocking(
        manager.audited,
        principal_of(request),
        entry,
        "remove",
        path,
        entry.sandbox.files.remove,
        path,
    )


def _entry(info: EntryInfo) -> Entry:
    fields = dataclasses.asdict(info)
    fields["type"] = info.type.value if info.type is not None else None
    return Entry(**fields)


@router.get("/v1/sandboxes/{sandbox_id}/files/list", tags=["files"])
async def list_files(
    request: Request,
    entry: Owned,
    path: Annotated[str, Query(min_length=1)] = ".",
    depth: Annotated[int, Query(ge=1, le=64)] = 1,
) -> list[Entry]:
    entries = await state_of(request).blocking(entry.sandbox.files.list, path, depth)
    return [_entry(item) for item in entries]


@router.get("/v1/sandboxes/{sandbox_id}/files/info", tags=["files"])
async def file_info(
    request: Request, entry: Owned, path: Annotated[str, Query(min_length=1)]
) -> Entry:
    return _entry(await state_of(request).blocking(entry.sandbox.files.get_info, path))


@router.post("/v1/sandboxes/{sandbox_id}/files/mkdir", tags=["files"])
async def make_dir(
    request: Request, entry: Owned, path: Annotated[str, Query(min_length=1)]
) -> JSONResponse:
    manager = state_of(request).manager
    created = await state_of(request).blocking(
        manager.audited,
        principal_of(request),
        entry,
        "mkdir",
        path,
        entry.sandbox.files.make_dir,
        path,
    )
    return JSONResponse({"created": created})


@router.post("/v1/sandboxes/{sandbox_id}/files/rename", tags=["files"])
async def rename(request: Request, entry: Owned, body: Rename) -> Entry:
    state = state_of(request)
    info = await state.blocking(
        functools.partial(
            state.manager.audited,
            principal_of(request),
            entry,
            "rename",
            body.old_path,
            entry.sandbox.files.rename,
            body.old_path,
            body.new_path,
            destination=body.new_path,
        )
    )
    return _entry(info)


class WatchIn(Strict):
    path: str = Field(..., min_length=1)
    recursive: bool = False
    include_entry: bool = False


@router.post(
    "/v1/sandboxes/{sandbox_id}/files/watch",
    tags=["files"],
    response_class=StreamingResponse,
    responses=_NDJSON_DOC,
)
async def watch_dir(request: Request, entry: Owned, body: WatchIn) -> StreamingResponse:
    """Watch a directory: ``started``, then one ``event`` {name, event_type} per change
    (with ``include_entry``, its ``entry`` when it still exists), then ``end`` when the
    directory goes away. Closing the stream stops the watch. The
    sandbox's cap on watches bounds these streams (WatchLimitError past it)."""
    state = state_of(request)
    ready = threading.Event()
    gone = threading.Event()
    sink: list[Callable[[dict[str, Any] | None], None]] = []

    def forward(event: FilesystemEvent) -> None:
        # The watch starts before the stream does: hold its first events until then.
        ready.wait()
        if not gone.is_set():
            message: dict[str, Any] = {"type": "event", "name": event.name}
            message["event_type"] = event.type
            if event.entry is not None:
                message["entry"] = _entry(event.entry).model_dump()
            sink[0](message)

    handle = await state.blocking(
        entry.sandbox.files.watch_dir, body.path, forward, body.recursive, body.include_entry
    )

    def work(push: Any) -> None:
        state.manager.touch(entry, +1)
        try:
            push({"type": "started"})
            sink.append(push)
            ready.set()
            handle.wait()
            push({"type": "end"})
        finally:
            state.manager.touch(entry, -1)
            push(None)

    def abandon() -> None:
        gone.set()
        ready.set()
        handle.stop()

    stream = ndjson(
        work, _STREAM_THREADS, abandon, stall_seconds=state.settings.client_stall_timeout
    )
    return StreamingResponse(stream, media_type=NDJSON)


# --- commands ---------------------------------------------------------------------------


@router.post(
    "/v1/sandboxes/{sandbox_id}/commands",
    tags=["commands"],
    response_class=StreamingResponse,
    responses=_NDJSON_DOC,
)
async def run_command(request: Request, entry: Owned, body: RunCommand) -> StreamingResponse:
    """Run a shell command; stdout/stderr stream as NDJSON, then ``end_of_command``."""
    state = state_of(request)
    if not body.cmd.strip():
        raise InvalidArgumentError("cmd must be a non-empty string")
    envs = check_envs(body.envs)
    cwd = check_path(body.cwd) if body.cwd else None
    timeout = _within_cell_ceiling(
        state,
        entry.tenant,
        seconds(body.timeout) if body.timeout is not None else DEFAULT_COMMAND_TIMEOUT,
        "timeout" not in body.model_fields_set or body.timeout is None,
    )
    # Recorded before it runs: a command the audit cannot record does not run.
    operation_id = await state.blocking(
        state.manager.operation_started, principal_of(request), entry, "command", body.cmd
    )

    def work(push: Any) -> None:
        state.manager.touch(entry, +1)
        outcome: dict[str, Any] = {"outcome": "error", "error_name": "ServerError"}
        try:
            result = entry.sandbox.commands.run(
                body.cmd,
                cwd=cwd,
                envs=envs,
                timeout=timeout,
                # Forwarded, not also kept: the result's stdout/stderr go unused here.
                on_stdout=stream_only(lambda m: push({"type": "stdout", "text": m.line})),
                on_stderr=stream_only(lambda m: push({"type": "stderr", "text": m.line})),
            )
            outcome = {"outcome": "ok", "exit_code": result.exit_code, "error_name": result.error}
            push({"type": "end_of_command", "exit_code": result.exit_code, "error": result.error})
        except SandlotError as exc:  # typed for the client; the command did not run
            outcome["error_name"] = type(exc).__name__
            push({"type": "end_of_command", "exception": exception_message(exc)})
        finally:
            state.manager.operation_finished(operation_id, **outcome)
            state.manager.touch(entry, -1)
            push(None)

    stream = ndjson(
        work, state.executor, lambda: None, stall_seconds=state.settings.client_stall_timeout
    )
    return StreamingResponse(stream, media_type=NDJSON)


# --- background processes -----------------------------------------------------------------


class StartProcess(Strict):
    cmd: str = ""
    cwd: str | None = None
    envs: dict[str, str] | None = None
    timeout: float | None = Field(
        60.0, ge=0, le=MAX_CELL_TIMEOUT, description="Seconds until it is killed; 0: no limit."
    )
    stdin: bool = False
    pty: PtySizeIn | None = None


class PtySizeIn(Strict):
    rows: int = Field(..., gt=0, le=4096)
    cols: int = Field(..., gt=0, le=4096)


class ProcessInfoOut(BaseModel):
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None


class StdinIn(Strict):
    data: str = Field(..., description="Base64 of the bytes to write.", max_length=8 * MiB)


StartProcess.model_rebuild()


class _OwnThread(Executor):
    """Runs each process stream on a thread of its own, not in the server's worker
    pool: a stream lasts as long as its process, and a tenant's many long streams
    must not take the workers other tenants' cells wait for. Bounded by the runner
    (streams per process) and by the process and sandbox quotas."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)

        threading.Thread(target=run, name="sandlot-process-stream", daemon=True).start()
        return future


_STREAM_THREADS = _OwnThread()


def _process_stream(
    state: ServerState, entry: ManagedSandbox, handle: Any, operation_id: str | None = None
) -> StreamingResponse:
    """Stream a CommandHandle as NDJSON: ``started``, ``stdout``/``stderr``/``pty``
    (base64), then ``end`` (``exit_code``, ``error``). Disconnecting detaches; the
    process runs on. With ``operation_id`` (the stream that started it), an end it
    sees is recorded in that operation's row."""

    def work(push: Any) -> None:
        state.manager.touch(entry, +1)
        try:
            push({"type": "started", "pid": handle.pid})
            for stdout, stderr, pty in handle:
                if stdout is not None:
                    push({"type": "stdout", "text": stdout})
                elif stderr is not None:
                    push({"type": "stderr", "text": stderr})
                elif pty is not None:
                    push({"type": "pty", "data": base64.b64encode(pty).decode("ascii")})
            if handle.exit_code is not None:
                if operation_id is not None:
                    state.manager.operation_finished(
                        operation_id,
                        "ok",
                        pid=handle.pid,
                        exit_code=handle.exit_code,
                        error_name=handle.error,
                    )
                push({"type": "end", "exit_code": handle.exit_code, "error": handle.error})
        except SandlotError as exc:
            push({"type": "end", "exception": exception_message(exc)})
        finally:
            state.manager.touch(entry, -1)
            push(None)

    stream = ndjson(
        work,
        _STREAM_THREADS,
        handle.disconnect,
        stall_seconds=state.settings.client_stall_timeout,
    )
    return StreamingResponse(stream, media_type=NDJSON)


@router.post(
    "/v1/sandboxes/{sandbox_id}/processes",
    tags=["commands"],
    response_class=StreamingResponse,
    responses=_NDJSON_DOC,
)
async def start_process(request: Request, entry: Owned, body: StartProcess) -> StreamingResponse:
    """Start a background command (or, with ``pty``, a terminal running bash); its
    events stream as NDJSON. Closing the stream leaves the process running."""
    state = state_of(request)
    start: Callable[[], Any]
    if body.pty is None:
        if not body.cmd.strip():
            raise InvalidArgumentError("cmd must be a non-empty string")
        start = functools.partial(
            entry.sandbox.commands.run,
            body.cmd,
            body.cwd,
            body.envs,
            body.timeout,
            background=True,
            stdin=body.stdin,
        )
    else:
        start = functools.partial(
            entry.sandbox.pty.create,
            PtySize(rows=body.pty.rows, cols=body.pty.cols),
            body.cwd,
            body.envs,
            body.timeout,
        )
    kind, line = ("process", body.cmd) if body.pty is None else ("pty", None)
    operation_id, handle = await state.blocking(
        state.manager.start_audited, principal_of(request), entry, kind, line, start
    )
    return _process_stream(state, entry, handle, operation_id)


@router.get("/v1/sandboxes/{sandbox_id}/processes", tags=["commands"])
async def list_processes(request: Request, entry: Owned) -> list[ProcessInfoOut]:
    items = await state_of(request).blocking(entry.sandbox.commands.list)
    return [ProcessInfoOut(**dataclasses.asdict(item)) for item in items]


@router.get(
    "/v1/sandboxes/{sandbox_id}/processes/{pid}",
    tags=["commands"],
    response_class=StreamingResponse,
    responses=_NDJSON_DOC,
)
async def connect_process(
    request: Request, entry: Owned, pid: Annotated[int, FastPath(gt=0)]
) -> StreamingResponse:
    """Reattach: the output the sandbox still keeps (a bounded ring), then live output."""
    state = state_of(request)
    handle = await state.blocking(entry.sandbox.commands.connect, pid)
    return _process_stream(state, entry, handle)


@router.delete("/v1/sandboxes/{sandbox_id}/processes/{pid}", tags=["commands"])
async def kill_process(
    request: Request, entry: Owned, pid: Annotated[int, FastPath(gt=0)]
) -> JSONResponse:
    """Kill the process group and every descendant; ``killed`` false if not running."""
    state = state_of(request)
    killed = await state.blocking(
        functools.partial(
            state.manager.audited,
            principal_of(request),
            entry,
            "kill",
            None,
            entry.sandbox.commands.kill,
            pid,
            pid=pid,
        )
    )
    return JSONResponse({"killed": killed})


@router.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin", status_code=204, tags=["commands"])
async def send_process_stdin(
    request: Request, entry: Owned, pid: Annotated[int, FastPath(gt=0)], body: StdinIn
) -> None:
    try:
        data = base64.b64decode(body.data, validate=True)
    except ValueError:
        raise InvalidArgumentError("data must be base64") from None
    state = state_of(request)
    await state.blocking(
        functools.partial(
            state.manager.audited,
            principal_of(request),
            entry,
            "stdin",
            None,
            entry.sandbox.commands.send_stdin,
            pid,
            data,
            pid=pid,
            size=len(data),
        )
    )


@router.post(
    "/v1/sandboxes/{sandbox_id}/processes/{pid}/close-stdin", status_code=204, tags=["commands"]
)
async def close_process_stdin(
    request: Request, entry: Owned, pid: Annotated[int, FastPath(gt=0)]
) -> None:
    await state_of(request).blocking(entry.sandbox.commands.close_stdin, pid)


@router.post(
    "/v1/sandboxes/{sandbox_id}/processes/{pid}/resize", status_code=204, tags=["commands"]
)
async def resize_pty(
    request: Request, entry: Owned, pid: Annotated[int, FastPath(gt=0)], body: PtySizeIn
) -> None:
    size = PtySize(rows=body.rows, cols=body.cols)
    await state_of(request).blocking(entry.sandbox.pty.resize, pid, size)
