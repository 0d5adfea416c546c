"""``AsyncSandbox``: the asyncio twin of :class:`sandlot.Sandbox`.

Each twin wraps the synchronous one and runs its calls in a worker thread
(``asyncio.to_thread``), so the event loop never blocks on a sandbox or a server and
the two cannot drift in what they check or return. Callbacks (``on_stdout``,
``on_result``, ``on_precheck``, ...) may be plain or coroutine functions; they run
on the event loop, in order. ``tests/unit/test_async_twin.py`` checks that every
public method of the sync twin exists here with the same parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, overload

from sandlot._exceptions import InvalidArgumentError
from sandlot._models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    OutputMessage,
    ProcessInfo,
    PtySize,
    Result,
    SnapshotInfo,
    WriteInfo,
)
from sandlot._precheck_gate import PrecheckHook, PrecheckMode
from sandlot._process import CommandHandle
from sandlot._sandbox import Commands, Filesystem, Pty, Sandbox, _ClassOrInstance
from sandlot._watch import FilesystemEvent, WatchHandle
from sandlot.policy import NetworkPolicy, Resources
from sandlot.validate import DEFAULT_COMMAND_TIMEOUT, DEFAULT_SANDBOX_TIMEOUT

if TYPE_CHECKING:
    import asyncio  # imported where a method runs: `import sandlot` stays light

    from sandlot.backends import Backend, SandboxHandle
    from sandlot.pool import Pool
    from sandlot.precheck import PrecheckReport

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFilesystem",
    "AsyncPty",
    "AsyncSandbox",
    "AsyncWatchHandle",
]

P = ParamSpec("P")
T = TypeVar("T")


async def _in_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    import asyncio

    return await asyncio.to_thread(functools.partial(function, *args, **kwargs))


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


async def _stream(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking chunk iterator, each ``next`` in a worker thread."""
    import asyncio

    done = object()
    try:
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            yield chunk  # type: ignore[misc]  # not the sentinel: a chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


class AsyncCommandHandle:
    """The asyncio twin of :class:`CommandHandle`: same members, awaited; ``async for``
    over it yields the same tuples. Callbacks may be plain or coroutine functions."""

    def __init__(self, sync: CommandHandle) -> None:
        self._sync = sync

    @property
    def pid(self) -> int:
        return self._sync.pid

    @property
    def stdout(self) -> str:
        return self._sync.stdout

    @property
    def stderr(self) -> str:
        return self._sync.stderr

    @property
    def exit_code(self) -> int | None:
        return self._sync.exit_code

    @property
    def error(self) -> str | None:
        return self._sync.error

    async def __aiter__(self) -> AsyncIterator[tuple[str | None, str | None, bytes | None]]:
        import asyncio

        done = object()
        iterator = iter(self._sync)
        while (item := await asyncio.to_thread(next, iterator, done)) is not done:
            yield item  # type: ignore[misc]  # not the sentinel: a tuple

    async def wait(
        self,
        on_pty: Callable[[bytes], Any] | None = None,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
    ) -> CommandResult:
        loop = _running_loop()
        return await _in_thread(
            self._sync.wait,
            _on_loop(loop, on_pty),
            _on_loop(loop, on_stdout),
            _on_loop(loop, on_stderr),
        )

    async def kill(self) -> bool:
        return await _in_thread(self._sync.kill)

    async def disconnect(self) -> None:
        await _in_thread(self._sync.disconnect)

    async def send_stdin(self, data: str | bytes) -> None:
        await _in_thread(self._sync.send_stdin, data)

    async def close_stdin(self) -> None:
        await _in_thread(self._sync.close_stdin)


class AsyncFilesystem:
    """``sandbox.files`` of an :class:`AsyncSandbox` (see :class:`sandlot.Filesystem`)."""

    def __init__(self, sync: Filesystem) -> None:
        self._sync = sync

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...
    @overload
    async def read(self, path: str, format: Literal["stream"]) -> AsyncIterator[bytes]: ...

    async def read(self, path: str, format: str = "text") -> str | bytes | AsyncIterator[bytes]:
        """Read a file as text (UTF-8), ``bytes``, or an async ``stream`` of chunks."""
        if format == "stream":
            # Checks the path now; nothing is fetched until the stream is iterated.
            return _stream(self._sync.read(path, "stream"))
        if format == "bytes":
            return await _in_thread(self._sync.read, path, "bytes")
        if format == "text":
            return await _in_thread(self._sync.read, path, "text")
        raise InvalidArgumentError("format must be 'text', 'bytes' or 'stream'")

    async def write(
        self,
        path: str,
        data: str | bytes | IO[Any],
        metadata: Mapping[str, str] | None = None,
    ) -> WriteInfo:
        """See :meth:`sandlot.Filesystem.write`."""
        return await _in_thread(self._sync.write, path, data, metadata)

    async def write_files(
        self, files: Iterable[Mapping[str, Any]], metadata: Mapping[str, str] | None = None
    ) -> list[WriteInfo]:
        """See :meth:`sandlot.Filesystem.write_files`."""
        return await _in_thread(self._sync.write_files, list(files), metadata)

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

    async def watch_dir(
        self,
        path: str,
        on_event: Callable[[FilesystemEvent], object] | None = None,
        recursive: bool = False,
        include_entry: bool = False,
    ) -> AsyncWatchHandle:
        """Watch a directory (see :meth:`sandlot.Filesystem.watch_dir`). ``on_event``
        runs on this event loop; a coroutine function is awaited one event at a time,
        in order (a slow one slows the watch down rather than piling up tasks)."""
        import asyncio

        callback = _on_loop(asyncio.get_running_loop(), on_event)
        handle = await _in_thread(self._sync.watch_dir, path, callback, recursive, include_entry)
        return AsyncWatchHandle(handle)


class AsyncWatchHandle:
    """A directory watch of an :class:`AsyncSandbox` (see :class:`sandlot.WatchHandle`)."""

    def __init__(self, handle: WatchHandle) -> None:
        self._handle = handle

    @property
    def running(self) -> bool:
        return self._handle.running

    async def wait(self, timeout: float | None = None) -> bool:
        return await _in_thread(self._handle.wait, timeout)

    async def get_new_events(self) -> list[FilesystemEvent]:
        return self._handle.get_new_events()

    async def stop(self) -> None:
        await _in_thread(self._handle.stop)


class AsyncCommands:
    """``sandbox.commands`` of an :class:`AsyncSandbox` (see :class:`sandlot.Commands`);
    background commands come back as :class:`sandlot.AsyncCommandHandle`."""

    def __init__(self, sync: Commands) -> None:
        self._sync = sync

    @overload
    async def run(
        self,
        cmd: str,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        *,
        background: Literal[False] = False,
        stdin: bool = False,
    ) -> CommandResult: ...
    @overload
    async def run(
        self,
        cmd: str,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        *,
        background: Literal[True],
        stdin: bool = False,
    ) -> AsyncCommandHandle: ...

    async def run(
        self,
        cmd: str,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        *,
        background: bool = False,
        stdin: bool = False,
    ) -> CommandResult | AsyncCommandHandle:
        loop = _running_loop()
        run: Callable[..., CommandResult | CommandHandle] = self._sync.run
        result = await _in_thread(
            run,
            cmd,
            cwd,
            envs,
            timeout,
            _on_loop(loop, on_stdout),
            _on_loop(loop, on_stderr),
            background=background,
            stdin=stdin,
        )
        if isinstance(result, CommandHandle):
            return AsyncCommandHandle(result)
        return result

    async def list(self) -> list[ProcessInfo]:
        return await _in_thread(self._sync.list)

    async def kill(self, pid: int) -> bool:
        return await _in_thread(self._sync.kill, pid)

    async def connect(self, pid: int) -> AsyncCommandHandle:
        return AsyncCommandHandle(await _in_thread(self._sync.connect, pid))

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        await _in_thread(self._sync.send_stdin, pid, data)

    async def close_stdin(self, pid: int) -> None:
        await _in_thread(self._sync.close_stdin, pid)


class AsyncPty:
    """``sandbox.pty`` of an :class:`AsyncSandbox` (see :class:`sandlot.Pty`)."""

    def __init__(self, sync: Pty) -> None:
        self._sync = sync

    async def create(
        self,
        size: PtySize,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    ) -> AsyncCommandHandle:
        return AsyncCommandHandle(await _in_thread(self._sync.create, size, cwd, envs, timeout))

    async def connect(self, pid: int) -> AsyncCommandHandle:
        return AsyncCommandHandle(await _in_thread(self._sync.connect, pid))

    async def send_stdin(self, pid: int, data: bytes) -> None:
        await _in_thread(self._sync.send_stdin, pid, data)

    async def resize(self, pid: int, size: PtySize) -> None:
        await _in_thread(self._sync.resize, pid, size)

    async def kill(self, pid: int) -> bool:
        return await _in_thread(self._sync.kill, pid)


class AsyncSandbox:
    """The asyncio twin of :class:`Sandbox`: same methods, awaited.

    ::

        sbx = await AsyncSandbox.create()
        execution = await sbx.run_code("1 + 1")
        await sbx.kill()

    Callbacks may be plain functions or coroutine functions; they run on the event
    loop, in order.
    """

    def __init__(self, sync: Sandbox) -> None:
        self._sync = sync
        self.files = AsyncFilesystem(sync.files)
        self.commands = AsyncCommands(sync.commands)
        self.pty = AsyncPty(sync.pty)

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
        checkpointable: bool = False,
    ) -> AsyncSandbox:
        """Start a sandbox (in a worker thread); the arguments are :class:`Sandbox`'s."""
        sync = await _in_thread(
            Sandbox,
            template,
            backend=backend,
            resources=resources,
            envs=envs,
            timeout=timeout,
            metadata=metadata,
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            precheck=precheck,
            on_precheck=_hook_on_loop(_running_loop(), on_precheck),
            allowed_imports=allowed_imports,
            api_url=api_url,
            api_key=api_key,
            pool=pool,
            network=network,
            checkpointable=checkpointable,
        )
        return cls(sync)

    # --- pause, resume, snapshots, fork (see Sandbox) ----------------------------------
    async def pause(self) -> bool:
        return await _in_thread(self._sync.pause)

    async def _connect_instance(self, timeout: float | None = None) -> AsyncSandbox:
        await _in_thread(self._sync.connect, timeout)
        return self

    @staticmethod
    async def _connect_class(
        cls: type[AsyncSandbox], sandbox_id: str, timeout: float | None = None, **kwargs: Any
    ) -> AsyncSandbox:
        sync = await _in_thread(Sandbox.connect, sandbox_id, timeout, **kwargs)
        return cls(sync)

    connect = _ClassOrInstance(_connect_class, _connect_instance)

    async def create_snapshot(self, name: str | None = None) -> SnapshotInfo:
        return await _in_thread(self._sync.create_snapshot, name)

    async def fork(self, count: int = 1) -> list[AsyncSandbox | Exception]:
        copies = await _in_thread(self._sync.fork, count)
        return [c if isinstance(c, Exception) else type(self)(c) for c in copies]

    @staticmethod
    async def list_snapshots() -> list[SnapshotInfo]:
        return await _in_thread(Sandbox.list_snapshots)

    @staticmethod
    async def delete_snapshot(snapshot_id: str) -> bool:
        return await _in_thread(Sandbox.delete_snapshot, snapshot_id)

    @property
    def sandbox_id(self) -> str:
        return self._sync.sandbox_id

    @property
    def resources(self) -> Resources:
        return self._sync.resources

    @property
    def network(self) -> NetworkPolicy:
        """The sandbox's network policy (empty ``allow_out``: no network)."""
        return self._sync.network

    @property
    def restarts(self) -> int:
        """See :attr:`Sandbox.restarts` (never blocks)."""
        return self._sync.restarts

    @property
    def backend(self) -> Backend | None:
        """See :attr:`Sandbox.backend`."""
        return self._sync.backend

    @property
    def handle(self) -> SandboxHandle | None:
        """See :attr:`Sandbox.handle`."""
        return self._sync.handle

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def _kill_instance(self) -> None:
        await _in_thread(self._sync.kill)

    @staticmethod
    async def _kill_class(cls: type[AsyncSandbox], sandbox_id: str) -> bool:
        result: bool = await _in_thread(Sandbox.kill, sandbox_id)
        return result

    kill = _ClassOrInstance(_kill_class, _kill_instance)

    async def is_running(self) -> bool:
        return await _in_thread(self._sync.is_running)

    async def set_timeout(self, timeout: float | None) -> None:
        await _in_thread(self._sync.set_timeout, timeout)

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
        return await _in_thread(
            self._sync.run_code,
            code,
            language,
            context,
            _on_loop(loop, on_stdout),
            _on_loop(loop, on_stderr),
            _on_loop(loop, on_result),
            _on_loop(loop, on_error),
            envs,
            timeout,
        )

    async def interrupt(self, context: Context | str | None = None) -> None:
        await _in_thread(self._sync.interrupt, context)

    async def create_code_context(
        self, cwd: str | None = None, language: str | None = None
    ) -> Context:
        return await _in_thread(self._sync.create_code_context, cwd, language)

    async def list_code_contexts(self) -> list[Context]:
        return await _in_thread(self._sync.list_code_contexts)

    async def restart_code_context(self, context: Context | str | None = None) -> None:
        await _in_thread(self._sync.restart_code_context, context)

    async def remove_code_context(self, context: Context | str) -> None:
        await _in_thread(self._sync.remove_code_context, context)
