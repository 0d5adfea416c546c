"""Routes for the unmodified ``e2b_code_interpreter`` client.

In debug mode (``E2B_DEBUG=true``) that client sends both its code-interpreter calls
(``POST /execute``, ``/contexts``) and its envd file calls (``GET/POST /files``) to
``E2B_SANDBOX_URL``, with that URL's path as a prefix. So sandlot serves them under:

* ``/e2b/...``: the tenant's default sandbox, created on first use (and again after
  the idle TTL reaped it);
* ``/e2b/sandboxes/{sandbox_id}/...``: a sandbox created with ``POST /v1/sandboxes``.

The key travels as the password of the URL
(``E2B_SANDBOX_URL=http://sandlot:KEY@127.0.0.1:8000/e2b``), which the client's HTTP
stack turns into an ``Authorization: Basic`` header.

envd's Connect services (``files.list/exists/get_info/make_dir/rename/remove``,
``commands.run``) are served under the same prefixes by
:class:`sandlot.server._e2b_plane.E2bWire`. E2B's normal mode (a control plane, no
debug flag) is :mod:`sandlot.server._e2b_control` and :mod:`sandlot.server._e2b_plane`.
"""

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from sandlot import InvalidArgumentError
from sandlot.server._manager import ManagedSandbox
from sandlot.server._routes import (
    _BYTES_DOC,
    _NDJSON_DOC,
    ContextInfo,
    CreateContext,
    Execute,
    WriteResult,
    create_context,
    download,
    execute,
    leased,
    list_contexts,
    sandbox_of,
    upload,
    upload_metadata,
)
from sandlot.server._state import authenticate, state_of
from sandlot.server._store import Principal

Auth = Annotated[Principal, Depends(authenticate)]
DEBUG_SANDBOX_ID = "debug_sandbox_id"
"""The id the E2B SDK sends in debug mode, where it has no sandbox id of its own."""


async def _default_sandbox(request: Request, principal: Auth) -> AsyncIterator[ManagedSandbox]:
    """The tenant's default sandbox; or, once the client connected to a sandbox by id
    (``Sandbox.connect(id)`` sends it as ``E2b-Sandbox-Id``), that one, and 404 if it
    does not exist (never the default sandbox in its place)."""
    state = state_of(request)
    named = request.headers.get("e2b-sandbox-id")
    if named and named != DEBUG_SANDBOX_ID:
        entry = state.manager.lease(principal, named)
    else:
        entry = await state.blocking(state.manager.tenant_default, principal)
    async with leased(request, entry) as e:
        yield e


def e2b_routers() -> list[APIRouter]:
    return [
        _router("/e2b", _default_sandbox, "e2b (default sandbox)"),
        _router("/e2b/sandboxes/{sandbox_id}", sandbox_of, "e2b (named sandbox)"),
    ]


def _router(
    prefix: str, resolve: Callable[..., AsyncIterator[ManagedSandbox]], tag: str
) -> APIRouter:
    router = APIRouter(prefix=prefix, tags=[tag])
    Target = Annotated[ManagedSandbox, Depends(resolve)]
    suffix = "named" if "{" in prefix else "default"

    @router.get("/health", status_code=204, operation_id=f"e2b_health_{suffix}")
    async def health(entry: Target) -> None:
        """envd's health check."""

    @router.post(
        "/execute",
        response_class=StreamingResponse,
        responses=_NDJSON_DOC,
        operation_id=f"e2b_execute_{suffix}",
    )
    async def run(
        request: Request, entry: Target, body: Execute, principal: Auth
    ) -> StreamingResponse:
        state = state_of(request)
        return await execute(
            state, principal, entry, body, state.settings.e2b_cell_timeout, e2b_result
        )

    @router.post("/contexts", operation_id=f"e2b_create_context_{suffix}")
    async def new_context(request: Request, entry: Target, body: CreateContext) -> ContextInfo:
        return ContextInfo(**await create_context(state_of(request), entry, body))

    @router.get("/contexts", operation_id=f"e2b_list_contexts_{suffix}")
    async def contexts(request: Request, entry: Target) -> list[ContextInfo]:
        return [ContextInfo(**item) for item in await list_contexts(state_of(request), entry)]

    @router.post(
        "/contexts/{context_id}/restart",
        status_code=204,
        operation_id=f"e2b_restart_context_{suffix}",
    )
    async def restart(request: Request, entry: Target, context_id: str) -> None:
        await state_of(request).blocking(entry.sandbox.restart_code_context, context_id)

    @router.delete(
        "/contexts/{context_id}", status_code=204, operation_id=f"e2b_remove_context_{suffix}"
    )
    async def remove(request: Request, entry: Target, context_id: str) -> None:
        await state_of(request).blocking(entry.sandbox.remove_code_context, context_id)

    @router.get(
        "/files",
        response_class=StreamingResponse,
        responses=_BYTES_DOC,
        operation_id=f"e2b_read_file_{suffix}",
    )
    async def read(
        request: Request,
        entry: Target,
        principal: Auth,
        path: Annotated[str, Query(min_length=1)],
    ) -> StreamingResponse:
        return await download(state_of(request), entry, path, principal=principal)

    @router.post(
        "/files",
        operation_id=f"e2b_write_files_{suffix}",
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "properties": {"file": {"type": "string", "format": "binary"}},
                        }
                    },
                },
                "required": True,
            }
        },
    )
    async def write(
        request: Request,
        entry: Target,
        principal: Auth,
        path: Annotated[str | None, Query(min_length=1)] = None,
    ) -> list[WriteResult]:
        """envd's upload: an ``application/octet-stream`` body for ``path``, or
        ``multipart/form-data`` with one ``file`` part per file (named by its filename)."""
        state = state_of(request)
        metadata = upload_metadata(request)  # the same for every file of the upload
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            if path is None:
                raise InvalidArgumentError("path is required for an octet-stream upload")
            info = await upload(state, entry, path, request.stream(), metadata, principal=principal)
            return [WriteResult(**info)]
        written: list[WriteResult] = []
        async with request.form() as form:
            files = [part for part in form.getlist("file") if isinstance(part, UploadFile)]
            if not files:
                raise InvalidArgumentError("a multipart upload needs at least one 'file' part")
            for part in files:
                target = path if path is not None and len(files) == 1 else part.filename
                if not target:
                    raise InvalidArgumentError("each uploaded file needs a path (its filename)")
                info = await upload(
                    state, entry, target, _parts(part), metadata, principal=principal
                )
                written.append(WriteResult(**info))
        return written

    _ = (health, run, new_context, contexts, restart, remove, read, write)
    return router


_CHART_KEYS = ("title", "x_label", "y_label", "x_unit", "y_unit")
_AXIS_KEYS = ("x_ticks", "x_tick_labels", "y_ticks", "y_tick_labels")
_ELEMENT_KEYS = {
    "pie": ("label", "angle", "radius"),
    "box_and_whisker": ("label", "min", "first_quartile", "median", "third_quartile", "max"),
}


def e2b_chart(chart: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys the E2B client's chart classes index without a default.

    The runner already sends every chart in E2B's shape (``sandlot.runner._charts``);
    this keeps a result from an older runner, or a hand-made one, from failing the
    client's deserialisation."""
    chart = {**chart, "elements": list(chart.get("elements") or [])}
    chart.setdefault("type", "unknown")
    for key in _CHART_KEYS:
        chart.setdefault(key, None)
    if chart["type"] in ("line", "scatter"):
        for key in _AXIS_KEYS:
            chart.setdefault(key, [])
        chart["elements"] = [
            {"label": e.get("label"), "points": e.get("points") or [], **e}
            for e in chart["elements"]
            if isinstance(e, dict)
        ]
    elif chart["type"] == "bar":
        chart["elements"] = [
            {"label": e.get("label"), "value": e.get("value"), "group": e.get("group"), **e}
            for e in chart["elements"]
            if isinstance(e, dict)
        ]
    elif chart["type"] in _ELEMENT_KEYS:
        chart["elements"] = [
            {**dict.fromkeys(_ELEMENT_KEYS[chart["type"]]), **e}
            for e in chart["elements"]
            if isinstance(e, dict)
        ]
    elif chart["type"] == "superchart":
        chart["elements"] = [e2b_chart(e) for e in chart["elements"] if isinstance(e, dict)]
    return chart


def e2b_data(data: dict[str, Any]) -> dict[str, Any]:
    """sandlot's table (``{columns, index, data, ...}``) as the E2B client reads
    ``Result.data``: one list of values per column, keyed by the column's name.

    Keys are strings (JSON's); a tuple-named column (a MultiIndex) is keyed by its
    ``str``. The rows are those sandlot keeps (the head of a long frame)."""
    if data.get("type") != "dataframe":
        return data
    columns = data.get("columns")
    rows = data.get("data")
    if not isinstance(columns, list) or not isinstance(rows, list):
        return data
    return {
        (c if isinstance(c, str) else str(tuple(c)) if isinstance(c, list) else str(c)): [
            row[i] for row in rows if isinstance(row, list) and i < len(row)
        ]
        for i, c in enumerate(columns)
    }


def e2b_text(text: str) -> str:
    """The text of a result as the E2B client gets it: the code interpreter drops one
    pair of enclosing quotes from a repr (``'bar'`` -> ``bar``), so a cell ending in a
    string reads as that string."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def e2b_result(message: dict[str, Any]) -> dict[str, Any]:
    """A sandlot result message in the E2B client's shape (charts, data, text)."""
    if message.get("type") != "result":
        return message
    message = dict(message)
    chart = message.get("chart")
    if isinstance(chart, dict):
        message["chart"] = e2b_chart(chart)
    data = message.get("data")
    if isinstance(data, dict):
        message["data"] = e2b_data(data)
    text = message.get("text")
    if isinstance(text, str):
        message["text"] = e2b_text(text)
    return message


async def _parts(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(1024 * 1024):
        yield chunk
