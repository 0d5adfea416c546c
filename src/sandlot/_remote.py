"""The SDK's remote mode: the same ``Sandbox`` / ``AsyncSandbox`` API over a sandlot server.

``Sandbox(api_url=..., api_key=...)`` (or ``$SANDLOT_API_URL`` / ``$SANDLOT_API_KEY``)
swaps the local core for :class:`RemoteCore`, its peer behind the same core protocol
(:class:`sandlot._core.Core`), which turns each call into an HTTP request (httpx).
The server runs the very same local SDK, so results are the same values; the
sandbox's limits and outcomes arrive as data in the NDJSON stream (see
``sandlot.server._cells``). ``Sandbox`` checks every argument before a request is
sent, exactly as in local mode.

Cells go over one WebSocket per sandbox (:class:`CellSocket`, opened at the second
cell; the server's side is ``sandlot.server._cellsocket``): the same request and the
same NDJSON stream, without an HTTP request and response per cell. A server that does
not offer it gets them over HTTP (``POST .../execute``), as does a cell run while
another one holds the socket.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import select
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import httpx
import wsproto
import wsproto.events as ws

from sandlot import _exceptions as errors
from sandlot._core import HOST_BACKSTOP, REQUEST_TIMEOUT, Core, SandboxOptions
from sandlot._fold import Callbacks
from sandlot._models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    FileType,
    NetworkEvent,
    OutputMessage,
    ProcessInfo,
    PtySize,
    ResourceUsage,
    Result,
    SnapshotInfo,
    WriteInfo,
    context_from_wire,
    entries_from_wire,
    entry_from_wire,
    event_entry,
    metadata_from_wire,
    process_from_wire,
)
from sandlot._process import ProcessEvent
from sandlot._watch import EVENT_TYPES, FilesystemEvent
from sandlot.backends import Backend, SandboxHandle
from sandlot.policy import NetworkPolicy, Resources, SandboxSpec
from sandlot.protocol import METADATA_HEADER

STREAM_SLACK = 30.0
"""Seconds the client waits past a cell's own timeout (plus the host backstop) for the
server's answer before it gives up on the connection."""

STDIN_PIECE = 512 * 1024
"""Bytes of stdin per request (base64 makes them 4/3 as many on the wire)."""

SOCKET_IDLE = 10.0
"""Seconds a sandbox's cell WebSocket may sit unused and still be used again; an older
one is closed and a new one opened. Below what ASGI servers allow a client that does not
answer their keep-alive pings (uvicorn: 20 s ping interval + 20 s timeout), so a cell is
never sent on a connection the server is about to drop."""

CONNECT_TIMEOUT = 10.0

_RESULT_FIELDS = {f.name for f in fields(Result)}

_TLS_LOCK = threading.Lock()
_TLS: dict[tuple[str | None, str | None], ssl.SSLContext] = {}


def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context, built once per process (per CA settings).

    Building one loads the CA bundle (~20 ms); a client made per sandbox would pay that
    on every create, even for an ``http://`` server. The context is the one httpx would
    build itself, so certificate checks are unchanged; ``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` are honoured as httpx does, as of the first client made with them.
    """
    where = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    with _TLS_LOCK:
        context = _TLS.get(where)
        if context is None:
            context = _TLS[where] = httpx.create_ssl_context()
        return context


@dataclass(frozen=True, slots=True)
class RemoteTarget:
    url: str
    key: str


def remote_target(
    api_url: str | None, api_key: str | None, backend: str | Backend
) -> RemoteTarget | None:
    """Where remote mode should go, or None for local mode.

    An explicit ``api_url`` wins; otherwise ``$SANDLOT_API_URL`` applies unless the
    caller chose a local backend by name.
    """
    if api_url is None and (backend != "auto" or not os.environ.get("SANDLOT_API_URL")):
        if api_key is not None:
            raise errors.InvalidArgumentError("api_key was given without api_url")
        return None
    if api_url is not None and backend != "auto":
        raise errors.InvalidArgumentError("give either api_url (remote mode) or a backend")
    url = api_url or os.environ["SANDLOT_API_URL"]
    key = api_key or os.environ.get("SANDLOT_API_KEY")
    if not key:
        raise errors.InvalidArgumentError(
            "remote mode needs an API key: pass api_key=... or set SANDLOT_API_KEY"
        )
    return RemoteTarget(url=url.rstrip("/"), key=key)


def _raise_for(response: httpx.Response) -> None:
    """Raise the sandlot exception a non-2xx response names (by its ``type``)."""
    if response.is_success:
        return
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    raise _error(
        str(body.get("type", "")), str(body.get("message") or response.text), response.status_code
    )


def _error(name: str, message: str, status: int | None = None) -> errors.SandlotError:
    if name == "SandboxNotFound":
        return errors.SandboxClosed(f"{message} (killed, expired or never created)")
    if name == "AuthenticationError" or status == 401:
        return errors.AuthenticationError(message, status)
    if name == "QuotaExceeded" or status == 429:
        return errors.QuotaExceeded(message, status)
    cls = getattr(errors, name, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, errors.SandlotError)
        and not issubclass(cls, errors.ServerError)
    ):
        return cls(message)
    return errors.ServerError(f"server answered {status}: {message}", status)


class RemoteCore:
    """A sandbox on a sandlot server (:class:`sandlot._core.Core` over HTTP)."""

    def __init__(self, target: RemoteTarget, options: SandboxOptions) -> None:
        if options.unsafe_best_effort_limits:
            raise errors.InvalidArgumentError(
                "unsafe_best_effort_limits is the server's decision in remote mode "
                "(sandlot serve --unsafe-best-effort-limits)"
            )
        if options.pool not in (None, False):
            raise errors.InvalidArgumentError(
                "pool= is for sandboxes on this machine, not on a server"
            )
        # No backend runs on this side; the server picks its own.
        self.spec = SandboxSpec(
            template=options.template,
            resources=options.resources,
            envs=dict(options.envs),
            network=options.network,
        )
        self.metadata = dict(options.metadata)
        self._resources_given = options.resources_given
        self._timeout = options.timeout
        self._client = httpx.Client(
            base_url=target.url,
            headers={"Authorization": f"Bearer {target.key}"},
            timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0),
            verify=_tls_context(),
        )
        self._lock = threading.RLock()
        self._closed = False
        self._id: str | None = None
        self._restarts = 0
        self._target = target
        # The sandbox's cell WebSocket, opened at its second cell; one cell at a time on
        # it (a cell run meanwhile from another thread goes over HTTP).
        self._socket: CellSocket | None = None
        self._socket_lock = threading.Lock()
        self._socket_offered = True  # until the server answers the upgrade otherwise
        # The first cell goes over HTTP, on the connection the create left open: a
        # handshake costs about as much as a request (~1 ms on loopback), which a
        # sandbox that runs one cell would pay for nothing. The socket opens at the
        # second, and every later cell saves about that much.
        self._http_cells = 0

    @classmethod
    def open(cls, target: RemoteTarget, options: SandboxOptions) -> RemoteCore:
        """Construct and create the sandbox on the server."""
        core = cls(target, options)
        try:
            core.start()
        except BaseException:
            core.kill()
            raise
        return core

    # --- plumbing ---------------------------------------------------------------------
    @property
    def sandbox_id(self) -> str:
        if self._id is None:
            raise errors.SandboxClosed("the sandbox was not created")
        return self._id

    def _path(self, suffix: str = "") -> str:
        if self._closed:
            raise errors.SandboxClosed(f"sandbox {self._id} was killed")
        return f"/v1/sandboxes/{self.sandbox_id}{suffix}"

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise errors.ServerError(f"cannot reach the sandlot server: {exc}") from exc
        _raise_for(response)
        return response

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        body = {
            "template": self.spec.template,
            "timeout": self._timeout,
            "envs": dict(self.spec.envs),
            "metadata": self.metadata,
            # Only what the caller chose: a field left out gets the server's ceiling for
            # this tenant, which may be below sandlot's local default.
            "resources": {
                name: getattr(self.spec.resources, name) for name in sorted(self._resources_given)
            },
        }
        if self.spec.network.enabled:
            body["network"] = _network_body(self.spec.network)
        info = self._request("POST", "/v1/sandboxes", json=body).json()
        self._id = str(info["sandbox_id"])
        # The policy in force: the server may have lowered caps left at their defaults
        # and added its own deny_out.
        granted = info.get("resources") or {}
        known = {f.name for f in fields(Resources)}
        self.spec = replace(
            self.spec,
            network=NetworkPolicy.coerce(info.get("network")),
            resources=replace(
                self.spec.resources, **{k: v for k, v in granted.items() if k in known}
            ),
        )

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._request("GET", self._path()).json()
        return info

    @property
    def backend(self) -> Backend | None:
        return None  # the server picks its own

    @property
    def handle(self) -> SandboxHandle | None:
        return None

    @property
    def restarts(self) -> int:
        """How often the server had to start a new sandbox behind this one, as of its
        last answer to :meth:`is_running` (no request here: the async twin reads it on
        the event loop)."""
        return self._restarts

    def is_running(self) -> bool:
        if self._closed or self._id is None:
            return False
        try:
            info = self._info()
        except errors.SandboxClosed:
            return False
        self._restarts = int(info.get("restarts", self._restarts))
        return bool(info["running"])

    def set_timeout(self, timeout: float | None) -> None:
        self._request("POST", self._path("/timeout"), json={"timeout": timeout})

    # --- checkpoints (not over the native API yet) -----------------------------------
    def _no_checkpoints(self) -> errors.CheckpointError:
        return errors.CheckpointError(
            "pause, snapshots and fork are not offered over sandlot's native API yet: "
            "use a local sandbox (Sandbox(checkpointable=True)) or the server's E2B wire"
        )

    def pause(self) -> bool:
        raise self._no_checkpoints()

    def resume(self) -> None:
        raise self._no_checkpoints()

    def create_snapshot(self, name: str | None) -> SnapshotInfo:
        raise self._no_checkpoints()

    def fork(self, count: int) -> list[Core | Exception]:
        raise self._no_checkpoints()

    def kill(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._id is not None:
                self._client.delete(f"/v1/sandboxes/{self._id}")
        except httpx.TransportError:
            pass  # the server is gone; its sandboxes went with it
        finally:
            self._client.close()
            # A cell running on the socket meanwhile ends with the sandbox (typed, as
            # over HTTP); its thread closes the socket then.
            if self._socket_lock.acquire(blocking=False):
                try:
                    self._drop_socket()
                finally:
                    self._socket_lock.release()

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def interrupt(self, context: str) -> None:
        self._request("POST", self._path("/interrupt"), json={"context_id": context})

    # --- code -------------------------------------------------------------------------
    def run_code(
        self,
        code: str,
        *,
        context: str,
        envs: dict[str, str],
        timeout: float,
        callbacks: Callbacks,
    ) -> Execution:
        limit = timeout
        body = {
            "code": code,
            "context_id": context,
            "language": "python",
            "env_vars": envs,
            "timeout": limit,
        }
        if self._http_cells == 0:
            self._http_cells = 1
        elif self._socket_offered and self._socket_lock.acquire(blocking=False):
            try:
                done = self._run_code_on_socket(body, limit, callbacks)
            finally:
                self._socket_lock.release()
            if done is not None:
                return done
        execution = Execution()
        wait = httpx.Timeout(limit + HOST_BACKSTOP + STREAM_SLACK, connect=10.0)
        ended = False
        # What the execution says if the stream ends before end_of_execution.
        failure = ("died", "SandboxLostError", "the server ended the stream early")
        try:
            with self._client.stream(
                "POST", self._path("/execute"), json=body, timeout=wait
            ) as response:
                _raise_for(response)
                for line in response.iter_lines():
                    # The server ends the body right after end_of_execution: reading it
                    # to its end keeps the connection for the next call (a response
                    # closed half-read closes its connection).
                    if not ended and line:
                        ended = self._fold(execution, json.loads(line), callbacks)
        except httpx.TimeoutException:
            failure = (
                "timeout",
                "TimeoutError",
                f"execution timed out after {limit:g} seconds and the server did not answer",
            )
        except httpx.TransportError as exc:
            failure = (
                "died",
                "SandboxLostError",
                f"the connection to the sandlot server was lost ({exc}); what the cell "
                "printed before is kept",
            )
        return execution if ended else _aborted(execution, *failure)

    def _run_code_on_socket(
        self, body: dict[str, Any], limit: float, callbacks: Callbacks
    ) -> Execution | None:
        """The cell over the sandbox's WebSocket (opened now if need be), with what the
        HTTP route would return; None if the server does not offer the socket or cannot
        be reached now (the caller goes over HTTP, which reports it as ever)."""
        self._path()  # SandboxClosed once killed, as over HTTP
        sock = self._socket
        if sock is not None and not sock.alive():
            self._drop_socket()
            sock = None
        if sock is None:
            try:
                sock = CellSocket.connect(self._target.url, self._target.key, self.sandbox_id)
            except NoCellSocket:
                self._socket_offered = False
                return None
            except OSError:
                return None
            self._socket = sock
        execution = Execution()
        ended = False
        failure = ("died", "SandboxLostError", "the server ended the stream early")
        try:
            stream = sock.cell(body, limit + HOST_BACKSTOP + STREAM_SLACK)
            try:
                first = next(stream)
            except NotSent:
                # Never run: over HTTP then, which answers (or reports) it as ever,
                # e.g. a 413 for a cell over the server's body limit.
                self._drop_socket()
                return None
            for message in itertools.chain((first,), stream):
                if not ended:
                    ended = self._fold(execution, message, callbacks)
        except TimeoutError:
            failure = (
                "timeout",
                "TimeoutError",
                f"execution timed out after {limit:g} seconds and the server did not answer",
            )
        except OSError as exc:
            failure = (
                "died",
                "SandboxLostError",
                f"the connection to the sandlot server was lost ({exc}); what the cell "
                "printed before is kept",
            )
        finally:
            # Mid-cell (a timeout, a callback that raised, a lost connection): the
            # connection goes, which the server takes as a disconnect (it interrupts the
            # cell), exactly as when an HTTP response is closed half-read.
            if sock.busy or sock.closed or self._closed:
                self._drop_socket()
        return execution if ended else _aborted(execution, *failure)

    @staticmethod
    def _fold(execution: Execution, message: dict[str, Any], callbacks: Callbacks) -> bool:
        """Apply one streamed message; True at ``end_of_execution``."""
        kind = message.get("type")
        if kind in ("stdout", "stderr"):
            text = str(message["text"])
            logs = execution.logs.stdout if kind == "stdout" else execution.logs.stderr
            logs.append(text)
            callback = callbacks.on_stdout if kind == "stdout" else callbacks.on_stderr
            if callback is not None:
                callback(
                    OutputMessage(text, timestamp=int(message["timestamp"]), error=kind == "stderr")
                )
        elif kind == "result":
            result = Result(**{k: v for k, v in message.items() if k in _RESULT_FIELDS})
            if result.extra is None:
                result.extra = {}
            execution.results.append(result)
            if callbacks.on_result is not None:
                callbacks.on_result(result)
        elif kind == "error":
            error = ExecutionError(message["name"], message["value"], message["traceback"])
            execution.error = error
            if callbacks.on_error is not None:
                callbacks.on_error(error)
        elif kind == "number_of_executions":
            execution.execution_count = message["execution_count"]
        elif kind == "end_of_execution":
            if "exception" in message:
                failure = message["exception"]
                raise _error(str(failure.get("type")), str(failure.get("message")))
            execution.status = message["status"]
            execution.duration = float(message["duration"])
            execution.truncated = bool(message["truncated"])
            final = message.get("error")
            execution.error = None if final is None else ExecutionError(**final)
            network = message.get("network")
            if isinstance(network, list):
                execution.network = [_network_event(item) for item in network]
            usage = message.get("usage")
            if isinstance(usage, dict):
                names = {f.name for f in fields(ResourceUsage)}
                execution.usage = ResourceUsage(**{k: v for k, v in usage.items() if k in names})
            return True
        return False

    # --- contexts ---------------------------------------------------------------------
    def create_code_context(self, cwd: str | None, language: str | None) -> Context:
        body = {"cwd": cwd, "language": language}
        return context_from_wire(self._request("POST", self._path("/contexts"), json=body).json())

    def list_code_contexts(self) -> list[Context]:
        items = self._request("GET", self._path("/contexts")).json()
        return [context_from_wire(item) for item in items]

    def restart_code_context(self, context: str) -> None:
        self._request("POST", self._path(f"/contexts/{context}/restart"))

    def remove_code_context(self, context: str) -> None:
        self._request("DELETE", self._path(f"/contexts/{context}"))

    # --- commands ---------------------------------------------------------------------
    def run_command(
        self,
        cmd: str,
        *,
        cwd: str | None,
        envs: dict[str, str],
        timeout: float,
        callbacks: Callbacks,
    ) -> CommandResult:
        limit = timeout
        body = {"cmd": cmd, "cwd": cwd, "envs": envs, "timeout": limit}
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        wait = httpx.Timeout(limit + HOST_BACKSTOP + STREAM_SLACK, connect=10.0)
        try:
            with self._client.stream(
                "POST", self._path("/commands"), json=body, timeout=wait
            ) as response:
                _raise_for(response)
                for line in response.iter_lines():
                    if not line:
                        continue
                    message = json.loads(line)
                    kind = message.get("type")
                    if kind in ("stdout", "stderr"):
                        out[kind].append(message["text"])
                        callback = callbacks.on_stdout if kind == "stdout" else callbacks.on_stderr
                        if callback is not None:
                            callback(OutputMessage(message["text"], error=kind == "stderr"))
                    elif kind == "end_of_command":
                        if "exception" in message:
                            failure = message["exception"]
                            raise _error(str(failure.get("type")), str(failure.get("message")))
                        return CommandResult(
                            "".join(out["stdout"]),
                            "".join(out["stderr"]),
                            int(message["exit_code"]),
                            message.get("error"),
                        )
        except httpx.TimeoutException:
            error = "timeout"
        except httpx.TransportError as exc:
            error = f"sandbox lost: connection to the server lost ({exc})"
        else:
            error = "sandbox lost: the server ended the stream early"
        return CommandResult("".join(out["stdout"]), "".join(out["stderr"]), -1, error)

    # --- background processes -----------------------------------------------------------
    def start_process(
        self,
        cmd: str,
        *,
        cwd: str | None,
        envs: dict[str, str],
        timeout: float | None,
        stdin: bool,
        pty: PtySize | None = None,
    ) -> RemoteProcessStream:
        body: dict[str, Any] = {
            "cmd": cmd,
            "cwd": cwd,
            "envs": envs,
            "timeout": timeout or 0,
            "stdin": stdin,
        }
        if pty is not None:
            body["pty"] = {"rows": pty.rows, "cols": pty.cols}
        return self._open_process("POST", self._path("/processes"), json=body)

    def connect_process(self, pid: int) -> RemoteProcessStream:
        return self._open_process("GET", self._path(f"/processes/{pid}"))

    def _open_process(self, method: str, url: str, **kwargs: Any) -> RemoteProcessStream:
        # No read timeout: a background process may be silent for as long as it runs.
        request = self._client.build_request(
            method, url, timeout=httpx.Timeout(None, connect=10.0), **kwargs
        )
        try:
            response = self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise errors.ServerError(f"cannot reach the sandlot server: {exc}") from exc
        try:
            _raise_for(response)
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line))
            if first.get("type") == "end" and "exception" in first:
                failure = first["exception"]
                raise _error(str(failure.get("type")), str(failure.get("message")))
            if first.get("type") != "started":
                raise errors.ServerError(f"the server answered {first.get('type')!r}, not started")
        except BaseException:
            response.close()
            raise
        return RemoteProcessStream(response, lines, int(first["pid"]))

    def list_processes(self) -> list[ProcessInfo]:
        items = self._request("GET", self._path("/processes")).json()
        return [process_from_wire(item) for item in items]

    def kill_process(self, pid: int) -> bool:
        return bool(self._request("DELETE", self._path(f"/processes/{pid}")).json()["killed"])

    def send_stdin(self, pid: int, data: bytes) -> None:
        # In pieces well within the server's request body limit.
        for start in range(0, max(len(data), 1), STDIN_PIECE):
            piece = base64.b64encode(data[start : start + STDIN_PIECE]).decode("ascii")
            self._request("POST", self._path(f"/processes/{pid}/stdin"), json={"data": piece})

    def close_stdin(self, pid: int) -> None:
        self._request("POST", self._path(f"/processes/{pid}/close-stdin"))

    def resize_pty(self, pid: int, size: PtySize) -> None:
        body = {"rows": size.rows, "cols": size.cols}
        self._request("POST", self._path(f"/processes/{pid}/resize"), json=body)

    # --- files ------------------------------------------------------------------------
    def read_chunks(self, path: str) -> Iterator[bytes]:
        try:
            with self._client.stream(
                "GET", self._path("/files"), params={"path": path}
            ) as response:
                _raise_for(response)
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise errors.SandboxLost(f"the server stopped sending {path}: {exc}") from exc

    def write(self, path: str, chunks: Iterator[bytes], metadata: Mapping[str, str]) -> WriteInfo:
        headers = {"content-type": "application/octet-stream"}
        headers.update({f"{METADATA_HEADER}{key}": value for key, value in metadata.items()})
        # No read timeout: a large upload may take long; connect still bounds a dead server.
        info = self._request(
            "POST",
            self._path("/files"),
            params={"path": path},
            content=chunks,
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
        ).json()
        kind = info.get("type")
        stored = metadata_from_wire(info.get("metadata"))
        if (stored or {}) != dict(metadata):
            # A server that predates file metadata ignores the headers: say so rather
            # than report a write that lost what it was asked to store.
            raise errors.ServerError(
                f"the server did not store {path}'s metadata (it answered {stored!r}): "
                "upgrade the sandlot server"
            )
        return WriteInfo(
            name=str(info["name"]),
            type=FileType(kind) if kind in ("file", "dir") else None,
            path=str(info["path"]),
            metadata=stored,
        )

    def list_dir(self, path: str, depth: int) -> list[EntryInfo]:
        params = {"path": path, "depth": depth}
        return entries_from_wire(
            self._request("GET", self._path("/files/list"), params=params).json()
        )

    def stat(self, path: str) -> EntryInfo:
        params = {"path": path}
        return entry_from_wire(
            self._request("GET", self._path("/files/info"), params=params).json()
        )

    def remove(self, path: str) -> None:
        self._request("DELETE", self._path("/files"), params={"path": path})

    def make_dir(self, path: str) -> bool:
        response = self._request("POST", self._path("/files/mkdir"), params={"path": path})
        return bool(response.json()["created"])

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        body = {"old_path": old_path, "new_path": new_path}
        return entry_from_wire(self._request("POST", self._path("/files/rename"), json=body).json())

    def watch_dir(self, path: str, recursive: bool, include_entry: bool) -> RemoteWatchStream:
        body: dict[str, Any] = {"path": path, "recursive": recursive}
        if include_entry:  # only then: an older server refuses what it does not know
            body["include_entry"] = True
        # No read timeout: a directory may stay quiet for as long as it is watched.
        request = self._client.build_request(
            "POST",
            self._path("/files/watch"),
            json=body,
            timeout=httpx.Timeout(None, connect=10.0),
        )
        try:
            response = self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise errors.ServerError(f"cannot reach the sandlot server: {exc}") from exc
        try:
            _raise_for(response)
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line))
            if first.get("type") != "started":
                raise errors.ServerError(f"the server answered {first.get('type')!r}, not started")
        except BaseException:
            response.close()
            raise
        return RemoteWatchStream(response, lines)


class RemoteProcessStream:
    """A background process's events from the server's NDJSON stream (a ``ProcessStream``)."""

    def __init__(self, response: httpx.Response, lines: Iterator[str], pid: int) -> None:
        self._response = response
        self._lines = lines
        self._pid = pid
        self._closed = False

    @property
    def pid(self) -> int:
        return self._pid

    def events(self) -> Iterator[ProcessEvent]:
        try:
            for line in self._lines:
                if not line:
                    continue
                message = json.loads(line)
                kind = message.get("type")
                if kind == "stdout":
                    yield ProcessEvent(stdout=str(message["text"]))
                elif kind == "stderr":
                    yield ProcessEvent(stderr=str(message["text"]))
                elif kind == "pty":
                    yield ProcessEvent(pty=base64.b64decode(message["data"]))
                elif kind == "end":
                    if "exception" in message:
                        failure = message["exception"]
                        raise _error(str(failure.get("type")), str(failure.get("message")))
                    error = message.get("error")
                    yield ProcessEvent(
                        end=True,
                        exit_code=int(message["exit_code"]),
                        error=None if error is None else str(error),
                    )
                    return
                elif kind == "error":  # the server cut a client that read too slowly
                    raise errors.ServerError(str(message.get("value")))
        except (httpx.TransportError, httpx.StreamError) as exc:
            if not self._closed:
                raise errors.SandboxLost(f"the connection to the server was lost: {exc}") from exc
        finally:
            with contextlib.suppress(httpx.HTTPError, httpx.StreamError, OSError):
                self._response.close()

    def close(self) -> None:
        """Disconnect: the server then detaches; the process runs on. Another thread may
        be blocked reading this response, which closing it would not wake: the socket is
        shut down under it, so that read ends now, not at the process's next output."""
        self._closed = True
        network = self._response.extensions.get("network_stream")
        sock = network.get_extra_info("socket") if network is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(httpx.HTTPError, httpx.StreamError, OSError):
            self._response.close()


class RemoteWatchStream(RemoteProcessStream):
    """A directory watch's events from the server's NDJSON stream (a ``WatchStream``).
    Closing it disconnects; the server then stops the watch."""

    def __init__(self, response: httpx.Response, lines: Iterator[str]) -> None:
        super().__init__(response, lines, 0)

    def events(self) -> Iterator[FilesystemEvent]:  # type: ignore[override]
        try:
            for line in self._lines:
                if not line:
                    continue
                message = json.loads(line)
                kind = message.get("type")
                if kind == "event" and message.get("event_type") in EVENT_TYPES:
                    yield FilesystemEvent(
                        name=str(message["name"]),
                        type=message["event_type"],
                        entry=event_entry(message.get("entry")),
                    )
                elif kind == "end":
                    return
                elif kind == "error":  # the server cut a client that read too slowly
                    raise errors.ServerError(str(message.get("value")))
        except (httpx.TransportError, httpx.StreamError) as exc:
            if not self._closed:
                raise errors.SandboxLost(f"the connection to the server was lost: {exc}") from exc
        finally:
            with contextlib.suppress(httpx.HTTPError, httpx.StreamError, OSError):
                self._response.close()


def _network_body(policy: NetworkPolicy) -> dict[str, Any]:
    """The policy's fields for the server, caps only where they differ from the
    defaults: a cap left out takes the server's (possibly lower) limit instead."""
    default = NetworkPolicy()
    body: dict[str, Any] = {"allow_out": list(policy.allow_out), "deny_out": list(policy.deny_out)}
    for name in ("max_bytes_out", "max_bytes_in", "max_connections"):
        if getattr(policy, name) != getattr(default, name):
            body[name] = getattr(policy, name)
    return body


def _network_event(item: Mapping[str, Any]) -> NetworkEvent:
    names = {f.name for f in fields(NetworkEvent)}
    return NetworkEvent(**{k: v for k, v in item.items() if k in names})


def _aborted(execution: Execution, status: Any, name: str, value: str) -> Execution:
    execution.status = status
    execution.error = ExecutionError(name, value)
    return execution


def _text_frame(payload: bytes) -> bytes:
    """A client's text frame (RFC 6455 5.2): final, masked with 4 fresh random bytes."""
    size = len(payload)
    if size < 126:
        head = bytes((0x81, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x81, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x81, 0x80 | 127)) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    key = (mask * (size // 4 + 1))[:size]
    masked = int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")
    return head + mask + masked.to_bytes(size, "little")


class NoCellSocket(Exception):
    """The server does not offer the cell WebSocket (an older server, a proxy or ASGI
    server in between that does not pass the upgrade on): cells go over HTTP."""


class NotSent(ConnectionError):
    """The connection failed before the server had the whole cell: it did not run it."""


class CellSocket:
    """One sandbox's cell WebSocket (``/v1/sandboxes/{id}/cells``, see
    ``sandlot.server._cellsocket``): one cell at a time, each a request frame and then
    the cell's NDJSON stream, as the HTTP route sends it, in one or more frames.

    Blocking, on a plain socket (TLS for ``https://``) with wsproto's protocol state
    machine; the async twin runs it in a worker thread as it runs the HTTP client.

    On a plain socket the frames a cell takes (its request, whole unmasked text frames
    back, and pings) are made and read here: about 30 us of a ``1+1`` cell's ~140 us on
    the client went to wsproto's way. The first frame of any other kind (a close, a
    fragment) and everything after it go to wsproto, which has seen no data frame and
    so takes the stream up in its own state. That needs wsproto to hold no byte past
    the handshake's response: the handshake is read up to its end exactly."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self.closed = False
        self.busy = False  # a cell was sent and its stream has not ended
        self.used = time.monotonic()
        # Frames are parsed here (see above) while this is True, from the handshake's
        # end on. MSG_PEEK, which reading the handshake exactly needs, is not there on
        # TLS: wsproto parses those.
        self._fast = False
        self._head = not isinstance(sock, ssl.SSLSocket)  # reading the handshake exactly
        self._head_tail = b""  # its last 3 bytes read (its end may straddle two reads)
        self._exact = False  # the handshake's response was read to its end exactly
        self._frames = bytearray()  # received, not parsed yet (while _fast)
        self._quiet = select.poll()  # whether anything arrived between cells
        self._quiet.register(sock, select.POLLIN)

    @classmethod
    def connect(cls, base_url: str, key: str, sandbox_id: str) -> CellSocket:
        """Open and upgrade; raises :class:`NoCellSocket` if the server does not offer
        it (or the handshake fails), the typed error if it refuses this key or sandbox,
        ``OSError`` if the server cannot be reached at all."""
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https"):
            raise NoCellSocket(url.scheme)
        proxies = urllib.request.getproxies()
        if (url.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(
            url.host
        ):
            raise NoCellSocket("a proxy is configured")  # it may not pass the upgrade on
        port = url.port or (443 if url.scheme == "https" else 80)
        sock = socket.create_connection((url.host, port), timeout=CONNECT_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if url.scheme == "https":
                sock = _tls_context().wrap_socket(sock, server_hostname=url.host)
            self = cls(sock)
            host = url.host if url.port is None else f"{url.host}:{url.port}"
            target = f"{url.path.rstrip('/')}/v1/sandboxes/{sandbox_id}/cells"
            self._sock.sendall(
                self._ws.send(
                    ws.Request(
                        host=host,
                        target=target,
                        extra_headers=[(b"authorization", f"Bearer {key}".encode())],
                    )
                )
            )
            self._handshake()
            return self
        except OSError as exc:
            # Connected, but no upgrade came of it (no answer in time, a reset, TLS
            # refused, not HTTP): not offered here; HTTP reports what is wrong, if
            # anything is.
            sock.close()
            raise NoCellSocket(f"the WebSocket handshake failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def _handshake(self) -> None:
        status: int | None = None
        headers: dict[bytes, bytes] = {}
        body = b""
        for event in self._events():
            if isinstance(event, ws.AcceptConnection):
                self._sock.settimeout(None)
                # Read to its end exactly (else, on TLS, wsproto may hold frames): the
                # frames from here on are this object's to parse.
                self._fast = self._exact
                return
            if isinstance(event, ws.RejectConnection):
                status, headers = event.status_code, dict(event.headers)
                if not event.has_body:
                    break
            elif isinstance(event, ws.RejectData):
                body += event.data
                if len(body) > 64 * 1024:
                    break
                if event.body_finished:
                    break
        self.close()
        # The server's own refusal (a key or a sandbox it does not accept) is answered
        # as the HTTP route would answer it; anything else means no WebSocket here.
        error: Any = None
        if headers.get(b"content-type", b"").startswith(b"application/json"):
            with contextlib.suppress(ValueError):
                error = json.loads(body)
        if isinstance(error, dict) and error.get("type") and status is not None:
            raise _error(str(error["type"]), str(error.get("message")), status)
        raise NoCellSocket(f"the server answered the upgrade with {status}")

    def _events(self) -> Iterator[ws.Event]:
        """The connection's events as they arrive (pings answered here); ``OSError``
        (``TimeoutError`` included) as the socket raises it."""
        while True:
            for event in self._pending():
                if isinstance(event, ws.Ping):
                    self._sock.sendall(self._ws.send(event.response()))
                    continue
                yield event
            if self.closed:
                raise ConnectionError("the server closed the connection")
            data = self._recv()
            if not data:
                # wsproto reports the abrupt end as a close (1006) on the next pass.
                self.closed = True
            try:
                self._receive(data or None)
            except wsproto.utilities.ProtocolError as exc:
                self.closed = True
                raise ConnectionError(f"the server broke the WebSocket protocol: {exc}") from exc

    def _recv(self) -> bytes:
        if not self._head:
            return self._sock.recv(256 * 1024)
        # The handshake's response, and not a byte past its head: what follows is frames.
        peeked = self._sock.recv(64 * 1024, socket.MSG_PEEK)
        end = (self._head_tail + peeked).find(b"\r\n\r\n")
        want = len(peeked) if end < 0 else end + 4 - len(self._head_tail)
        data = self._sock.recv(want)
        if end >= 0 and len(data) == want:
            self._head = False
            self._exact = True
        self._head_tail = (self._head_tail + data)[-3:]
        return data

    def _receive(self, data: bytes | None) -> None:
        """Take bytes received (None: the connection ended)."""
        if not self._fast:
            self._ws.receive_data(data)
        elif data is None:
            self._to_wsproto()
            self._ws.receive_data(None)
        else:
            self._frames += data

    def _to_wsproto(self) -> None:
        """From here on wsproto parses (what is not parsed yet included)."""
        self._fast = False
        pending = bytes(self._frames)
        self._frames.clear()
        if pending:
            self._ws.receive_data(pending)

    def _pending(self) -> Iterator[ws.Event]:
        """The events in what was received so far."""
        frames = self._frames
        while self._fast and len(frames) >= 2:
            # FIN, no extension bits, a text frame or a ping (the ASGI server's keepalive;
            # a control frame's payload is at most 125 bytes); never masked by a server.
            kind, size = frames[0], frames[1]
            if not (kind == 0x81 or (kind == 0x89 and size <= 125)) or size & 0x80:
                self._to_wsproto()
                break
            start = 2
            if size >= 126:
                start = 4 if size == 126 else 10
                if len(frames) < start:
                    return
                size = int.from_bytes(frames[2:start], "big")
            if len(frames) < start + size:
                return  # the rest of the frame is on its way
            if kind == 0x89:
                payload = bytes(frames[start : start + size])
                del frames[: start + size]
                yield ws.Ping(payload=payload)
                continue
            try:
                text = frames[start : start + size].decode("utf-8")
            except UnicodeDecodeError:
                self._to_wsproto()  # which closes the connection as the protocol says
                break
            del frames[: start + size]
            yield ws.TextMessage(data=text)
        if not self._fast:
            yield from self._ws.events()

    def alive(self) -> bool:
        """Whether the connection may take a cell: not idle past :data:`SOCKET_IDLE`,
        and nothing from the server pending but pings (a close, the end of the stream)."""
        if self.closed or time.monotonic() - self.used > SOCKET_IDLE:
            return False
        if self._fast and not self._frames and not self._quiet.poll(0):
            # Nothing arrived (the usual case): one poll, where a non-blocking read would
            # cost two timeout changes and an exception. (Not on TLS, whose socket may
            # hold decrypted bytes that poll does not see; there _fast is False.)
            return True
        try:
            for event in self._pending():  # what came in behind the last cell's end
                if isinstance(event, ws.Ping):
                    self._sock.sendall(self._ws.send(event.response()))
                else:
                    return False
            self._sock.settimeout(0.0)
            while True:
                data = self._sock.recv(64 * 1024)
                if not data:
                    return False
                self._receive(data)  # a broken frame: ProtocolError, below
                for event in self._pending():
                    if isinstance(event, ws.Ping):
                        self._sock.sendall(self._ws.send(event.response()))
                    else:
                        return False  # nothing else may arrive between cells
        except (BlockingIOError, ssl.SSLWantReadError):
            return True
        except (OSError, wsproto.utilities.ProtocolError):
            return False

    def cell(self, body: dict[str, Any], wait: float) -> Iterator[dict[str, Any]]:
        """Send a cell and yield its stream's messages, the last ``end_of_execution``.
        Raises ``OSError`` (``TimeoutError`` after ``wait`` seconds of silence) if the
        connection fails, the typed error of a refused cell, and :class:`ConnectionError`
        if the server ends the connection."""
        self.used = time.monotonic()
        self.busy = True
        if self._sock.gettimeout() != wait:
            self._sock.settimeout(wait)
        request = json.dumps({"type": "execute", **body})
        try:
            if self._fast:
                if self._ws.state is not wsproto.connection.ConnectionState.OPEN:
                    raise wsproto.utilities.LocalProtocolError("the connection is closing")
                frame = _text_frame(request.encode("utf-8", "surrogatepass"))
            else:
                frame = self._ws.send(ws.TextMessage(request))
            self._sock.sendall(frame)
        except (OSError, wsproto.utilities.ProtocolError) as exc:
            # Closed by the server meanwhile, or it refused a frame over its size limit
            # while it was being sent: either way it never had the whole request.
            self.closed = True
            raise NotSent(f"the cell was not sent: {exc}") from exc
        parts: list[str] = []
        for event in self._events():
            if isinstance(event, ws.TextMessage):
                parts.append(event.data)
                if not event.message_finished:
                    continue
                text = "".join(parts)
                parts.clear()
                for line in text.splitlines():
                    if not line:
                        continue
                    message = json.loads(line)
                    if message.get("type") == "refused":
                        self.busy = False
                        failure = message.get("error") or {}
                        raise _error(
                            str(failure.get("type")),
                            str(failure.get("message")),
                            int(message.get("status") or 0) or None,
                        )
                    if message.get("type") == "end_of_execution":
                        self.busy = False
                        self.used = time.monotonic()
                        yield message
                        return
                    yield message
            elif isinstance(event, ws.CloseConnection):
                self.closed = True
                if self._ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(OSError, wsproto.utilities.ProtocolError):
                        self._sock.sendall(self._ws.send(event.response()))
                if event.code == 1009:
                    raise errors.InvalidArgumentError(
                        "the cell is larger than the server accepts in one request"
                    )
                raise ConnectionError(f"the server closed the connection ({event.code})")

    def close(self) -> None:
        """Close (politely when the connection is still open); never raises."""
        if not self.closed and self._ws.state is wsproto.connection.ConnectionState.OPEN:
            with contextlib.suppress(OSError, wsproto.utilities.ProtocolError):
                self._sock.settimeout(1.0)
                self._sock.sendall(self._ws.send(ws.CloseConnection(code=1000)))
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
