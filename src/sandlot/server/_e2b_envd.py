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
import itertools
import posixpath
import shlex
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.types import ASGIApp

import sandlot
from sandlot import EntryInfo, FileType, SandlotError, stream_only
from sandlot.server._e2b_plane import CONNECT_SERVICES, Target, current
from sandlot.server._manager import ApiError

_PIDS = itertools.count(1000)


def next_pid() -> int:
    """A number for a started process: sandlot's foreground commands have no pid the
    client could use yet (background processes land with sandlot's process API)."""
    return next(_PIDS)


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
    }


def command_line(cmd: str, args: list[str]) -> str:
    return shlex.join([cmd, *args])


async def run_blocking(target: Target, function: Callable[..., Any], *args: Any) -> Any:
    return await target.state.blocking(function, *args)


async def stream_command(
    target: Target,
    cmd: str,
    cwd: str | None,
    envs: dict[str, str],
    timeout: float,
) -> AsyncIterator[tuple[str, Any]]:
    """Run a foreground command with sandlot's ``commands.run``, yielding
    ``("stdout"|"stderr", bytes)`` as it prints, then ``("end", CommandResult)``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def push(item: tuple[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            result = target.entry.sandbox.commands.run(
                cmd,
                cwd=cwd,
                envs=envs,
                timeout=timeout,
                on_stdout=stream_only(lambda m: push(("stdout", m.line.encode()))),
                on_stderr=stream_only(lambda m: push(("stderr", m.line.encode()))),
            )
            push(("end", result))
        except SandlotError as exc:
            push(("error", exc))
        except BaseException as exc:  # surfaced to the client, logged by the caller
            push(("error", exc))

    future = loop.run_in_executor(target.state.executor, work)
    try:
        while True:
            kind, value = await queue.get()
            yield kind, value
            if kind in ("end", "error"):
                return
    finally:
        # A client gone mid-command: the command runs to its timeout (sandlot has no
        # way to stop a foreground command yet); its output is dropped.
        future.add_done_callback(lambda f: f.exception())


_CODES: tuple[tuple[type[BaseException], Code], ...] = (
    # First match wins: subclasses before their parents.
    (sandlot.NotFoundError, Code.NOT_FOUND),
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
        if not await _call(files.make_dir, request.path):
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        return filesystem_pb.MakeDirResponse(
            entry=_entry(await _call(files.get_info, request.path))
        )

    async def move(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        info = await _call(files.rename, request.source, request.destination)
        return filesystem_pb.MoveResponse(entry=_entry(info))

    async def remove(self, request: Any, ctx: Any) -> Any:
        files = _target().entry.sandbox.files
        try:
            await _call(files.remove, request.path)
        except ConnectError as exc:
            # envd removes as ``rm -rf`` does: a path that is not there is no error.
            if exc.code is not Code.NOT_FOUND:
                raise
        return filesystem_pb.RemoveResponse()

    async def watch_dir(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        _unimplemented("files.watch_dir", "watch a directory by polling files.list")
        yield  # an async generator, as the stub's server-streaming endpoint expects

    async def create_watcher(self, request: Any, ctx: Any) -> Any:
        _unimplemented("files.watch_dir", "watch a directory by polling files.list")

    async def get_watcher_events(self, request: Any, ctx: Any) -> Any:
        _unimplemented("files.watch_dir", "watch a directory by polling files.list")

    async def remove_watcher(self, request: Any, ctx: Any) -> Any:
        _unimplemented("files.watch_dir", "watch a directory by polling files.list")


_BACKGROUND = (
    "sandlot's E2B wire runs foreground commands (commands.run); background processes, "
    "their handles and pty are being added to sandlot's process API"
)


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
    """envd's ``process.Process``: ``Start`` runs a foreground command with
    ``sandbox.commands.run`` and streams its output, then its exit code.

    The other verbs (List, Connect, SendInput, SendSignal, CloseStdin, StreamInput,
    Update) need background processes; they answer UNIMPLEMENTED here, the one place to
    wire them to sandlot's process API.
    """

    async def start(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        target = _target()
        if request.pty is not None:
            _unimplemented("pty", _BACKGROUND)
        if request.stdin:
            _unimplemented("commands.run(stdin=True)", _BACKGROUND)
        config = request.process or process_pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
        cwd = config.cwd if config.has_field("cwd") and config.cwd else None
        limit = target.state.manager.cell_timeout_ceiling(target.entry.tenant)
        remaining = ctx.timeout_ms
        timeout = min(limit, remaining / 1000.0) if remaining is not None else limit
        if timeout <= 0:
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the command's deadline has passed")
        start = process_pb.ProcessEvent.StartEvent(pid=next_pid())
        yield process_pb.StartResponse(event=process_pb.ProcessEvent(event=_oneof("start", start)))
        stream = stream_command(
            target, command_line(config.cmd, list(config.args)), cwd, dict(config.envs), timeout
        )
        async for kind, value in stream:
            if kind in ("stdout", "stderr"):
                data = process_pb.ProcessEvent.DataEvent(output=_oneof(kind, value))
                event = process_pb.ProcessEvent(event=_oneof("data", data))
            elif kind == "end":
                _check_not_cut(target, value)
                end = process_pb.ProcessEvent.EndEvent(
                    exit_code=value.exit_code,
                    exited=value.exit_code >= 0,
                    status=value.error or f"exit status {value.exit_code}",
                )
                if value.error:
                    end.error = value.error
                event = process_pb.ProcessEvent(event=_oneof("end", end))
            else:
                _check_not_cut(target, None)
                raise _connect_error(value)
            yield process_pb.StartResponse(event=event)

    async def list(self, request: Any, ctx: Any) -> Any:
        _unimplemented("commands.list", _BACKGROUND)

    async def connect(self, request: Any, ctx: Any) -> AsyncIterator[Any]:
        _unimplemented("commands.connect", _BACKGROUND)
        yield  # an async generator, as the stub's server-streaming endpoint expects

    async def update(self, request: Any, ctx: Any) -> Any:
        _unimplemented("pty.resize", _BACKGROUND)

    async def stream_input(self, request: Any, ctx: Any) -> Any:
        _unimplemented("streaming stdin", _BACKGROUND)

    async def send_input(self, request: Any, ctx: Any) -> Any:
        _unimplemented("commands.send_stdin", _BACKGROUND)

    async def send_signal(self, request: Any, ctx: Any) -> Any:
        _unimplemented("commands.kill", _BACKGROUND)

    async def close_stdin(self, request: Any, ctx: Any) -> Any:
        _unimplemented("commands.close_stdin", _BACKGROUND)


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
