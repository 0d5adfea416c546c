"""The seam under ``Sandbox`` and ``AsyncSandbox``: one core protocol, two peers.

::

    Sandbox / AsyncSandbox          validation (sandlot.validate), pre-check, callbacks
            │  Core (this protocol): checked arguments in, values out
            ├── LocalCore   (_local.py)    a backend on this machine (bwrap, zygote, docker, ...)
            └── RemoteCore  (_remote.py)   a sandlot server over HTTP

The facades check every argument and apply the pre-check before calling a core, so
the cores receive normalised values (seconds as floats, context ids, checked paths
and environments) and only move them: the two modes cannot drift in what they
accept. ``AsyncSandbox`` wraps a ``Sandbox`` and runs its calls in worker threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sandlot._precheck_gate import PrecheckPolicy
from sandlot.policy import NetworkPolicy, Resources, SandboxSpec

if TYPE_CHECKING:
    from sandlot._fold import Callbacks
    from sandlot._models import (
        CommandResult,
        Context,
        EntryInfo,
        Execution,
        ProcessInfo,
        PtySize,
        SnapshotInfo,
        WriteInfo,
    )
    from sandlot._process import ProcessStream
    from sandlot._watch import WatchStream
    from sandlot.backends import Backend, SandboxHandle
    from sandlot.pool import Pool

REQUEST_TIMEOUT = 60.0
"""Seconds to wait for a file or context operation."""
HOST_BACKSTOP = 5.0
"""Extra seconds the host waits past a cell's timeout (the runner's own kill takes ~1 s)
before it stops trusting the runner and destroys the whole sandbox."""


@dataclass(frozen=True, slots=True)
class SandboxOptions:
    """What ``Sandbox(...)`` was asked for, checked (the constructor's arguments, once)."""

    template: str = "python-data"
    backend: str | Backend = "auto"
    resources: Resources = field(default_factory=Resources)
    resources_given: frozenset[str] = frozenset()
    """The ``resources`` fields the caller chose; the others are defaults (a server
    fills those in with its own ceilings instead)."""
    envs: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    unsafe_best_effort_limits: bool = False
    precheck: PrecheckPolicy = field(default_factory=PrecheckPolicy)
    api_url: str | None = None
    api_key: str | None = None
    pool: Pool | bool | None = None
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    checkpointable: bool = False
    """Start in the layout that can be paused, snapshotted and forked (local mode:
    a bubblewrap cold start; docs/persistence.md)."""
    snapshot: str | None = None
    """Start from this snapshot (``Sandbox.create(snapshot_id)``) instead of afresh."""


class Core(Protocol):
    """One sandbox, local or remote. Arguments arrive checked; failures raise
    :class:`sandlot.SandlotError` subclasses; user-code outcomes are values."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def spec(self) -> SandboxSpec:
        """The sandbox as started (for remote mode: as the server granted it)."""
        ...

    @property
    def restarts(self) -> int:
        """How often a new sandbox had to replace a dead one behind this object."""
        ...

    @property
    def backend(self) -> Backend | None:
        """The backend running the sandbox (None in remote mode)."""
        ...

    @property
    def handle(self) -> SandboxHandle | None:
        """The live backend handle (None before it starts, once dead, in remote mode)."""
        ...

    def is_running(self) -> bool: ...

    def set_timeout(self, timeout: float | None) -> None: ...

    def kill(self) -> None:
        """Idempotent; never raises for a sandbox that is already gone."""

    def pause(self) -> bool:
        """Checkpoint the sandbox to disk and free it; False if it was paused already.
        CheckpointError if it cannot be (not started checkpointable, a call running)."""
        ...

    def resume(self) -> None:
        """Bring a paused sandbox back (a no-op for a running one)."""

    def create_snapshot(self, name: str | None) -> SnapshotInfo:
        """Checkpoint the sandbox into a new snapshot and carry on from it."""
        ...

    def fork(self, count: int) -> list[Core | Exception]:
        """``count`` independent running copies of the sandbox as it is now."""
        ...

    def run_code(
        self,
        code: str,
        *,
        context: str,
        envs: dict[str, str],
        timeout: float,
        callbacks: Callbacks,
    ) -> Execution: ...

    def interrupt(self, context: str) -> None: ...

    def create_code_context(self, cwd: str | None, language: str | None) -> Context: ...

    def list_code_contexts(self) -> list[Context]: ...

    def restart_code_context(self, context: str) -> None: ...

    def remove_code_context(self, context: str) -> None: ...

    def run_command(
        self,
        cmd: str,
        *,
        cwd: str | None,
        envs: dict[str, str],
        timeout: float,
        callbacks: Callbacks,
    ) -> CommandResult: ...

    def start_process(
        self,
        cmd: str,
        *,
        cwd: str | None,
        envs: dict[str, str],
        timeout: float | None,
        stdin: bool,
        pty: PtySize | None = None,
    ) -> ProcessStream:
        """Start a background process (``pty``: a terminal running bash instead of
        ``cmd``) and stream it from its first byte. ``timeout``: seconds until the
        sandbox kills it, None for no limit. Raises ProcessLimitError at the cap."""
        ...

    def connect_process(self, pid: int) -> ProcessStream:
        """Stream a running process: what its bounded output ring still holds, then
        the live output. ProcessNotFoundError if no such process runs."""
        ...

    def list_processes(self) -> list[ProcessInfo]: ...

    def kill_process(self, pid: int) -> bool:
        """Kill its process group and descendants; False if no such process runs."""
        ...

    def send_stdin(self, pid: int, data: bytes) -> None: ...

    def close_stdin(self, pid: int) -> None: ...

    def resize_pty(self, pid: int, size: PtySize) -> None: ...

    def read_chunks(self, path: str) -> Iterator[bytes]:
        """The file's bytes in chunks; the first chunk is fetched lazily, so callers
        check the path before calling."""
        ...

    def write(self, path: str, chunks: Iterator[bytes], metadata: Mapping[str, str]) -> WriteInfo:
        """Create or overwrite ``path`` with ``chunks`` (already checked against the
        upload limits; an exception from the iterator leaves no partial file), and make
        ``metadata`` (checked) the file's metadata: an empty one clears it."""
        ...

    def list_dir(self, path: str, depth: int) -> list[EntryInfo]: ...

    def stat(self, path: str) -> EntryInfo: ...

    def remove(self, path: str) -> None: ...

    def make_dir(self, path: str) -> bool: ...

    def rename(self, old_path: str, new_path: str) -> EntryInfo: ...

    def watch_dir(self, path: str, recursive: bool, include_entry: bool) -> WatchStream:
        """Watch a directory; its events until the stream is closed (``include_entry``:
        each with what its name is now). NotFoundError, PathNotAllowedError as for
        files.*; WatchLimitError at the sandbox's cap."""
        ...
