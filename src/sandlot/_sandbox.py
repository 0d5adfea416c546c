"""``Sandbox``: the synchronous SDK face, shaped like ``e2b_code_interpreter``.

This layer checks every argument (:mod:`sandlot.validate`), applies the advisory
pre-check, and hands normalised values to a core (:mod:`sandlot._core`): the local
one (a backend on this machine) or the remote one (a sandlot server). The asyncio
twin, :class:`sandlot.AsyncSandbox` (``_async.py``), wraps a ``Sandbox``, so the two
cannot differ in what they accept or return; a unit test compares their signatures.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any, Literal, overload

from sandlot._checkpoints import is_snapshot_id
from sandlot._core import Core, SandboxOptions
from sandlot._exceptions import CheckpointError, InvalidArgumentError, NotFoundError
from sandlot._fold import Callbacks
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
from sandlot._precheck_gate import PrecheckHook, PrecheckMode, PrecheckPolicy
from sandlot._process import CommandHandle, input_bytes
from sandlot._watch import FilesystemEvent, WatchHandle
from sandlot.policy import NetworkPolicy, Resources
from sandlot.validate import (
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONTEXT,
    DEFAULT_SANDBOX_TIMEOUT,
    cell_context,
    cell_timeout,
    check_cmd,
    check_envs,
    check_file_path,
    check_metadata,
    check_path,
    context_id,
    kernel_language,
    seconds,
    upload_chunks,
)

if TYPE_CHECKING:
    from sandlot.backends import Backend, SandboxHandle
    from sandlot.pool import Pool

__all__ = ["Commands", "Filesystem", "Pty", "Sandbox", "open_core", "sandbox_options"]


def sandbox_options(
    template: str,
    *,
    backend: str | Backend,
    resources: Resources | Mapping[str, Any] | None,
    envs: Mapping[str, str] | None,
    timeout: float | None,
    metadata: Mapping[str, str] | None,
    unsafe_best_effort_limits: bool,
    precheck: PrecheckMode,
    on_precheck: PrecheckHook | None,
    allowed_imports: Iterable[str] | None,
    api_url: str | None,
    api_key: str | None,
    pool: Pool | bool | None,
    network: NetworkPolicy | Mapping[str, Any] | None,
    checkpointable: bool = False,
) -> SandboxOptions:
    """Check the constructor's arguments (InvalidArgumentError before anything starts)."""
    if not isinstance(template, str) or not template:
        raise InvalidArgumentError(f"template must be a non-empty str, not {template!r}")
    if not isinstance(checkpointable, bool):
        raise InvalidArgumentError(f"checkpointable must be a bool, not {checkpointable!r}")
    snapshot = template if is_snapshot_id(template) else None
    limits = Resources.coerce(resources)
    if resources is None:
        given: frozenset[str] = frozenset()
    elif isinstance(resources, Resources):
        defaults = Resources()
        given = frozenset(
            name
            for name in Resources.__dataclass_fields__
            if getattr(limits, name) != getattr(defaults, name)
        )
    else:
        given = frozenset(resources)
    return SandboxOptions(
        template=template,
        backend=backend,
        resources=limits,
        resources_given=given,
        envs=check_envs(envs),
        timeout=None if timeout is None else seconds(timeout),
        metadata=dict(metadata or {}),
        unsafe_best_effort_limits=bool(unsafe_best_effort_limits),
        precheck=PrecheckPolicy.build(precheck, on_precheck, allowed_imports),
        api_url=api_url,
        api_key=api_key,
        pool=pool,
        network=NetworkPolicy.coerce(network),
        checkpointable=checkpointable or snapshot is not None,
        snapshot=snapshot,
    )


def open_core(options: SandboxOptions) -> Core:
    """A started core: the remote one when ``api_url`` / ``$SANDLOT_API_URL`` says so,
    else the local one. A sandbox that fails to start leaves nothing behind."""
    if (
        options.api_url is not None
        or options.api_key is not None
        or os.environ.get("SANDLOT_API_URL")
    ):
        from sandlot._remote import RemoteCore, remote_target  # needs the server extra

        target = remote_target(options.api_url, options.api_key, options.backend)
        if target is not None:
            return RemoteCore.open(target, options)
    from sandlot._local import LocalCore

    if options.snapshot is not None:
        return LocalCore.from_snapshot(options.snapshot, options)
    return LocalCore.open(options)


def _option_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`Sandbox`'s keyword options with its defaults, ``given`` on top
    (InvalidArgumentError for a name it does not take)."""
    parameters = inspect.signature(Sandbox.__init__).parameters
    known = {
        name: p.default
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "timeout"
    }
    unknown = set(given) - set(known)
    if unknown:
        raise InvalidArgumentError(f"unknown option(s) {sorted(unknown)}")
    return {**known, **given}


def _remote(options: SandboxOptions) -> bool:
    return (
        options.api_url is not None
        or options.api_key is not None
        or bool(os.environ.get("SANDLOT_API_URL"))
    )


class _ClassOrInstance:
    """A method called on the class with a sandbox id (``Sandbox.connect(id)``, E2B's
    spelling) or on a sandbox (``sbx.connect()``)."""

    def __init__(self, on_class: Any, on_instance: Callable[..., Any]) -> None:
        if isinstance(on_class, staticmethod):
            on_class = on_class.__func__
        self._on_class: Callable[..., Any] = on_class
        self._on_instance = on_instance
        self.__doc__ = on_instance.__doc__

    def __get__(self, obj: object, cls: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return functools.partial(self._on_class, cls)
        return functools.partial(self._on_instance, obj)


class Filesystem:
    """``sandbox.files``: the sandbox's files. Relative paths are under ``/home/user``.

    Operations run inside the sandbox, so paths and symlinks resolve in the
    sandbox's own view of the filesystem and can never reach a host file.
    """

    def __init__(self, core: Core) -> None:
        self._core = core

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...
    @overload
    def read(self, path: str, format: Literal["stream"]) -> Iterator[bytes]: ...

    def read(self, path: str, format: str = "text") -> str | bytes | Iterator[bytes]:
        """Read a file as text (UTF-8), ``bytes``, or a ``stream`` of byte chunks."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentError("format must be 'text', 'bytes' or 'stream'")
        # Checked now: a stream is lazy, and files.read(bad, format="stream") must fail here.
        chunks = self._core.read_chunks(check_file_path(path))
        if format == "stream":
            return chunks
        data = b"".join(chunks)
        return data.decode("utf-8") if format == "text" else data

    def write(
        self,
        path: str,
        data: str | bytes | IO[Any],
        metadata: Mapping[str, str] | None = None,
    ) -> WriteInfo:
        """Create or overwrite a file (parents are created). Big files go in chunks;
        an upload above ``upload_bytes`` or the workspace raises InvalidArgumentError
        and leaves no partial file.

        ``metadata``: string pairs stored with the file (as ``user.e2b.<key>`` extended
        attributes in the sandbox) and reported by ``get_info``, ``list`` and watch
        entries. A write replaces the file's metadata: one without leaves it none.
        Keys are lowercased; keys are HTTP-token characters (letters, digits,
        ``!#$%&'*+-.^_`|~``) of at most 246 bytes, values printable ASCII, 4096 bytes
        in all (InvalidArgumentError otherwise). A filesystem that cannot keep them
        fails the write with FileOperationError (and leaves no file)."""
        path = check_file_path(path)
        checked = check_metadata(metadata)
        chunks = upload_chunks(self._core.spec.resources, path, data)
        return self._core.write(path, chunks, checked)

    def write_files(
        self, files: Iterable[Mapping[str, Any]], metadata: Mapping[str, str] | None = None
    ) -> list[WriteInfo]:
        """Write several files: each a mapping with ``path`` and ``data`` (as
        :meth:`write` takes them), in order, each with the same ``metadata``. Every
        path and the metadata are checked before the first file is written; a failure
        part way leaves the files before it written."""
        checked = check_metadata(metadata)
        entries: list[tuple[str, str | bytes | IO[Any]]] = []
        for item in files:
            if not isinstance(item, Mapping) or "path" not in item or "data" not in item:
                raise InvalidArgumentError(
                    f"each file is a mapping with 'path' and 'data', not {item!r:.100}"
                )
            entries.append((check_file_path(item["path"]), item["data"]))
        resources = self._core.spec.resources
        return [
            self._core.write(path, upload_chunks(resources, path, data), checked)
            for path, data in entries
        ]

    def list(self, path: str = ".", depth: int = 1) -> list[EntryInfo]:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InvalidArgumentError(f"depth must be an int >= 1, not {depth!r}")
        return self._core.list_dir(check_file_path(path), depth)

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
        except NotFoundError:
            return False
        return True

    def get_info(self, path: str) -> EntryInfo:
        return self._core.stat(check_file_path(path))

    def remove(self, path: str) -> None:
        self._core.remove(check_file_path(path))

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        return self._core.make_dir(check_file_path(path))

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return self._core.rename(check_file_path(old_path), check_file_path(new_path))

    def watch_dir(
        self,
        path: str,
        on_event: Callable[[FilesystemEvent], object] | None = None,
        recursive: bool = False,
        include_entry: bool = False,
    ) -> WatchHandle:
        """Watch a directory for changes (``recursive``: its subdirectories too, new
        ones included). Without ``on_event``, ``handle.get_new_events()`` returns what
        changed since the last call; ``on_event`` is called on a thread of the handle's
        instead. ``include_entry``: each event's ``entry`` is what its name is right
        after the change (metadata included), when it still exists. Call
        ``handle.stop()`` when done: a sandbox has a cap on watches (WatchLimitError
        past it)."""
        if not isinstance(recursive, bool):
            raise InvalidArgumentError(f"recursive must be a bool, not {recursive!r}")
        if not isinstance(include_entry, bool):
            raise InvalidArgumentError(f"include_entry must be a bool, not {include_entry!r}")
        if on_event is not None and not callable(on_event):
            raise InvalidArgumentError("on_event must be callable")
        stream = self._core.watch_dir(check_file_path(path), recursive, include_entry)
        return WatchHandle(stream, on_event)


class Commands:
    """``sandbox.commands``: run shell commands inside the sandbox, in the foreground
    or in the background (E2B's ``commands``)."""

    def __init__(self, core: Core) -> None:
        self._core = core

    @overload
    def run(
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
    def run(
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
    ) -> CommandHandle: ...

    def run(
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
    ) -> CommandResult | CommandHandle:
        """Run ``cmd`` with ``/bin/sh -c``.

        In the foreground (default): wait and return a :class:`CommandResult`; a
        non-zero exit is data, not an exception. ``timeout``: seconds, then the command
        is killed.

        ``background=True``: return a :class:`CommandHandle` at once; the process
        outlives this call (and later ``run_code`` calls) until it exits, is killed, or
        the sandbox ends. ``timeout``: seconds until the sandbox kills it; ``0`` or
        None for no limit. ``stdin=True`` keeps its stdin open for
        :meth:`send_stdin`. ``on_stdout`` / ``on_stderr`` are for the foreground; pass
        them to ``handle.wait()`` instead. At most ``resources.background_processes``
        run at once (ProcessLimitError beyond); output is capped at
        ``resources.output_bytes`` per process, as for a cell.
        """
        cmd = check_cmd(cmd)
        checked_cwd = check_path(cwd) if cwd else None
        checked_envs = check_envs(envs)
        if not background:
            if stdin:
                raise InvalidArgumentError("stdin=True needs background=True")
            return self._core.run_command(
                cmd,
                cwd=checked_cwd,
                envs=checked_envs,
                timeout=DEFAULT_COMMAND_TIMEOUT if timeout is None else seconds(timeout),
                callbacks=Callbacks(on_stdout=on_stdout, on_stderr=on_stderr),
            )
        if on_stdout is not None or on_stderr is not None:
            raise InvalidArgumentError(
                "on_stdout/on_stderr are for foreground commands; pass them to "
                "handle.wait() for a background one"
            )
        stream = self._core.start_process(
            cmd,
            cwd=checked_cwd,
            envs=checked_envs,
            timeout=_lifetime(timeout),
            stdin=bool(stdin),
        )
        return CommandHandle(stream, self._core)

    def list(self) -> list[ProcessInfo]:
        """The background commands and terminals running in the sandbox."""
        return self._core.list_processes()

    def kill(self, pid: int) -> bool:
        """Kill a background command: its process group and every descendant
        (SIGKILL). True if it was running, False if no such process runs."""
        return self._core.kill_process(_pid(pid))

    def connect(self, pid: int) -> CommandHandle:
        """Reattach to a running background command (or terminal).

        The new handle first replays the output the sandbox still keeps for it (a
        bounded ring of its most recent output, 1 MiB; older output is gone), then
        streams the live output. ProcessNotFoundError if no such process runs.
        """
        return CommandHandle(self._core.connect_process(_pid(pid)), self._core)

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to the stdin of a background command started with ``stdin=True``."""
        self._core.send_stdin(_pid(pid), input_bytes(data))

    def close_stdin(self, pid: int) -> None:
        """Close the stdin of a background command (it reads EOF)."""
        self._core.close_stdin(_pid(pid))


class Pty:
    """``sandbox.pty``: interactive terminals (bash on a pseudo-terminal) in the sandbox."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def create(
        self,
        size: PtySize,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    ) -> CommandHandle:
        """Start ``bash -i -l`` on a terminal of ``size``; its output arrives as bytes
        (the handle's ``pty`` items, ``wait(on_pty=...)``). ``timeout``: seconds until
        it is killed, ``0`` or None for no limit. Counts as a background process."""
        if not isinstance(size, PtySize):
            raise InvalidArgumentError(f"size must be a sandlot.PtySize, not {size!r}")
        stream = self._core.start_process(
            "",
            cwd=check_path(cwd) if cwd else None,
            envs=check_envs(envs),
            timeout=_lifetime(timeout),
            stdin=True,
            pty=_size(size),
        )
        return CommandHandle(stream, self._core)

    def connect(self, pid: int) -> CommandHandle:
        """Reattach to a terminal (replays what the sandbox still keeps, as
        :meth:`Commands.connect`)."""
        return CommandHandle(self._core.connect_process(_pid(pid)), self._core)

    def send_stdin(self, pid: int, data: bytes) -> None:
        """Type ``data`` into the terminal."""
        self._core.send_stdin(_pid(pid), input_bytes(data))

    def resize(self, pid: int, size: PtySize) -> None:
        self._core.resize_pty(_pid(pid), _size(size))

    def kill(self, pid: int) -> bool:
        """Kill the terminal and everything started in it; False if it is not running."""
        return self._core.kill_process(_pid(pid))


def _pid(pid: object) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgumentError(f"pid must be a positive int, not {pid!r}")
    return pid


def _size(size: object) -> PtySize:
    if not isinstance(size, PtySize) or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 4096
        for n in (size.rows, size.cols)
    ):
        raise InvalidArgumentError(f"size must be a PtySize of 1 to 4096 rows and cols: {size!r}")
    return size


def _lifetime(timeout: float | None) -> float | None:
    """A background process's lifetime limit: None (or 0, E2B's spelling) for none."""
    if timeout is None or (timeout == 0 and not isinstance(timeout, bool)):
        return None
    return seconds(timeout)


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
    :param backend: ``"auto"`` (the strongest available: bubblewrap, started from a
        zygote that has the data stack imported; a process's first sandbox starts cold
        while the zygote starts), ``"bwrap"`` (always cold), ``"zygote"``, ``"docker"``,
        ``"podman"``, or a Backend.
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
    :param checkpointable: start the sandbox so that it can be paused
        (:meth:`pause`, :meth:`connect`), snapshotted (:meth:`create_snapshot`, then
        ``Sandbox.create(snapshot_id)``) and forked (:meth:`fork`): a bubblewrap cold
        start, as root, with CRIU 4.x on the host (docs/persistence.md).
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
        checkpointable: bool = False,
    ) -> None:
        options = sandbox_options(
            template,
            backend=backend,
            resources=resources,
            envs=envs,
            timeout=timeout,
            metadata=metadata,
            unsafe_best_effort_limits=unsafe_best_effort_limits,
            precheck=precheck,
            on_precheck=on_precheck,
            allowed_imports=allowed_imports,
            api_url=api_url,
            api_key=api_key,
            pool=pool,
            network=network,
            checkpointable=checkpointable,
        )
        self._adopt(open_core(options), options)

    def _adopt(self, core: Core, options: SandboxOptions) -> None:
        self._options = options
        self._precheck = options.precheck
        self._core: Core = core
        self.files = Filesystem(self._core)
        self.commands = Commands(self._core)
        self.pty = Pty(self._core)

    @classmethod
    def _wrap(cls, core: Core, options: SandboxOptions) -> Sandbox:
        sandbox = cls.__new__(cls)
        sandbox._adopt(core, options)
        return sandbox

    @classmethod
    def create(cls, template: str = "python-data", **kwargs: Any) -> Sandbox:
        """The same as ``Sandbox(template, **kwargs)`` (E2B's spelling)."""
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

    @property
    def restarts(self) -> int:
        """How often sandlot had to start a new sandbox behind this object (after the
        previous one died or hung); 0 for a sandbox that never lost its state. In
        remote mode, as of the server's last answer."""
        return self._core.restarts

    @property
    def backend(self) -> Backend | None:
        """The backend running this sandbox (local mode; None in remote mode)."""
        return self._core.backend

    @property
    def handle(self) -> SandboxHandle | None:
        """The backend's handle of the sandbox running now (local mode; None before it
        starts, after it died or was killed, and in remote mode). For hosts that
        supervise sandboxes, such as ``sandlot serve``; most code never needs it."""
        return self._core.handle

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _kill_instance(self) -> None:
        """Destroy the sandbox and every process and file in it (a paused one: its
        checkpoint). Idempotent.

        Returns once every process of the sandbox has been sent SIGKILL (and every call
        waiting on it has failed); a bubblewrap sandbox's reaping and the removal of its
        cgroup finish in the background, within milliseconds, and before this process
        exits. ``Sandbox.kill(sandbox_id)`` deletes a paused sandbox of this machine by
        id (True if there was one)."""
        self._core.kill()

    @staticmethod
    def _kill_class(cls: type[Sandbox], sandbox_id: str) -> bool:
        from sandlot._checkpoints import CheckpointStore

        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise InvalidArgumentError(f"sandbox_id must be a non-empty str, not {sandbox_id!r}")
        store = CheckpointStore()
        record = store.get(sandbox_id)
        if record is None or record.kind != "pause":
            return False
        return store.delete(sandbox_id)

    kill = _ClassOrInstance(_kill_class, _kill_instance)

    def is_running(self) -> bool:
        return self._core.is_running()

    # --- pause, resume, snapshots, fork -----------------------------------------------
    def pause(self) -> bool:
        """Save the whole sandbox (every context's variables, its processes, its files)
        to disk and free its memory and CPU; True, or False if it was paused already.
        It comes back on :meth:`connect`, on its next use, or in another process with
        ``Sandbox.connect(sandbox_id)``; a paused sandbox has no timeout until then.
        CheckpointError if it cannot be (not created ``checkpointable``, or a call is
        running in it)."""
        return self._core.pause()

    def _connect_instance(self, timeout: float | None = None) -> Sandbox:
        """Resume the sandbox if it is paused; with ``timeout``, kill it that many
        seconds from now. Returns the sandbox."""
        self._core.resume()
        if timeout is not None:
            self._core.set_timeout(seconds(timeout))
        return self

    @staticmethod
    def _connect_class(
        cls: type[Sandbox], sandbox_id: str, timeout: float | None = None, **kwargs: Any
    ) -> Sandbox:
        """The paused sandbox ``sandbox_id`` of this machine, resumed: its variables,
        processes and files as they were (``kwargs``: :class:`Sandbox`'s options for
        the new object: timeout, precheck...)."""
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise InvalidArgumentError(f"sandbox_id must be a non-empty str, not {sandbox_id!r}")
        options = sandbox_options("python-data", timeout=timeout, **_option_defaults(kwargs))
        if _remote(options):
            raise CheckpointError("connecting to a paused sandbox on a server is not offered yet")
        from sandlot._local import LocalCore

        return cls._wrap(LocalCore.connect(sandbox_id, options), options)

    connect = _ClassOrInstance(_connect_class, _connect_instance)

    def create_snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Save the sandbox as it is now into a new snapshot and carry on (it is paused
        for the moment it takes). Start any number of sandboxes from it with
        ``Sandbox.create(snapshot_id)``; it is kept until :meth:`delete_snapshot`."""
        if name is not None and (not isinstance(name, str) or len(name) > 200):
            raise InvalidArgumentError("name must be a str of at most 200 characters")
        return self._core.create_snapshot(name)

    def fork(self, count: int = 1) -> list[Sandbox | Exception]:
        """``count`` (1-20) new sandboxes, each an independent copy of this one as it is
        now (variables, processes, files), with isolation of its own. One entry per
        copy: the sandbox, or the exception that kept it from starting."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 20:
            raise InvalidArgumentError(f"count must be an int from 1 to 20, not {count!r}")
        copies = self._core.fork(count)
        return [c if isinstance(c, Exception) else self._wrap(c, self._options) for c in copies]

    @staticmethod
    def list_snapshots() -> list[SnapshotInfo]:
        """The snapshots on this machine."""
        from sandlot._checkpoints import CheckpointStore

        return [
            SnapshotInfo(r.id, [r.name] if r.name else [])
            for r in CheckpointStore().list("snapshot")
        ]

    @staticmethod
    def delete_snapshot(snapshot_id: str) -> bool:
        """Delete a snapshot; False if there was none. Sandboxes started from it run on."""
        from sandlot._checkpoints import CheckpointStore

        if not is_snapshot_id(snapshot_id):
            raise InvalidArgumentError(f"not a snapshot id: {snapshot_id!r}")
        return CheckpointStore().delete(snapshot_id)

    def set_timeout(self, timeout: float | None) -> None:
        """Kill the sandbox ``timeout`` seconds from now (None: live until killed)."""
        self._core.set_timeout(None if timeout is None else seconds(timeout))

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
        limit = cell_timeout(code, language, timeout)
        context_name = cell_context(language, context)
        checked_envs = check_envs(envs)
        code, report, refused = self._precheck.gate(code, kernel_language(language))
        if refused is not None:
            return refused
        execution = self._core.run_code(
            code,
            context=context_name,
            envs=checked_envs,
            timeout=limit,
            callbacks=Callbacks(on_stdout, on_stderr, on_result, on_error),
        )
        execution.precheck = report
        return execution

    def interrupt(self, context: Context | str | None = None) -> None:
        """Interrupt the running cell of ``context`` (KeyboardInterrupt, then kill)."""
        self._core.interrupt(context_id(context))

    def create_code_context(self, cwd: str | None = None, language: str | None = None) -> Context:
        if cwd:
            check_path(cwd)
        return self._core.create_code_context(cwd, kernel_language(language))

    def list_code_contexts(self) -> list[Context]:
        return self._core.list_code_contexts()

    def restart_code_context(self, context: Context | str | None = None) -> None:
        self._core.restart_code_context(context_id(context))

    def remove_code_context(self, context: Context | str) -> None:
        name = context_id(context)
        if name == DEFAULT_CONTEXT:
            raise InvalidArgumentError("the default context cannot be removed; restart it instead")
        self._core.remove_code_context(name)
