"""``Sandbox`` and ``AsyncSandbox``: the SDK face, shaped like ``e2b_code_interpreter``.

All logic lives in :class:`_Core` (synchronous, thread-safe): validation, defaults,
starting and restarting the sandbox, timeouts, folding events into results.
``Sandbox`` calls it directly; ``AsyncSandbox`` runs the same calls in a worker
thread and delivers callbacks on the event loop. The twins differ only in I/O, so
they cannot drift in behaviour.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import inspect
import io
import itertools
import math
import numbers
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, get_args, overload

from sandlot._exceptions import (
    ContextNotFoundError,
    FileOperationError,
    InvalidArgumentError,
    NotFoundError,
    PathNotAllowedError,
    SandboxClosed,
    SandboxLost,
    SandlotError,
)
from sandlot._fold import Callbacks, CommandBuilder, ExecutionBuilder
from sandlot._models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    OutputMessage,
    ResourceUsage,
    Result,
    WriteInfo,
    entries_from_wire,
    entry_from_wire,
)
from sandlot.backends import Backend, EventStream, SandboxHandle, get_backend
from sandlot.policy import MiB, NetworkPolicy, Resources, SandboxSpec
from sandlot.pool import Pool, default_pool
from sandlot.precheck import PrecheckReport, check
from sandlot.protocol import CHUNK_BYTES, NAME_MAX, PATH_MAX, WORKSPACE_ROOTS

DEFAULT_CELL_TIMEOUT = 60.0
"""Seconds a cell may run when ``run_code(timeout=None)``."""
DEFAULT_COMMAND_TIMEOUT = 60.0
DEFAULT_SANDBOX_TIMEOUT = 300
"""Seconds a sandbox lives unless ``timeout`` says otherwise (as E2B)."""
REQUEST_TIMEOUT = 60.0
"""Seconds to wait for a file or context operation."""
if TYPE_CHECKING:
    import asyncio  # imported where an AsyncSandbox method runs: `import sandlot` stays light

HOST_BACKSTOP = 5.0
"""Extra seconds the host waits past a cell's timeout (the runner's own kill takes ~1 s)
before it stops trusting the runner and destroys the whole sandbox."""
DEFAULT_CONTEXT = "default"
OOM_POLL = 0.2
"""Seconds between checks of the sandbox's out-of-memory counter while a cell runs."""
NETWORK_SETTLE = 1.0
"""Seconds a finished cell waits for its egress connections to be closed, so that
their records (with byte counts) land on its Execution rather than the next one."""

PrecheckMode = Literal["off", "report", "approve", "refuse"]
"""What ``run_code`` does with the advisory :func:`sandlot.precheck.check` report:
``off`` skips it; ``report`` (default) attaches it to the Execution; ``approve`` asks
``on_precheck`` about flagged cells; ``refuse`` refuses flagged cells."""
PrecheckHook = Callable[[str, PrecheckReport], "bool | str"]
"""``on_precheck(code, report)``: True runs the cell, False refuses it, a str runs that
code instead (an edit). Called only for flagged cells, in ``approve`` mode."""


@dataclass(frozen=True, slots=True)
class _PrecheckPolicy:
    """How ``run_code`` uses the pre-check. Advice and audit only: the OS sandbox is the
    boundary, whatever this lets through."""

    mode: PrecheckMode = "report"
    hook: PrecheckHook | None = None
    allowed_imports: frozenset[str] | None = None

    @classmethod
    def build(
        cls,
        mode: str,
        hook: PrecheckHook | None,
        allowed_imports: Iterable[str] | None,
    ) -> _PrecheckPolicy:
        """Validate the SDK arguments (InvalidArgumentError before anything starts)."""
        if mode not in get_args(PrecheckMode):
            raise InvalidArgumentError(
                f"precheck must be one of {', '.join(get_args(PrecheckMode))}, not {mode!r}"
            )
        if hook is not None and not callable(hook):
            raise InvalidArgumentError("on_precheck must be callable")
        if mode == "approve" and hook is None:
            raise InvalidArgumentError('precheck="approve" needs an on_precheck callback')
        if mode != "approve" and hook is not None:
            raise InvalidArgumentError(
                f'on_precheck is only used with precheck="approve", not {mode!r}'
            )
        if isinstance(allowed_imports, str):
            raise InvalidArgumentError("allowed_imports must be a collection of module names")
        imports = None if allowed_imports is None else frozenset(allowed_imports)
        if imports is not None and not all(isinstance(name, str) and name for name in imports):
            raise InvalidArgumentError("allowed_imports must hold non-empty module names")
        return cls(mode, hook, imports)  # type: ignore[arg-type]  # mode checked above

    def gate(self, code: str) -> tuple[str, PrecheckReport | None, Execution | None]:
        """(code to run, its report, None) or (code, report, the refused Execution)."""
        if self.mode == "off":
            return code, None, None
        report = check(code, allowed_imports=self.allowed_imports)
        if not report.flagged or self.mode == "report":
            return code, report, None
        if self.mode == "refuse":
            return code, report, _refused(report, 'the precheck policy is "refuse"')
        assert self.hook is not None  # build() guarantees it in approve mode
        verdict = self.hook(code, report)
        if verdict is True:
            return code, report, None
        if isinstance(verdict, str):
            # The approver wrote this code: run it, and report on what actually runs.
            return verdict, check(verdict, allowed_imports=self.allowed_imports), None
        # False, or anything that is not a clear yes (fail closed).
        return code, report, _refused(report, f"on_precheck answered {verdict!r}")


def _pool(pool: Pool | bool | None) -> Pool | None:
    if pool is None or pool is False:
        return None
    if pool is True:
        return default_pool()
    if isinstance(pool, Pool):
        return pool
    raise InvalidArgumentError(f"pool must be a sandlot.Pool, True or None, not {pool!r}")


def _refused(report: PrecheckReport, reason: str) -> Execution:
    value = f"the cell was not run: {reason}. Findings:\n{report.summary()}"
    return Execution(
        error=ExecutionError("PrecheckRefused", value), status="error", precheck=report
    )


_ERRORS: dict[str, type[SandlotError]] = {
    "NotFoundError": NotFoundError,
    "FileOperationError": FileOperationError,
    "ContextNotFoundError": ContextNotFoundError,
    "InvalidArgumentError": InvalidArgumentError,
    "PathNotAllowedError": PathNotAllowedError,
}


class _Core:
    """The sandbox logic shared by :class:`Sandbox` and :class:`AsyncSandbox`."""

    def __init__(
        self,
        *,
        template: str,
        backend: str | Backend,
        resources: Resources | Mapping[str, Any] | None,
        envs: Mapping[str, str] | None,
        timeout: float | None,
        metadata: Mapping[str, str] | None,
        unsafe_best_effort_limits: bool = False,
        precheck: _PrecheckPolicy | None = None,
        pool: Pool | bool | None = None,
        network: NetworkPolicy | Mapping[str, Any] | None = None,
    ) -> None:
        self.precheck = precheck or _PrecheckPolicy()
        self.pool = _pool(pool)
        self.sandbox_id = uuid.uuid4().hex[:16]
        self.spec = SandboxSpec(
            template=template,
            resources=Resources.coerce(resources),
            envs=dict(envs or {}),
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            preload=() if self.pool is None else self.pool.preload,
            sandbox_id=self.sandbox_id,
            network=NetworkPolicy.coerce(network),
        )
        self.backend = get_backend(backend)
        self.metadata = dict(metadata or {})
        self._handle: SandboxHandle | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._timer: threading.Timer | None = None
        self._ids = itertools.count(1)
        self.restarts = 0
        self.set_timeout(timeout)

    @classmethod
    def open(cls, **kwargs: Any) -> _Core:
        """Construct and start; a sandbox that fails to start leaves nothing behind."""
        core = cls(**kwargs)
        try:
            core.start()
        except BaseException:
            core.kill()
            raise
        return core

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._ensure()

    def _ensure(self) -> SandboxHandle:
        with self._lock:
            if self._closed:
                raise SandboxClosed(f"sandbox {self.sandbox_id} was killed")
            if self._handle is None or not self._handle.alive:
                if self._handle is not None:
                    self._handle.kill()
                    self.restarts += 1
                if self.pool is not None:
                    self._handle = self.pool.acquire(self.spec, self.backend)
                else:
                    self._handle = self.backend.start(self.spec)
            return self._handle

    def is_running(self) -> bool:
        return not self._closed and self._handle is not None and self._handle.alive

    def set_timeout(self, timeout: float | None) -> None:
        """Kill the sandbox ``timeout`` seconds from now (None: live until killed)."""
        if timeout is not None:
            timeout = _seconds(timeout)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if timeout is not None and not self._closed:
                self._timer = threading.Timer(timeout, self.kill)
                self._timer.daemon = True
                self._timer.start()

    def kill(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.kill()

    def _next_id(self) -> str:
        return f"{self.sandbox_id}-{next(self._ids)}"

    def _stream(self, message: dict[str, Any]) -> EventStream:
        return self._ensure().request({**message, "id": self._next_id()})

    # --- request/reply ----------------------------------------------------------------
    def call(self, message: dict[str, Any], timeout: float | None = None) -> Any:
        """Send a request that ends in a ``reply``; return its value or raise."""
        timeout = REQUEST_TIMEOUT if timeout is None else timeout  # read now: patchable
        stream = self._stream(message)
        deadline = time.monotonic() + timeout
        try:
            while True:
                event = stream.next(max(0.0, deadline - time.monotonic()))
                if event is None:
                    # SandboxLost promises a new sandbox on next use: do not leave the
                    # silent one in place (every later call would hang on it too).
                    self._discard_handle()
                    raise SandboxLost(
                        f"the sandbox did not answer {message['type']} within {timeout:g} s"
                    )
                if event["type"] == "reply":
                    if event["ok"]:
                        return event.get("value")
                    error = event.get("error") or {}
                    cls = _ERRORS.get(str(error.get("name")), FileOperationError)
                    raise cls(str(error.get("message", "operation failed")))
        finally:
            stream.close()

    # --- code -------------------------------------------------------------------------
    def run_code(
        self,
        code: str,
        *,
        language: str | None,
        context: Context | str | None,
        callbacks: Callbacks,
        envs: Mapping[str, str] | None,
        timeout: float | None,
    ) -> Execution:
        limit = _cell_limit(code, language, timeout)
        context_id = _context_id(context)
        code, report, refused = self.precheck.gate(code)
        if refused is not None:
            return refused
        builder = ExecutionBuilder(self.spec.resources, callbacks)
        builder.execution.precheck = report
        started = time.monotonic()
        try:
            handle = self._ensure()
            before = handle.usage()
            stream = self._stream(
                {
                    "type": "execute",
                    "code": code,
                    "context": context_id,
                    "envs": _check_envs(envs),
                    "timeout": limit,
                }
            )
        except SandboxLost as exc:
            return self._lost(builder, str(exc), started)
        deadline = started + limit + HOST_BACKSTOP
        stopped_for_memory = False
        try:
            while not builder.finished:
                now = time.monotonic()
                event = stream.next(max(0.0, min(deadline - now, OOM_POLL)))
                if event is not None:
                    builder.add(event)
                    continue
                if time.monotonic() >= deadline:
                    # The runner did not stop the cell in time: it is hung or hostile.
                    self._discard_handle()
                    execution = builder.abort(
                        "timeout",
                        "TimeoutError",
                        f"execution timed out after {limit:g} seconds and the sandbox did not "
                        "respond; it was destroyed and a new one starts on the next call "
                        "(files and variables were lost)",
                    )
                    execution.duration = time.monotonic() - started
                    return execution
                if not stopped_for_memory and _oom_since(before, handle.usage()):
                    # The kernel killed a process for the sandbox's memory limit. Stop the
                    # whole cell (what is left of it would run on a starved sandbox, and
                    # its result could silently miss a killed worker's part).
                    stopped_for_memory = True
                    with contextlib.suppress(SandlotError):
                        self.call({"type": "interrupt", "context": context_id}, timeout=5)
        except SandboxLost as exc:
            return self._lost(builder, str(exc), started)
        finally:
            stream.close()
        execution = builder.execution
        execution.duration = time.monotonic() - started
        if self.spec.network.enabled:
            execution.network = handle.network_events(settle=NETWORK_SETTLE)
        after = handle.usage()
        if after is not None:
            cpu = after.cpu_seconds
            if cpu is not None and before is not None and before.cpu_seconds is not None:
                cpu = max(0.0, cpu - before.cpu_seconds)
            execution.usage = dataclasses.replace(after, cpu_seconds=cpu)
            if _oom_since(before, after):
                _report_oom(execution, after, after.oom_kills - (before.oom_kills if before else 0))
        return execution

    def _lost(self, builder: ExecutionBuilder, reason: str, started: float) -> Execution:
        self._discard_handle()
        execution = builder.abort(
            "died",
            "SandboxLostError",
            f"{reason}; what the cell printed before is kept. A new sandbox starts on the "
            "next call (files and variables were lost).",
        )
        execution.duration = time.monotonic() - started
        return execution

    def _discard_handle(self) -> None:
        with self._lock:
            handle = self._handle
        if handle is not None:
            handle.kill()

    def interrupt(self, context: Context | str | None) -> None:
        self.call({"type": "interrupt", "context": _context_id(context)})

    # --- contexts ---------------------------------------------------------------------
    def create_code_context(self, cwd: str | None, language: str | None) -> Context:
        value = self.call(
            {"type": "create_context", "cwd": cwd or "", "language": language or "python"}
        )
        return _context_from_wire(value)

    def list_code_contexts(self) -> list[Context]:
        return [_context_from_wire(item) for item in self.call({"type": "list_contexts"})]

    def restart_code_context(self, context: Context | str | None) -> None:
        self.call({"type": "restart_context", "context": _context_id(context)})

    def remove_code_context(self, context: Context | str) -> None:
        context_id = _context_id(context)
        if context_id == DEFAULT_CONTEXT:
            raise InvalidArgumentError("the default context cannot be removed; restart it instead")
        self.call({"type": "remove_context", "context": context_id})

    # --- commands ---------------------------------------------------------------------
    def run_command(
        self,
        cmd: str,
        *,
        cwd: str | None,
        envs: Mapping[str, str] | None,
        timeout: float | None,
        callbacks: Callbacks,
    ) -> CommandResult:
        if not isinstance(cmd, str) or not cmd.strip():
            raise InvalidArgumentError("cmd must be a non-empty string")
        limit = DEFAULT_COMMAND_TIMEOUT if timeout is None else _seconds(timeout)
        builder = CommandBuilder(self.spec.resources, callbacks)
        stream = self._stream(
            {
                "type": "command",
                "cmd": cmd,
                "cwd": _check_path(cwd) if cwd else "",
                "envs": _check_envs(envs),
                "timeout": limit,
            }
        )
        deadline = time.monotonic() + limit + HOST_BACKSTOP
        try:
            while not builder.finished:
                event = stream.next(max(0.0, deadline - time.monotonic()))
                if event is None:
                    self._discard_handle()
                    builder.abort("timeout")
                    break
                builder.add(event)
        except SandboxLost as exc:
            self._discard_handle()
            builder.abort(f"sandbox lost: {exc}")
        finally:
            stream.close()
        return builder.result()

    # --- files ------------------------------------------------------------------------
    def read_chunks(self, path: str) -> Iterator[bytes]:
        # Check the path now: a generator would only do so on the first next(), so
        # files.read(bad, format="stream") used to "succeed".
        return self._read_chunks(_check_file_path(path))

    def _read_chunks(self, path: str) -> Iterator[bytes]:
        stream = self._stream({"type": "fs_read", "path": path})
        try:
            while True:
                event = stream.next(REQUEST_TIMEOUT)
                if event is None:
                    self._discard_handle()  # as in call()
                    raise SandboxLost(f"the sandbox stopped sending {path}")
                if event["type"] == "data":
                    yield base64.b64decode(event["data"])
                elif event["type"] == "reply":
                    if not event["ok"]:
                        error = event.get("error") or {}
                        cls = _ERRORS.get(str(error.get("name")), FileOperationError)
                        raise cls(str(error.get("message", f"cannot read {path}")))
                    return
        finally:
            stream.close()

    def write(self, path: str, data: str | bytes | IO[Any]) -> WriteInfo:
        path = _check_file_path(path)
        if isinstance(data, str):
            data = data.encode("utf-8")
        size = _known_size(data)
        if size is not None:
            self._check_upload(path, size)  # before anything is sent
        total = 0
        first = True
        value: Any = None
        for chunk in _chunks(data):
            total += len(chunk)
            try:
                self._check_upload(path, total)
            except InvalidArgumentError:
                if not first:  # a stream that grew past the limit: leave no partial file
                    with contextlib.suppress(SandlotError):
                        self.call({"type": "fs_remove", "path": path})
                raise
            value = self.call(
                {
                    "type": "fs_write",
                    "path": path,
                    "data": base64.b64encode(chunk).decode("ascii"),
                    "append": not first,
                    # The runner refuses (and removes) an upload that grows past this.
                    "max_bytes": self.spec.resources.upload_bytes,
                }
            )
            first = False
        if first:  # empty upload: still create the file
            value = self.call({"type": "fs_write", "path": path, "data": "", "append": False})
        info = entry_from_wire(value)
        return WriteInfo(name=info.name, type=info.type, path=info.path)

    def _check_upload(self, path: str, size: int) -> None:
        resources = self.spec.resources
        if resources.upload_bytes is not None and size > resources.upload_bytes:
            raise InvalidArgumentError(
                f"{path}: upload larger than the upload limit ({resources.upload_bytes} "
                "bytes); raise Resources(upload_bytes=...)"
            )
        if resources.disk_mb is not None and size > resources.disk_mb * MiB:
            raise InvalidArgumentError(
                f"{path}: upload larger than the sandbox workspace ({resources.disk_mb} MiB); "
                "raise Resources(disk_mb=...)"
            )


def _known_size(data: bytes | IO[Any]) -> int | None:
    """Bytes left in ``data`` when that can be known without reading it."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    if isinstance(data, io.TextIOBase):
        return None  # positions are opaque cookies and sizes are characters
    try:
        if not data.seekable():
            return None
        position = data.tell()
        end = data.seek(0, io.SEEK_END)
        data.seek(position)
    except (AttributeError, OSError, ValueError):
        return None
    return max(0, end - position)


def _cell_limit(code: object, language: str | None, timeout: float | None) -> float:
    """Check ``run_code``'s arguments (local and remote alike); return the cell's timeout."""
    if not isinstance(code, str):
        raise InvalidArgumentError(f"code must be str, not {type(code).__name__}")
    if language not in (None, "python", "py", "python3"):
        raise InvalidArgumentError(f"language {language!r} is not supported; sandlot runs Python")
    return DEFAULT_CELL_TIMEOUT if timeout is None else _seconds(timeout)


def _oom_since(before: ResourceUsage | None, now: ResourceUsage | None) -> bool:
    return before is not None and now is not None and now.oom_kills > before.oom_kills


def _report_oom(execution: Execution, usage: ResourceUsage, kills: int) -> None:
    """Make a cell during which the kernel killed processes for the sandbox's memory
    limit an ``OutOfMemoryError``, saying the limit and the peak (output is kept)."""
    limit = usage.memory_limit_bytes
    peak = usage.memory_peak_bytes
    detail = (
        f"the sandbox reached its memory limit of {_mib(limit)} (peak {_mib(peak)}); the "
        f"kernel killed {kills} process{'es' if kills != 1 else ''} and the cell was stopped"
    )
    previous = execution.error
    if (
        previous is not None
        and previous.name == "OutOfMemoryError"
        and "restarted" in previous.value
    ):
        detail += "; the kernel was among them, so it was restarted and its variables were lost"
    elif previous is not None and previous.name not in ("KeyboardInterrupt", "OutOfMemoryError"):
        detail += f" (the cell then raised {previous.name}: {previous.value})"
    execution.error = ExecutionError("OutOfMemoryError", detail, "")
    execution.status = "oom"


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value / MiB:.0f} MiB"


def _chunks(data: bytes | IO[Any]) -> Iterator[bytes]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for offset in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[offset : offset + CHUNK_BYTES])
        return
    while True:
        chunk = data.read(CHUNK_BYTES)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


def _check_path(path: str) -> str:
    """A path to send into the sandbox: a non-empty str without NUL, of sane length."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgumentError(f"invalid path {path!r}")
    encoded = path.encode("utf-8", "surrogatepass")
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise InvalidArgumentError(
            f"path too long: at most {PATH_MAX} bytes, {NAME_MAX} per name ({path[:60]!r}...)"
        )
    return path


def _check_file_path(path: str) -> str:
    """A files.* path: also inside the workspace once ``..`` is resolved (symlinks are
    checked inside the sandbox, where they live)."""
    _check_path(path)
    lexical = posixpath.normpath(posixpath.join(WORKSPACE_ROOTS[0], path))
    if not any(lexical == root or lexical.startswith(root + "/") for root in WORKSPACE_ROOTS):
        raise PathNotAllowedError(
            f"{path!r} is outside the sandbox workspace ({', '.join(WORKSPACE_ROOTS)}); "
            "the files API reaches only those directories"
        )
    return path


def _seconds(timeout: float) -> float:
    """A timeout as positive, finite seconds, or InvalidArgumentError."""
    # Not bool (an int), not a str; NaN and inf used to pass "<= 0" and then broke the
    # deadline arithmetic (an instant host-side kill, or OverflowError in a wait).
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not math.isfinite(timeout)
        or not 0 < timeout <= threading.TIMEOUT_MAX
    ):
        raise InvalidArgumentError(f"timeout must be positive, finite seconds, not {timeout!r}")
    return float(timeout)


def _check_envs(envs: Mapping[str, str] | None) -> dict[str, str]:
    if not envs:
        return {}
    if not isinstance(envs, Mapping):
        raise InvalidArgumentError(f"envs must be a mapping, not {type(envs).__name__}")
    checked = {}
    for key, value in envs.items():
        # NUL as in SandboxSpec: it cannot be in an environment; the runner would fail.
        if (
            not isinstance(key, str)
            or not isinstance(value, str)
            or not key
            or "=" in key
            or "\0" in key + value
        ):
            raise InvalidArgumentError(f"invalid environment variable {key!r}")
        checked[key] = value
    return checked


def _context_id(context: Context | str | None) -> str:
    if context is None:
        return DEFAULT_CONTEXT
    if isinstance(context, Context):
        return context.id
    if isinstance(context, str) and context:
        return context
    raise InvalidArgumentError(f"invalid context {context!r}")


def _context_from_wire(value: Any) -> Context:
    return Context(id=str(value["id"]), language=str(value["language"]), cwd=str(value["cwd"]))


def _open_core(
    *, backend: str | Backend, api_url: str | None, api_key: str | None, **kwargs: Any
) -> _Core:
    """A started local ``_Core``, or the remote one when ``api_url`` / ``$SANDLOT_API_URL``
    says so."""
    if api_url is None and api_key is None and not os.environ.get("SANDLOT_API_URL"):
        return _Core.open(backend=backend, **kwargs)  # local; no need for the server extra
    from sandlot._remote import RemoteCore, remote_target

    target = remote_target(api_url, api_key, backend)
    if target is None:
        return _Core.open(backend=backend, **kwargs)
    if kwargs.pop("pool", None) not in (None, False):
        raise InvalidArgumentError("pool= is for sandboxes on this machine, not on a server")
    return RemoteCore.open(target=target, **kwargs)


# ==== synchronous SDK ==================================================================


class Filesystem:
    """``sandbox.files``: the sandbox's files. Relative paths are under ``/home/user``.

    Operations run inside the sandbox, so paths and symlinks resolve in the
    sandbox's own view of the filesystem and can never reach a host file.
    """

    def __init__(self, core: _Core) -> None:
        self._core = core

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...
    @overload
    def read(self, path: str, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(self, path: str, format: str = "text") -> str | bytes | Iterator[bytes]:
        """Read a file as text (UTF-8), ``bytes``, or a ``stream`` of byte chunks."""
        if format == "stream":
            return self._core.read_chunks(path)
        if format not in ("text", "bytes"):
            raise InvalidArgumentError("format must be 'text', 'bytes' or 'stream'")
        data = b"".join(self._core.read_chunks(path))
        return data.decode("utf-8") if format == "text" else data

    def write(self, path: str, data: str | bytes | IO[Any]) -> WriteInfo:
        """Create or overwrite a file (parents are created). Big files go in chunks."""
        return self._core.write(path, data)

    def list(self, path: str = ".", depth: int = 1) -> list[EntryInfo]:
        if depth < 1:
            raise InvalidArgumentError("depth must be >= 1")
        return entries_from_wire(
            self._core.call({"type": "fs_list", "path": _check_file_path(path), "depth": depth})
        )

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
        except NotFoundError:
            return False
        return True

    def get_info(self, path: str) -> EntryInfo:
        return entry_from_wire(self._core.call({"type": "fs_stat", "path": _check_file_path(path)}))

    def remove(self, path: str) -> None:
        self._core.call({"type": "fs_remove", "path": _check_file_path(path)})

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        return bool(self._core.call({"type": "fs_mkdir", "path": _check_file_path(path)}))

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return entry_from_wire(
            self._core.call(
                {
                    "type": "fs_rename",
                    "src": _check_file_path(old_path),
                    "dst": _check_file_path(new_path),
                }
            )
        )


class Commands:
    """``sandbox.commands``: run shell commands inside the sandbox."""

    def __init__(self, core: _Core) -> None:
        self._core = core

    def run(
        self,
        cmd: str,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
    ) -> CommandResult:
        """Run ``cmd`` with ``/bin/sh -c``; a non-zero exit is data, not an exception."""
        return self._core.run_command(
            cmd,
            cwd=cwd,
            envs=envs,
            timeout=timeout,
            callbacks=Callbacks(on_stdout=on_stdout, on_stderr=on_stderr),
        )


class Sandbox:
    """An isolated, stateful Python sandbox.

    ::

        with Sandbox() as sbx:
            sbx.run_code("x = 41")
            print(sbx.run_code("x + 1").text)   # 42

    The sandbox starts when constructed (``Sandbox.create()`` is the same) and is
    destroyed by :meth:`kill`, by leaving the ``with`` block, after ``timeout``
    seconds, or when this process exits.

    :param template: the Python environment to run (built on first use).
    :param backend: ``"auto"`` (strongest available), ``"bwrap"``, or a Backend.
    :param resources: limits (:class:`sandlot.Resources` or a dict of its fields).
    :param envs: environment variables for everything in the sandbox.
    :param timeout: seconds until the sandbox is killed; None for no limit.
    :param unsafe_best_effort_limits: start even if the host cannot enforce the
        whole-sandbox cgroup limits (then only per-process rlimits apply). Off by
        default: without cgroups, sandlot refuses to start, naming the fix.
    :param precheck: ``"report"`` (default) attaches an advisory static report
        (:mod:`sandlot.precheck`) to every Execution; ``"approve"`` sends flagged cells
        to ``on_precheck``; ``"refuse"`` refuses them (``PrecheckRefused``, nothing runs);
        ``"off"`` skips it. Advice only: the OS sandbox is the boundary.
    :param on_precheck: ``(code, report) -> True | False | str`` for ``"approve"``:
        run, refuse, or run the returned code instead.
    :param allowed_imports: top-level modules the pre-check accepts (default:
        :data:`sandlot.precheck.DEFAULT_ALLOWED_IMPORTS`).
    :param api_url: a sandlot server (``sandlot serve``) to run the sandbox on instead of
        this machine (default ``$SANDLOT_API_URL`` unless ``backend`` names one).
    :param api_key: that server's API key (default ``$SANDLOT_API_KEY``).
    :param pool: a :class:`sandlot.Pool` to take a ready sandbox from (with its
        ``preload`` modules, by default numpy, pandas and pyplot, already imported),
        ``True`` for the process-wide :func:`sandlot.pool.default_pool`, or None
        (default) to start a new sandbox here. Isolation is the same either way.
    :param network: where the sandbox may connect out
        (:class:`sandlot.NetworkPolicy` or ``{"allow_out": [...], "deny_out": [...]}``).
        None or an empty ``allow_out`` (the default): no network at all. Otherwise its
        only way out is the host's egress proxy, and each ``Execution.network`` lists the
        connections it allowed and refused.
    """

    def __init__(
        self,
        template: str = "python-data",
        *,
        backend: str | Backend = "auto",
        resources: Resources | Mapping[str, Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_SANDBOX_TIMEOUT,
        metadata: Mapping[str, str] | None = None,
        unsafe_best_effort_limits: bool = False,
        precheck: PrecheckMode = "report",
        on_precheck: PrecheckHook | None = None,
        allowed_imports: Iterable[str] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        pool: Pool | bool | None = None,
        network: NetworkPolicy | Mapping[str, Any] | None = None,
    ) -> None:
        self._core = _open_core(
            template=template,
            backend=backend,
            resources=resources,
            envs=envs,
            timeout=timeout,
            metadata=metadata,
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            precheck=_PrecheckPolicy.build(precheck, on_precheck, allowed_imports),
            api_url=api_url,
            api_key=api_key,
            pool=pool,
            network=network,
        )
        self.files = Filesystem(self._core)
        self.commands = Commands(self._core)

    @classmethod
    def create(cls, template: str = "python-data", **kwargs: Any) -> Sandbox:
        return cls(template, **kwargs)

    @property
    def sandbox_id(self) -> str:
        return self._core.sandbox_id

    @property
    def resources(self) -> Resources:
        return self._core.spec.resources

    @property
    def network(self) -> NetworkPolicy:
        """The sandbox's network policy (empty ``allow_out``: no network)."""
        return self._core.spec.network

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        """Destroy the sandbox and every process and file in it. Idempotent."""
        self._core.kill()

    def is_running(self) -> bool:
        return self._core.is_running()

    def set_timeout(self, timeout: float | None) -> None:
        self._core.set_timeout(timeout)

    def run_code(
        self,
        code: str,
        language: str | None = None,
        context: Context | str | None = None,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        on_result: Callable[[Result], Any] | None = None,
        on_error: Callable[[ExecutionError], Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Execution:
        """Run a cell; its last expression is the main result. Never raises for user code.

        Exceptions, timeouts (``error.name == "TimeoutError"``) and memory
        exhaustion (``"OutOfMemoryError"``) come back on ``Execution.error`` and
        ``Execution.status``; the kernel is restarted when it had to be killed.
        """
        return self._core.run_code(
            code,
            language=language,
            context=context,
            callbacks=Callbacks(on_stdout, on_stderr, on_result, on_error),
            envs=envs,
            timeout=timeout,
        )

    def interrupt(self, context: Context | str | None = None) -> None:
        """Interrupt the running cell of ``context`` (KeyboardInterrupt, then kill)."""
        self._core.interrupt(context)

    def create_code_context(self, cwd: str | None = None, language: str | None = None) -> Context:
        return self._core.create_code_context(cwd, language)

    def list_code_contexts(self) -> list[Context]:
        return self._core.list_code_contexts()

    def restart_code_context(self, context: Context | str | None = None) -> None:
        self._core.restart_code_context(context)

    def remove_code_context(self, context: Context | str) -> None:
        self._core.remove_code_context(context)


# ==== asynchronous SDK =================================================================

P = ParamSpec("P")
T = TypeVar("T")


def _on_loop(
    loop: asyncio.AbstractEventLoop, callback: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """Make a (sync or async) callback safe to call from the worker thread."""
    if callback is None:
        return None
    if inspect.iscoroutinefunction(callback):

        def run_async(value: Any) -> None:
            import asyncio

            asyncio.run_coroutine_threadsafe(callback(value), loop).result()

        return run_async

    def run_sync(value: Any) -> None:
        loop.call_soon_threadsafe(callback, value)

    return run_sync


def _hook_on_loop(
    loop: asyncio.AbstractEventLoop,
    hook: Callable[[str, PrecheckReport], bool | str | Awaitable[bool | str]] | None,
) -> PrecheckHook | None:
    """Let ``run_code``'s worker thread call a sync or async ``on_precheck``."""
    if hook is None or not inspect.iscoroutinefunction(hook):
        return hook  # type: ignore[return-value]  # a sync hook returns bool | str
    coroutine_hook = hook

    def run_async(code: str, report: PrecheckReport) -> bool | str:
        import asyncio

        future = asyncio.run_coroutine_threadsafe(coroutine_hook(code, report), loop)
        result: bool | str = future.result()
        return result

    return run_async


def _running_loop() -> asyncio.AbstractEventLoop:
    import asyncio

    return asyncio.get_running_loop()


async def _in_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    import asyncio

    return await asyncio.to_thread(functools.partial(function, *args, **kwargs))


class AsyncFilesystem:
    def __init__(self, sync: Filesystem) -> None:
        self._sync = sync

    async def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytes:
        if format == "bytes":
            return await _in_thread(self._sync.read, path, "bytes")
        return await _in_thread(self._sync.read, path, "text")

    async def write(self, path: str, data: str | bytes | IO[Any]) -> WriteInfo:
        return await _in_thread(self._sync.write, path, data)

    async def list(self, path: str = ".", depth: int = 1) -> list[EntryInfo]:
        return await _in_thread(self._sync.list, path, depth)

    async def exists(self, path: str) -> bool:
        return await _in_thread(self._sync.exists, path)

    async def get_info(self, path: str) -> EntryInfo:
        return await _in_thread(self._sync.get_info, path)

    async def remove(self, path: str) -> None:
        await _in_thread(self._sync.remove, path)

    async def make_dir(self, path: str) -> bool:
        return await _in_thread(self._sync.make_dir, path)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return await _in_thread(self._sync.rename, old_path, new_path)


class AsyncCommands:
    def __init__(self, core: _Core) -> None:
        self._core = core

    async def run(
        self,
        cmd: str,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
    ) -> CommandResult:
        loop = _running_loop()
        callbacks = Callbacks(
            on_stdout=_on_loop(loop, on_stdout), on_stderr=_on_loop(loop, on_stderr)
        )
        return await _in_thread(
            self._core.run_command, cmd, cwd=cwd, envs=envs, timeout=timeout, callbacks=callbacks
        )


class AsyncSandbox:
    """The asyncio twin of :class:`Sandbox`: same methods, awaited.

    ::

        sbx = await AsyncSandbox.create()
        execution = await sbx.run_code("1 + 1")
        await sbx.kill()

    Callbacks may be plain functions or coroutine functions; they run on the event
    loop, in order.
    """

    def __init__(self, core: _Core) -> None:
        self._core = core
        self.files = AsyncFilesystem(Filesystem(core))
        self.commands = AsyncCommands(core)

    @classmethod
    async def create(
        cls,
        template: str = "python-data",
        *,
        backend: str | Backend = "auto",
        resources: Resources | Mapping[str, Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_SANDBOX_TIMEOUT,
        metadata: Mapping[str, str] | None = None,
        unsafe_best_effort_limits: bool = False,
        precheck: PrecheckMode = "report",
        on_precheck: (
            Callable[[str, PrecheckReport], bool | str | Awaitable[bool | str]] | None
        ) = None,
        allowed_imports: Iterable[str] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        pool: Pool | bool | None = None,
        network: NetworkPolicy | Mapping[str, Any] | None = None,
    ) -> AsyncSandbox:
        import asyncio

        policy = _PrecheckPolicy.build(
            precheck, _hook_on_loop(asyncio.get_running_loop(), on_precheck), allowed_imports
        )
        core = await asyncio.to_thread(
            _open_core,
            template=template,
            backend=backend,
            resources=resources,
            envs=envs,
            timeout=timeout,
            metadata=metadata,
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            precheck=policy,
            api_url=api_url,
            api_key=api_key,
            pool=pool,
            network=network,
        )
        return cls(core)

    @property
    def sandbox_id(self) -> str:
        return self._core.sandbox_id

    @property
    def resources(self) -> Resources:
        return self._core.spec.resources

    @property
    def network(self) -> NetworkPolicy:
        """The sandbox's network policy (empty ``allow_out``: no network)."""
        return self._core.spec.network

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def kill(self) -> None:
        await _in_thread(self._core.kill)

    async def is_running(self) -> bool:
        return self._core.is_running()

    async def set_timeout(self, timeout: float | None) -> None:
        self._core.set_timeout(timeout)

    async def run_code(
        self,
        code: str,
        language: str | None = None,
        context: Context | str | None = None,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        on_result: Callable[[Result], Any] | None = None,
        on_error: Callable[[ExecutionError], Any] | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Execution:
        loop = _running_loop()
        callbacks = Callbacks(
            _on_loop(loop, on_stdout),
            _on_loop(loop, on_stderr),
            _on_loop(loop, on_result),
            _on_loop(loop, on_error),
        )
        return await _in_thread(
            self._core.run_code,
            code,
            language=language,
            context=context,
            callbacks=callbacks,
            envs=envs,
            timeout=timeout,
        )

    async def interrupt(self, context: Context | str | None = None) -> None:
        await _in_thread(self._core.interrupt, context)

    async def create_code_context(
        self, cwd: str | None = None, language: str | None = None
    ) -> Context:
        return await _in_thread(self._core.create_code_context, cwd, language)

    async def list_code_contexts(self) -> list[Context]:
        return await _in_thread(self._core.list_code_contexts)

    async def restart_code_context(self, context: Context | str | None = None) -> None:
        await _in_thread(self._core.restart_code_context, context)

    async def remove_code_context(self, context: Context | str) -> None:
        await _in_thread(self._core.remove_code_context, context)


_Awaitable = Awaitable  # re-exported name kept for type checkers of callers
