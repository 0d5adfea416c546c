"""envd's Connect services (filesystem, process) over sandlot's Sandbox.

Served by the ``connectrpc`` package with the generated stubs the ``e2b`` package ships
(``e2b.envd.filesystem.filesystem_connect``, ``e2b.envd.process.process_connect``):
no hand-rolled codec. Imported only when the server starts, so ``e2b`` is needed only
by a server that serves E2B's wire (the ``server`` extra installs it).

The sandbox each call acts on was resolved and leased by
:class:`sandlot.server._e2b_plane.E2bWire` before the call (see ``current``).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import posixpath
import secrets
import shlex
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.types import ASGIApp

import sandlot
from sandlot import EntryInfo, FileType, SandlotError
from sandlot.server._e2b_plane import CONNECT_SERVICES, Target, current
from sandlot.server._manager import ApiError


def entry_fields(info: EntryInfo) -> dict[str, Any]:
    kind = {FileType.FILE: 1, FileType.DIR: 2}.get(info.type, 0) if info.type else 0
    return {
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "permissions": info.permissions,
        "modified_time": info.modified_time,
        "symlink_target": info.symlink_target,
        "metadata": dict(info.metadata or {}),
    }


def command_line(cmd: str, args: list[str]) -> str:
    return shlex.join([cmd, *args])


async def run_blocking(target: Target, function: Callable[..., Any], *args: Any) -> Any:
    return await target.state.blocking(function, *args)


_CODES: tuple[tuple[type[BaseException], Code], ...] = (
    # First match wins: subclasses before their parents.
    (sandlot.NotFoundError, Code.NOT_FOUND),
    (sandlot.ProcessNotFoundError, Code.NOT_FOUND),
    (sandlot.ProcessLimitError, Code.RESOURCE_EXHAUSTED),
    (sandlot.WatchLimitError, Code.RESOURCE_EXHAUSTED),
    (sandlot.ContextNotFoundError, Code.NOT_FOUND),
    (sandlot.PathNotAllowedError, Code.PERMISSION_DENIED),
    (sandlot.InvalidArgumentError, Code.INVALID_ARGUMENT),
    (sandlot.PolicyError, Code.INVALID_ARGUMENT),
    (sandlot.FileOperationError, Code.INVALID_ARGUMENT),
    (sandlot.SandboxClosed, Code.UNAVAILABLE),
    (sandlot.SandboxLost, Code.UNAVAILABLE),
    (sandlot.QuotaExceeded, Code.RESOURCE_EXHAUSTED),
    (sandlot.BackendError, Code.UNAVAILABLE),
)
_HTTP_CODES = {
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    429: Code.RESOURCE_EXHAUSTED,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
}


def _connect_error(exc: BaseException) -> ConnectError:
    """A sandlot error as the Connect code the E2B SDK maps to its exception
    (NOT_FOUND: NotFoundException, INVALID_ARGUMENT: InvalidArgumentException...)."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, ApiError):
        return ConnectError(_HTTP_CODES.get(exc.status, Code.INVALID_ARGUMENT), exc.message)
    code = next((c for cls, c in _CODES if isinstance(exc, cls)), Code.INTERNAL)
    message = str(exc) if code is not Code.INTERNAL else f"{type(exc).__name__}: {exc}"
    return ConnectError(code, message)


def _target() -> Target:
    try:
        return current()
    except ApiError as exc:
        raise _connect_error(exc) from None


async def _call(function: Callable[..., Any], *args: Any) -> Any:
    target = _target()
    try:
        return await run_blocking(target, function, *args)
    except Exception as exc:
        raise _connect_error(exc) from None


async def _audited(
    kind: str, path: str | None, function: Callable[..., Any], *args: Any, **values: Any
) -> Any:
    """:func:`_call`, recorded as an operation of the request's principal (see
    :meth:`SandboxManager.audited`)."""
    target = _target()
    manager = target.state.manager
    return await _call(
        functools.partial(
            manager.audited, target.principal, target.entry, kind, path, function, *args, **values
        )
    )


def _entry(info: sandlot.EntryInfo) -> filesystem_pb.EntryInfo:
    fields = entry_fields(info)
    modified = datetime.datetime.fromtimestamp(fields.pop("modified_time"), datetime.UTC)
    target = fields.pop("symlink_target")
    entry = filesystem_pb.EntryInfo(
        modified_time=Timestamp.from_datetime(modified),
        owner="user",
        group="user",
        is_symlink=target is not None,
        **fields,
    )
    if target is not None:
        # envd names a link's target by its absolute path; sandlot reports what the
        # link says, which may be relative to the link's directory.
        entry.symlink_target = posixpath.normpath(
            posixpath.join(posixpath.dirname(info.path), target)
        )
    return entry


def _oneof(field: str, value: Any) -> Any:
    # The stubs type each oneof by its field names' literals; built from a variable here.
    return Oneof(field, value)


def _unimplemented(what: str, why: str) -> NoReturn:
    raise ConnectError(Code.UNIMPLEMENTED, f"{what} is not implemented by sandlot yet: {why}")


class FilesystemService(filesystem_connect.Filesystem):
    """envd's ``filesystem.Filesystem`` on ``sandbox.files`` (paths resolve inside the
    sandbox; relative ones under /home/user)."""

    async def stat(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        return filesystem_pb.StatResponse(entry=_entry(await _call(files.get_info, request.path)))

    async def list_dir(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        depth = request.depth or 1
        entries = await _call(files.list, request.path, depth)
        return filesystem_pb.ListDirResponse(entries=[_entry(item) for item in entries])

    async def make_dir(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        if not await _audited("mkdir", request.path, files.make_dir, request.path):
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        return filesystem_pb.MakeDirResponse(
            entry=_entry(await _call(files.get_info, request.path))
        )

    async def move(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        info = await _audited(
            "rename",
            request.source,
            files.rename,
            request.source,
            request.destination,
            destination=request.destination,
        )
        return filesystem_pb.MoveResponse(entry=_entry(info))

    async def remove(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        try:
            await _audited("remove", request.path, files.remove, request.path)
        except ConnectError as exc:
            # envd removes as ``rm -rf`` does: a path that is not there is no error.
            if exc.code is not Code.NOT_FOUND:
                raise
        return filesystem_pb.RemoveResponse()

    def __init__(self) -> None:
        # The polling watchers (CreateWatcher...): id -> (sandbox id, watch). Each
        # sandbox's runner caps its watches; entries of ended sandboxes are dropped.
        self._watchers: dict[str, tuple[str, sandlot.WatchHandle]] = {}
        self._lock = threading.Lock()

    async def watch_dir(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        target = _target()
        handle = await _call(_watch(target, request))
        start = filesystem_pb.WatchDirResponse.StartEvent()
        try:
            yield filesystem_pb.WatchDirResponse(event=_oneof("start", start))
            # Polled: the handle keeps a bounded backlog (then an overflow marker), so a
            # slow client costs the server nothing more.
            while handle.running:
                for event in _fs_events(handle.get_new_events()):
                    yield filesystem_pb.WatchDirResponse(event=_oneof("filesystem", event))
                await asyncio.sleep(WATCH_POLL)
        finally:
            await run_blocking(target, handle.stop)

    async def create_watcher(self, request: Any, ctx: Any) -> Any:
        target = _target()
        self._prune(target)
        handle = await _call(_watch(target, request))
        watcher_id = secrets.token_hex(12)
        with self._lock:
            self._watchers[watcher_id] = (target.entry.sandbox_id, handle)
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(self, request: Any, ctx: Any) -> Any:
        handle = self._watcher(request.watcher_id)
        try:
            events = handle.get_new_events()
        except SandlotError as exc:
            raise _connect_error(exc) from None
        return filesystem_pb.GetWatcherEventsResponse(events=list(_fs_events(events)))

    async def remove_watcher(self, request: Any, ctx: Any) -> Any:
        handle = self._watcher(request.watcher_id)
        with self._lock:
            self._watchers.pop(request.watcher_id, None)
        await run_blocking(_target(), handle.stop)
        return filesystem_pb.RemoveWatcherResponse()

    def _watcher(self, watcher_id: str) -> sandlot.WatchHandle:
        target = _target()
        with self._lock:
            found = self._watchers.get(watcher_id)
        # Another sandbox's watcher is as unknown as one that never was.
        if found is None or found[0] != target.entry.sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id!r} not found")
        return found[1]

    def _prune(self, target: Target) -> None:
        live = {entry.sandbox_id for entry in target.state.manager.all()}
        with self._lock:
            gone = [
                key for key, (sandbox_id, _) in self._watchers.items() if sandbox_id not in live
            ]
            handles = [self._watchers.pop(key)[1] for key in gone]
        for handle in handles:
            handle.stop()


WATCH_POLL = 0.05
"""Seconds between two looks at a streamed watch's new events."""

_EVENT_TYPES = {"create": 1, "write": 2, "remove": 3, "rename": 4, "chmod": 5}
"""sandlot's event types as envd's EventType (an ``overflow`` marker has none)."""


def _watch(target: Target, request: Any) -> Callable[[], sandlot.WatchHandle]:
    """The watch a WatchDir or CreateWatcher request asks for. ``allow_network_mounts``
    lifts envd's refusal of a network filesystem; sandlot's workspace (tmpfs, or the
    backend's local directories) is never one, so there is nothing to lift."""
    return functools.partial(
        target.entry.sandbox.files.watch_dir,
        request.path,
        recursive=request.recursive,
        include_entry=request.include_entry,
    )


def _fs_events(events: list[sandlot.FilesystemEvent]) -> Iterator[Any]:
    for event in events:
        kind = _EVENT_TYPES.get(event.type)
        if kind is not None:
            message = filesystem_pb.FilesystemEvent(
                name=event.name, type=filesystem_pb.EventType(kind)
            )
            if event.entry is not None:
                message.entry = _entry(event.entry)
            yield message


def _check_not_cut(target: Target, result: Any) -> None:
    """A command that did not run to its end answers as envd's does: its deadline
    passed (DEADLINE_EXCEEDED, the SDK's TimeoutException), or its sandbox was killed
    (UNAVAILABLE, which the SDK confirms with a health probe), not an exit code."""
    if not target.state.manager.registered(target.entry):
        raise ConnectError(
            Code.UNAVAILABLE,
            f"the sandbox {target.entry.sandbox_id} ended before the command completed",
        )
    if result is not None and result.error == "timeout":
        raise ConnectError(Code.DEADLINE_EXCEEDED, "the command exceeded its timeout")


class ProcessService(process_connect.Process):
    """envd's ``process.Process`` on sandlot's process API (``sandbox.commands``,
    ``sandbox.pty``).

    Every ``Start`` is a background process of the sandbox, as in envd: the E2B SDK's
    foreground ``commands.run`` is a ``Start`` it reads to the end, and a client that
    disconnects leaves the process running (``commands.connect`` reattaches). The
    call's deadline (the SDK's ``timeout``) is the process's lifetime, within the
    tenant's cell-timeout ceiling; none means that ceiling.
    """

    async def start(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        target = _target()
        sandbox = target.entry.sandbox
        config = request.process or process_pb.ProcessConfig()
        cwd = config.cwd if config.has_field("cwd") and config.cwd else None
        envs = dict(config.envs)
        limit = target.state.manager.cell_timeout_ceiling(target.entry.tenant)
        remaining = ctx.timeout_ms
        timeout = min(limit, remaining / 1000.0) if remaining else limit
        if timeout <= 0:
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the command's deadline has passed")
        if request.pty is not None:
            size = request.pty.size or process_pb.PTY.Size(rows=24, cols=80)
            kind, line = "pty", None
            start = functools.partial(
                sandbox.pty.create,
                sandlot.PtySize(rows=size.rows or 24, cols=size.cols or 80),
                cwd=cwd,
                envs=envs,
                timeout=timeout,
            )
        else:
            if not config.cmd:
                raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
            kind, line = "process", command_line(config.cmd, list(config.args))
            start = functools.partial(
                sandbox.commands.run,
                line,
                cwd=cwd,
                envs=envs,
                timeout=timeout,
                background=True,
                stdin=bool(request.stdin),
            )
        # Recorded before it starts; the E2B SDK's foreground commands.run reads this
        # stream to the end, so its exit code lands in the same row.
        operation_id, handle = await _call(
            functools.partial(
                target.state.manager.start_audited,
                target.principal,
                target.entry,
                kind,
                line,
                start,
            )
        )
        async for event in _process_events(target, handle, operation_id):
            yield process_pb.StartResponse(event=event)

    async def connect(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        target = _target()
        handle = await _call(target.entry.sandbox.commands.connect, _pid_of(request.process))
        async for event in _process_events(target, handle):
            yield process_pb.ConnectResponse(event=event)

    async def list(self, request: Any, ctx: Any) -> Any:
        target = _target()
        processes = await _call(target.entry.sandbox.commands.list)
        return process_pb.ListResponse(processes=[_process_info(info) for info in processes])

    async def send_input(self, request: Any, ctx: Any) -> Any:
        await _send_input(_pid_of(request.process), request.input)
        return process_pb.SendInputResponse()

    async def stream_input(self, request: Any, ctx: Any) -> Any:
        pid: int | None = None
        async for message in request:
            event = message.event
            if event is None:
                continue
            if event.field == "start":
                pid = _pid_of(event.value.process)
            elif event.field == "data":
                if pid is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event")
                await _send_input(pid, event.value.input)
        return process_pb.StreamInputResponse()

    async def send_signal(self, request: Any, ctx: Any) -> Any:
        # SIGTERM and SIGKILL alike end the process group and every descendant: a
        # sandboxed command gets no grace period to outlive its kill.
        pid = _pid_of(request.process)
        if not await _audited("kill", None, _target().entry.sandbox.commands.kill, pid, pid=pid):
            raise ConnectError(Code.NOT_FOUND, "no such process is running")
        return process_pb.SendSignalResponse()

    async def close_stdin(self, request: Any, ctx: Any) -> Any:
        await _call(_target().entry.sandbox.commands.close_stdin, _pid_of(request.process))
        return process_pb.CloseStdinResponse()

    async def update(self, request: Any, ctx: Any) -> Any:
        if request.pty is None or request.pty.size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "only a terminal's size can be updated")
        size = sandlot.PtySize(rows=request.pty.size.rows, cols=request.pty.size.cols)
        await _call(_target().entry.sandbox.pty.resize, _pid_of(request.process), size)
        return process_pb.UpdateResponse()


def _pid_of(selector: Any) -> int:
    if selector is None or selector.selector is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector is required")
    if selector.selector.field != "pid":
        raise ConnectError(Code.NOT_FOUND, "sandlot selects processes by pid only")
    return int(selector.selector.value)


async def _send_input(pid: int, data: Any) -> None:
    if data is None or data.input is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "no input given")
    sandbox = _target().entry.sandbox
    value = bytes(data.input.value)
    await _audited("stdin", None, sandbox.commands.send_stdin, pid, value, pid=pid, size=len(value))


def _process_info(info: sandlot.ProcessInfo) -> Any:
    config = process_pb.ProcessConfig(cmd=info.cmd, args=list(info.args), envs=dict(info.envs))
    if info.cwd:
        config.cwd = info.cwd
    item = process_pb.ProcessInfo(config=config, pid=info.pid)
    if info.tag:
        item.tag = info.tag
    return item


async def _process_events(
    target: Target, handle: sandlot.CommandHandle, operation_id: str | None = None
) -> AsyncIterator[Any]:
    """A handle's life as envd's events: start (pid), output, end. A client that goes
    away (the call is cancelled) only detaches: the process runs on. With
    ``operation_id`` (the call that started it), the end is recorded in its row."""
    start = process_pb.ProcessEvent.StartEvent(pid=handle.pid)
    yield process_pb.ProcessEvent(event=_oneof("start", start))
    items = iter(handle)
    try:
        while True:
            try:
                item = await run_blocking(target, next, items, None)
            except Exception as exc:
                _check_not_cut(target, None)
                raise _connect_error(exc) from None
            if item is None:
                break
            stdout, stderr, pty = item
            if pty is not None:
                kind, value = "pty", pty
            elif stdout is not None:
                kind, value = "stdout", stdout.encode("utf-8", "surrogateescape")
            else:
                kind, value = "stderr", (stderr or "").encode("utf-8", "surrogateescape")
            data = process_pb.ProcessEvent.DataEvent(output=_oneof(kind, value))
            yield process_pb.ProcessEvent(event=_oneof("data", data))
    finally:
        handle.disconnect()
    exit_code = handle.exit_code if handle.exit_code is not None else -1
    if operation_id is not None and handle.exit_code is not None:
        await run_blocking(
            target,
            functools.partial(
                target.state.manager.operation_finished,
                operation_id,
                "ok",
                pid=handle.pid,
                exit_code=handle.exit_code,
                error_name=handle.error,
            ),
        )
    _check_not_cut(target, sandlot.CommandResult(handle.stdout, "", exit_code, handle.error))
    end = process_pb.ProcessEvent.EndEvent(
        exit_code=exit_code,
        exited=exit_code >= 0,
        status=handle.error or f"exit status {exit_code}",
    )
    if handle.error:
        end.error = handle.error
    yield process_pb.ProcessEvent(event=_oneof("end", end))


def apps(read_max_bytes: int) -> Callable[[str], ASGIApp | None]:
    """The Connect ASGI app that serves ``path``, or None."""
    filesystem = filesystem_connect.FilesystemASGIApplication(
        FilesystemService(),
        read_max_bytes=read_max_bytes,
    )
    process = process_connect.ProcessASGIApplication(
        ProcessService(),
        read_max_bytes=read_max_bytes,
    )
    by_prefix: dict[str, ASGIApp] = {
        CONNECT_SERVICES[0]: filesystem,
        CONNECT_SERVICES[1]: process,
    }

    def route(path: str) -> ASGIApp | None:
        for prefix, app in by_prefix.items():
            if path.startswith(prefix):
                return app
        return None

    return route
