"""Result types: what ``run_code``, ``commands.run`` and ``files.*`` return.

They mirror ``e2b_code_interpreter`` (names, fields, units) so that code written
for E2B reads the same against sandlot. Everything here is a plain value: no I/O,
no reference to a live sandbox.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from sandlot._exceptions import SandlotError
from sandlot.precheck import PrecheckReport

ExecutionStatus = Literal["ok", "error", "timeout", "oom", "interrupted", "died"]
"""How a cell ended. ``error`` is an exception in user code; the others are limits or
crashes, each also reported as an :class:`ExecutionError` with a distinct ``name``."""

# MIME type -> Result attribute. Order is the order of ``Result.formats()``.
MIME_FIELDS: dict[str, str] = {
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "application/vnd.sandlot.data+json": "data",
    "application/vnd.sandlot.chart+json": "chart",
}


@dataclass(slots=True)
class OutputMessage:
    """One chunk of stdout or stderr, as passed to ``on_stdout`` / ``on_stderr``."""

    line: str
    timestamp: int = field(default_factory=time.time_ns)
    """Unix time in nanoseconds when the host received the chunk."""
    error: bool = False
    """True for stderr."""

    def __str__(self) -> str:
        return self.line


@dataclass(slots=True)
class Result:
    """One rich output of a cell: a MIME bundle, as in Jupyter.

    A cell's last expression becomes the *main result* (``is_main_result``); every
    ``display(obj)`` call and every matplotlib figure adds another result. Binary
    formats (``png``, ``jpeg``, ``pdf``) are base64 strings.
    """

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: dict[str, Any] | list[Any] | None = None
    javascript: str | None = None
    data: dict[str, Any] | None = None
    """Structured data, e.g. a DataFrame as ``{"columns", "index", "data", "dtypes"}``."""
    chart: dict[str, Any] | None = None
    """A matplotlib figure's data, the dict E2B's code interpreter sends as ``chart``:
    ``type`` (line, scatter, bar, pie, box_and_whisker, superchart, unknown), ``title``,
    ``elements`` and per type labels, units, ticks and scales (docs/protocol.md)."""
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """MIME types that have no field of their own."""

    @classmethod
    def from_bundle(cls, bundle: Mapping[str, Any], *, is_main_result: bool = False) -> Result:
        """Build a Result from a MIME bundle (``{"text/plain": ..., "image/png": ...}``)."""
        result = cls(is_main_result=is_main_result)
        for mime, value in bundle.items():
            if mime == "text/plain":
                result.text = str(value)
            elif mime in MIME_FIELDS:
                setattr(result, MIME_FIELDS[mime], value)
            else:
                result.extra[mime] = value
        return result

    def formats(self) -> list[str]:
        """The formats this result carries besides ``text`` (e.g. ``["html", "data"]``)."""
        names = [name for name in MIME_FIELDS.values() if getattr(self, name) is not None]
        return names + list(self.extra)

    def __str__(self) -> str:
        return self.text or ""

    def _repr_html_(self) -> str | None:
        return self.html

    def _repr_png_(self) -> str | None:
        return self.png

    def to_dict(self) -> dict[str, Any]:
        """The non-empty fields, as JSON-ready data."""
        out: dict[str, Any] = {"is_main_result": self.is_main_result}
        if self.text is not None:
            out["text"] = self.text
        for name in self.formats():
            out[name] = self.extra[name] if name in self.extra else getattr(self, name)
        return out


@dataclass(slots=True)
class Logs:
    """Everything a cell printed, as the chunks arrived."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ExecutionError:
    """An error in a cell: an exception from user code, or a limit the cell hit.

    ``name`` is the exception class (``"ZeroDivisionError"``) or one of sandlot's
    outcome names: ``"TimeoutError"``, ``"OutOfMemoryError"``, ``"KernelDiedError"``,
    ``"SandboxLostError"``, ``"KeyboardInterrupt"``, ``"PrecheckRefused"`` (the
    pre-check policy refused the cell; nothing ran).
    """

    name: str
    value: str
    traceback: str = ""

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "value": self.value, "traceback": self.traceback})


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A snapshot of a sandbox (``Sandbox.create_snapshot()``): start any number of new
    sandboxes from it with ``Sandbox.create(snapshot_id)``."""

    snapshot_id: str
    names: list[str] = field(default_factory=list)
    """The name it was given (``create_snapshot(name=...)``), if any."""


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """What the whole sandbox used, read from its cgroup (None: not measured here)."""

    memory_peak_bytes: int | None = None
    """Highest memory use of the sandbox since it started."""
    memory_limit_bytes: int | None = None
    oom_kills: int = 0
    """Processes the kernel killed for the memory limit since the sandbox started."""
    cpu_seconds: float | None = None
    """CPU time of every process in the sandbox since it started."""
    pids: int | None = None
    """Processes and threads alive when measured."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_peak_bytes": self.memory_peak_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "oom_kills": self.oom_kills,
            "cpu_seconds": self.cpu_seconds,
            "pids": self.pids,
        }


NetworkVerdict = Literal["allowed", "refused", "failed"]
"""``allowed``: the proxy connected and relayed; ``refused``: the network policy (or a
cap) said no, and the code got HTTP 403 with the reason; ``failed``: allowed, but the
name did not resolve or the destination did not answer (HTTP 502)."""


@dataclass(frozen=True, slots=True)
class NetworkEvent:
    """One connection a sandbox asked the egress proxy for, as the host recorded it."""

    sandbox: str
    """The sandbox's id (the proxy knows it by the socket it came in on, nothing else)."""
    host: str
    """The name or IP literal the sandbox asked for."""
    port: int
    verdict: NetworkVerdict
    reason: str
    """Why: the policy entry that allowed or refused it, a cap, or the error."""
    address: str | None = None
    """The address connected to (resolved on the host), when there was one."""
    bytes_in: int = 0
    """Bytes relayed to the sandbox."""
    bytes_out: int = 0
    """Bytes relayed from the sandbox to the destination."""
    method: str = ""
    """``CONNECT`` (a tunnel, e.g. TLS) or the method of a plain-HTTP request."""
    time: float = 0.0
    """Unix time when the request arrived."""
    count: int = 1
    """How many connections this record stands for: 1, or, for a summary (``method``
    ``SUMMARY``: the rate limit on refusal records, or a full record list), how many it
    folds together; its ``time`` is the first one's, ``host``, ``port`` and ``reason``
    name the last one, and the byte counts are summed."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandbox,
            "host": self.host,
            "port": self.port,
            "verdict": self.verdict,
            "reason": self.reason,
            "address": self.address,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "method": self.method,
            "time": self.time,
            "count": self.count,
        }


@dataclass(slots=True)
class Execution:
    """The outcome of one ``run_code`` call. User-code failures are data, not exceptions."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None
    status: ExecutionStatus = "ok"
    """``ok``, ``error`` (exception in user code), ``timeout``, ``oom``, ``interrupted``,
    or ``died`` (the kernel or the sandbox itself went away)."""
    duration: float = 0.0
    """Wall-clock seconds from request to the last event, measured on the host."""
    truncated: bool = False
    """True when output went over the sandbox's output limit and was cut."""
    usage: ResourceUsage | None = None
    """The sandbox's resource use when the cell ended (cgroup backends), with
    ``cpu_seconds`` for this cell alone."""
    precheck: PrecheckReport | None = None
    """The advisory static report on the code that ran (see :mod:`sandlot.precheck`);
    None when the sandbox's ``precheck`` policy is ``"off"``."""
    network: list[NetworkEvent] | None = None
    """Connections through the egress proxy that ended during the cell (allowed,
    refused or failed); None when the sandbox has no network policy."""

    @property
    def text(self) -> str | None:
        """The text of the main result (the cell's last expression), if any."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None

    def raise_for_error(self) -> None:
        """Raise :class:`sandlot.ExecutionFailed` if the cell did not succeed."""
        if self.error is not None:
            raise ExecutionFailed(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [r.to_dict() for r in self.results],
            "logs": {"stdout": self.logs.stdout, "stderr": self.logs.stderr},
            "error": None
            if self.error is None
            else {
                "name": self.error.name,
                "value": self.error.value,
                "traceback": self.error.traceback,
            },
            "execution_count": self.execution_count,
            "status": self.status,
            "duration": self.duration,
            "truncated": self.truncated,
            "usage": None if self.usage is None else self.usage.to_dict(),
            "precheck": None if self.precheck is None else self.precheck.to_dict(),
            "network": None if self.network is None else [e.to_dict() for e in self.network],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@dataclass(slots=True)
class CommandResult:
    """The outcome of ``commands.run``: a non-zero exit code is data, not an exception."""

    stdout: str
    stderr: str
    exit_code: int
    """The command's exit status; ``-N`` when killed by signal N; ``-1`` on timeout."""
    error: str | None = None
    """Why the command did not finish normally (timeout, output limit), else None."""


@dataclass(slots=True, frozen=True)
class ProcessInfo:
    """A background command or terminal running in the sandbox (``commands.list()``)."""

    pid: int
    """Its pid inside the sandbox (what ``commands.kill/connect/send_stdin`` take)."""
    tag: str | None
    """A label given at start, else None."""
    cmd: str
    """The program: ``/bin/sh`` for a command (``/bin/bash`` for a terminal)."""
    args: list[str]
    """Its arguments: ``["-c", <the command line>]`` for a command."""
    envs: dict[str, str]
    """The environment variables given at start (not the sandbox's own)."""
    cwd: str | None
    """Its working directory."""


@dataclass(slots=True, frozen=True)
class PtySize:
    """A terminal's size in characters."""

    rows: int
    cols: int


class FileType(StrEnum):
    FILE = "file"
    DIR = "dir"


@dataclass(slots=True, frozen=True)
class EntryInfo:
    """A file or directory inside the sandbox."""

    name: str
    type: FileType | None
    path: str
    size: int = 0
    mode: int = 0
    permissions: str = ""
    modified_time: float = 0.0
    symlink_target: str | None = None
    metadata: dict[str, str] | None = None
    """The file's metadata (``files.write(..., metadata=...)``, or ``user.e2b.*``
    extended attributes set in the sandbox); None when it has none."""


@dataclass(slots=True, frozen=True)
class WriteInfo:
    name: str
    type: FileType | None
    path: str
    metadata: dict[str, str] | None = None
    """The metadata the file was written with, as stored; None when none."""


@dataclass(slots=True, frozen=True)
class Context:
    """A code context: its own interpreter state (variables, imports, cwd)."""

    id: str
    language: str
    cwd: str


def context_from_wire(value: Mapping[str, Any]) -> Context:
    return Context(id=str(value["id"]), language=str(value["language"]), cwd=str(value["cwd"]))


def entries_from_wire(items: Iterable[Mapping[str, Any]]) -> list[EntryInfo]:
    return [entry_from_wire(item) for item in items]


def entry_from_wire(item: Mapping[str, Any]) -> EntryInfo:
    kind = item.get("type")
    return EntryInfo(
        name=str(item.get("name", "")),
        type=FileType(kind) if kind in ("file", "dir") else None,
        path=str(item.get("path", "")),
        size=int(item.get("size", 0)),
        mode=int(item.get("mode", 0)),
        permissions=str(item.get("permissions", "")),
        modified_time=float(item.get("modified_time", 0.0)),
        symlink_target=item.get("symlink_target"),
        metadata=metadata_from_wire(item.get("metadata")),
    )


def event_entry(value: Any) -> EntryInfo | None:
    """The ``entry`` of a watch event from a runner or server (untrusted): None when it
    has none, or none that reads as an entry."""
    if not isinstance(value, Mapping):
        return None
    try:
        return entry_from_wire(value)
    except (TypeError, ValueError):
        return None


def metadata_from_wire(value: Any) -> dict[str, str] | None:
    """A file's metadata as a runner or server reported it (untrusted: only its shape is
    kept, strings to strings); None when there is none."""
    if not isinstance(value, Mapping) or not value:
        return None
    return {str(key): str(item) for key, item in value.items()}


class ExecutionFailed(SandlotError):
    """Raised by :meth:`Execution.raise_for_error`; carries the execution.

    It lives here, not in :mod:`sandlot._exceptions`, because it holds an
    :class:`Execution`: the exception tree stays free of sandlot imports and the two
    modules do not import each other."""

    def __init__(self, execution: Execution) -> None:
        error = execution.error
        detail = f"{error.name}: {error.value}" if error else execution.status
        super().__init__(f"cell failed ({execution.status}): {detail}")
        self.execution = execution


def process_from_wire(item: dict[str, Any]) -> ProcessInfo:
    """A ``process_list`` entry (runner or server JSON) as a ProcessInfo."""
    tag = item.get("tag")
    cwd = item.get("cwd")
    return ProcessInfo(
        pid=int(item["pid"]),
        tag=str(tag) if tag is not None else None,
        cmd=str(item.get("cmd", "")),
        args=[str(a) for a in item.get("args") or []],
        envs={str(k): str(v) for k, v in (item.get("envs") or {}).items()},
        cwd=str(cwd) if cwd is not None else None,
    )
