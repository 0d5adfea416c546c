"""Local mode: a sandbox on this machine, started by a backend (the default core).

:class:`LocalCore` owns one backend handle: it starts it (from a pool when asked),
restarts it when it dies, kills it at the sandbox's timeout, speaks the runner's
protocol (:mod:`sandlot.protocol`) and folds the events into ``Execution`` and
``CommandResult`` values. It is thread-safe; ``AsyncSandbox`` calls it from worker
threads.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sandlot._checkpoints import CheckpointRecord, CheckpointStore, new_snapshot_id
from sandlot._core import HOST_BACKSTOP, REQUEST_TIMEOUT, Core, SandboxOptions
from sandlot._exceptions import (
    CheckpointError,
    ContextNotFoundError,
    FileOperationError,
    InvalidArgumentError,
    NotFoundError,
    PathNotAllowedError,
    ProcessLimitError,
    ProcessNotFoundError,
    SandboxClosed,
    SandboxLost,
    SandlotError,
    WatchLimitError,
)
from sandlot._fold import Callbacks, CommandBuilder, ExecutionBuilder
from sandlot._models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    ProcessInfo,
    PtySize,
    ResourceUsage,
    SnapshotInfo,
    WriteInfo,
    context_from_wire,
    entries_from_wire,
    entry_from_wire,
    event_entry,
    process_from_wire,
)
from sandlot._process import ProcessEvent
from sandlot._watch import EVENT_TYPES, FilesystemEvent
from sandlot.backends import EventStream, SandboxHandle, get_backend
from sandlot.policy import MiB, SandboxSpec
from sandlot.pool import Pool, default_pool
from sandlot.protocol import CHUNK_BYTES

log = logging.getLogger("sandlot")

OOM_POLL = 0.2
"""Seconds between checks of the sandbox's out-of-memory counter while a cell runs."""
OUTPUT_SLACK = 4096
"""Bytes a background process's output may exceed ``output_bytes`` by, host side (the
runner's truncation marker), before the host drops the rest itself."""
NETWORK_SETTLE = 1.0
"""Seconds a finished cell waits for its egress connections to be closed, so that
their records (with byte counts) land on its Execution rather than the next one."""

TIMER_IDLE = 2.0
"""Seconds the sandbox-timeout thread stays without timeouts to keep before it ends."""


class _Timeouts:
    """One thread for every sandbox's timeout in the process (a ``threading.Timer``
    each would start a thread per sandbox). Cancelled entries stay in the heap until
    their time or until they are half of it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[list[Any]] = []
        self._live = 0
        self._count = itertools.count()
        self._running = False

    def add(self, delay: float, callback: Any) -> list[Any]:
        entry = [time.monotonic() + delay, next(self._count), callback]
        with self._cond:
            heapq.heappush(self._heap, entry)
            self._live += 1
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="sandlot-timeouts", daemon=True).start()
            elif self._heap[0] is entry:
                self._cond.notify()  # earlier than what the thread waits for
        return entry

    def cancel(self, entry: list[Any]) -> None:
        with self._cond:
            if entry[2] is None:
                return
            entry[2] = None
            self._live -= 1
            if len(self._heap) > 64 and self._live * 2 < len(self._heap):
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        entry = heapq.heappop(self._heap)
                        callback, entry[2] = entry[2], None
                        if callback is not None:
                            self._live -= 1
                            break
                        continue
                    if not self._live:
                        self._heap.clear()
                        if not self._cond.wait(TIMER_IDLE) and not self._live:
                            self._running = False
                            return
                        continue
                    self._cond.wait(self._heap[0][0] - now)
            try:
                callback()
            except Exception:  # one sandbox's kill must not end every other's timeout
                log.exception("killing a sandbox at its timeout failed")


_TIMEOUTS = _Timeouts()


def _reset_timeouts_after_fork() -> None:
    global _TIMEOUTS
    _TIMEOUTS = _Timeouts()  # a forked child has no timeout thread


os.register_at_fork(after_in_child=_reset_timeouts_after_fork)


_ERRORS: dict[str, type[SandlotError]] = {
    "NotFoundError": NotFoundError,
    "FileOperationError": FileOperationError,
    "ContextNotFoundError": ContextNotFoundError,
    "InvalidArgumentError": InvalidArgumentError,
    "PathNotAllowedError": PathNotAllowedError,
    "ProcessNotFoundError": ProcessNotFoundError,
    "ProcessLimitError": ProcessLimitError,
    "CommandError": SandlotError,
    "WatchLimitError": WatchLimitError,
}


class LocalCore:
    """A sandbox on this machine, through a backend (:class:`sandlot._core.Core`)."""

    def __init__(self, options: SandboxOptions, *, record: CheckpointRecord | None = None) -> None:
        """``record``: a checkpoint this core starts from (a paused sandbox, resumed
        under its own id, or a snapshot, started under a new one)."""
        self.pool = _pool(options.pool)
        checkpointable = options.checkpointable or record is not None
        if checkpointable and self.pool is not None:
            raise InvalidArgumentError("a sandbox from a pool cannot be checkpointable")
        paused = record is not None and record.kind == "pause"
        self.sandbox_id = record.sandbox_id if paused and record else uuid.uuid4().hex[:16]
        source = options if record is None else record
        self.spec = SandboxSpec(
            template=source.template,
            resources=source.resources,
            envs=dict(source.envs),
            unsafe_best_effort_limits=source.unsafe_best_effort_limits,
            preload=() if self.pool is None else self.pool.preload,
            sandbox_id=self.sandbox_id,
            network=options.network,
            checkpointable=checkpointable,
        )
        # A checkpointable sandbox starts cold: a zygote's fork cannot be checkpointed.
        backend = options.backend
        if checkpointable and backend == "auto":
            backend = "bwrap"
        self.backend = get_backend(backend)
        self.metadata = dict(options.metadata if record is None else record.metadata)
        self._options = options
        self._handle: SandboxHandle | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._timer: list[Any] | None = None
        self._ids = itertools.count(1)
        self.restarts = 0
        self._store = CheckpointStore()
        self._paused = paused
        """Checkpointed into the store under :attr:`sandbox_id`; resumed on next use."""
        self._start_from = None if record is None or paused else record.id
        """A snapshot the first start restores instead of starting afresh."""
        if not paused:  # a paused one's timeout starts when it is resumed
            self.set_timeout(options.timeout)

    @classmethod
    def open(cls, options: SandboxOptions) -> LocalCore:
        """Construct and start; a sandbox that fails to start leaves nothing behind."""
        core = cls(options)
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
            if self._paused:
                self._resume()
            elif self._start_from is not None:
                snapshot, self._start_from = self._start_from, None
                self._handle = self.backend.restore(str(self._store.images(snapshot)), self.spec)
            if self._handle is None or not self._handle.alive:
                if self._handle is not None:
                    self._handle.kill()
                    self.restarts += 1
                if self.pool is not None:
                    self._handle = self.pool.acquire(self.spec, self.backend)
                else:
                    self._handle = self.backend.start(self.spec)
            return self._handle

    @property
    def handle(self) -> SandboxHandle | None:
        """The live backend handle, if any (for hosts such as ``sandlot serve``)."""
        handle = self._handle
        return handle if handle is not None and handle.alive else None

    def is_running(self) -> bool:
        return not self._closed and self._handle is not None and self._handle.alive

    def set_timeout(self, timeout: float | None) -> None:
        """Kill the sandbox ``timeout`` seconds from now (None: live until killed)."""
        with self._lock:
            if self._timer is not None:
                _TIMEOUTS.cancel(self._timer)
                self._timer = None
            if timeout is not None and not self._closed:
                self._timer = _TIMEOUTS.add(timeout, self.kill)

    def kill(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                _TIMEOUTS.cancel(self._timer)
                self._timer = None
            handle, self._handle = self._handle, None
            if self._paused:
                # Killing a paused sandbox deletes it (its checkpoint) for good.
                self._paused = False
                self._store.delete(self.sandbox_id)
        if handle is not None:
            handle.kill()

    # --- checkpoints ------------------------------------------------------------------
    def _record(self, kind: str, checkpoint_id: str, name: str = "") -> CheckpointRecord:
        return CheckpointRecord(
            id=checkpoint_id,
            kind=kind,
            sandbox_id=self.sandbox_id,
            template=self.spec.template,
            resources=self.spec.resources,
            envs=dict(self.spec.envs),
            metadata=dict(self.metadata),
            unsafe_best_effort_limits=self.spec.unsafe_best_effort_limits,
            name=name,
        )

    def _checkpoint(self, record: CheckpointRecord) -> CheckpointRecord:
        """Checkpoint the running sandbox into a new store entry for ``record``; the
        sandbox has ended when this returns. Under the lock."""
        if self._closed:
            raise SandboxClosed(f"sandbox {self.sandbox_id} was killed")
        handle = self._handle
        if handle is None or not handle.alive:
            why = "" if handle is None else f" ({handle.death_reason})"
            raise CheckpointError(f"sandbox {self.sandbox_id} is not running{why}")
        if not self.spec.checkpointable:
            raise CheckpointError(
                "this sandbox cannot be checkpointed: create it with "
                "Sandbox(checkpointable=True) to pause, snapshot or fork it"
            )
        images = self._store.create(record)
        try:
            handle.checkpoint(str(images))
        except BaseException:
            self._store.delete(record.id)
            if not handle.alive:
                self._handle = None
            raise
        self._handle = None
        return self._store.commit(record)

    def pause(self) -> bool:
        with self._lock:
            if self._paused:
                return False
            self._store.delete(self.sandbox_id)  # one a crashed process left behind
            self._checkpoint(self._record("pause", self.sandbox_id))
            self._paused = True
            if self._timer is not None:  # a paused sandbox is kept until resumed or killed
                _TIMEOUTS.cancel(self._timer)
                self._timer = None
            return True

    def resume(self) -> None:
        with self._lock:
            if self._closed:
                raise SandboxClosed(f"sandbox {self.sandbox_id} was killed")
            if self._paused:
                self._resume()

    def _resume(self) -> None:
        if self._store.get(self.sandbox_id) is None:
            raise CheckpointError(f"sandbox {self.sandbox_id} has no checkpoint to resume")
        images = self._store.images(self.sandbox_id)
        self._handle = self.backend.restore(str(images), self.spec)
        self._paused = False
        self._store.delete(self.sandbox_id)
        self.set_timeout(self._options.timeout)

    def create_snapshot(self, name: str | None) -> SnapshotInfo:
        with self._lock:
            if self._paused:
                self._resume()
            record = self._checkpoint(self._record("snapshot", new_snapshot_id(), name or ""))
            # This sandbox carries on from the snapshot it just took.
            self._handle = self.backend.restore(str(self._store.images(record.id)), self.spec)
        return SnapshotInfo(record.id, [name] if name else [])

    def fork(self, count: int) -> list[Core | Exception]:
        snapshot = self.create_snapshot(None)
        try:
            with ThreadPoolExecutor(max_workers=min(count, 8)) as pool:
                futures = [
                    pool.submit(LocalCore.from_snapshot, snapshot.snapshot_id, self._options)
                    for _ in range(count)
                ]
            copies: list[Core | Exception] = []
            for future in futures:
                try:
                    copies.append(future.result())
                except Exception as exc:
                    copies.append(exc)
            return copies
        finally:
            self._store.delete(snapshot.snapshot_id)

    @classmethod
    def from_snapshot(cls, snapshot_id: str, options: SandboxOptions) -> LocalCore:
        """A new sandbox started from a snapshot (its template, limits and envs)."""
        return cls._from_record(snapshot_id, "snapshot", "snapshot", options)

    @classmethod
    def connect(cls, sandbox_id: str, options: SandboxOptions) -> LocalCore:
        """The paused sandbox ``sandbox_id`` (on this machine), resumed."""
        return cls._from_record(sandbox_id, "pause", "paused sandbox", options)

    @classmethod
    def _from_record(
        cls, checkpoint_id: str, kind: str, what: str, options: SandboxOptions
    ) -> LocalCore:
        record = CheckpointStore().get(checkpoint_id)
        if record is None or record.kind != kind:
            raise CheckpointError(f"no {what} {checkpoint_id!r} on this machine")
        return cls._started(cls(options, record=record))

    @staticmethod
    def _started(core: LocalCore) -> LocalCore:
        try:
            core.start()
        except BaseException:
            if not core._paused:
                core.kill()
            raise
        return core

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
        context: str,
        envs: dict[str, str],
        timeout: float,
        callbacks: Callbacks,
    ) -> Execution:
        limit, context_id = timeout, context
        builder = ExecutionBuilder(self.spec.resources, callbacks)
        started = time.monotonic()
        try:
            handle = self._ensure()
            before = handle.usage_counters()  # (only what the cell is measured from)
            stream = self._stream(
                {
                    "type": "execute",
                    "code": code,
                    "context": context_id,
                    "envs": envs,
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
                if not stopped_for_memory and _oom_since(before, handle.usage_counters()):
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
            execution.usage = ResourceUsage(  # (dataclasses.replace: twice as slow)
                after.memory_peak_bytes, after.memory_limit_bytes, after.oom_kills, cpu, after.pids
            )
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

    def interrupt(self, context: str) -> None:
        self.call({"type": "interrupt", "context": context})

    # --- contexts ---------------------------------------------------------------------
    def create_code_context(self, cwd: str | None, language: str | None) -> Context:
        value = self.call(
            {"type": "create_context", "cwd": cwd or "", "language": language or "python"}
        )
        return context_from_wire(value)

    def list_code_contexts(self) -> list[Context]:
        return [context_from_wire(item) for item in self.call({"type": "list_contexts"})]

    def restart_code_context(self, context: str) -> None:
        self.call({"type": "restart_context", "context": context})

    def remove_code_context(self, context: str) -> None:
        self.call({"type": "remove_context", "context": context})

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
        builder = CommandBuilder(self.spec.resources, callbacks)
        stream = self._stream(
            {
                "type": "command",
                "cmd": cmd,
                "cwd": cwd or "",
                "envs": envs,
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
    ) -> LocalProcessStream:
        message: dict[str, Any] = {
            "type": "process_start",
            "cmd": cmd,
            "cwd": cwd or "",
            "envs": envs,
            "timeout": timeout or 0,  # 0: no limit
            "stdin": stdin,
        }
        if pty is not None:
            message["pty"] = {"rows": pty.rows, "cols": pty.cols}
        return self._open_process(message)

    def connect_process(self, pid: int) -> LocalProcessStream:
        return self._open_process({"type": "process_connect", "pid": pid})

    def _open_process(self, message: dict[str, Any]) -> LocalProcessStream:
        rid = self._next_id()
        stream = self._ensure().request({**message, "id": rid})
        try:
            event = stream.next(REQUEST_TIMEOUT)
        except BaseException:
            stream.close()
            raise
        if event is None:
            stream.close()
            self._discard_handle()
            raise SandboxLost(f"the sandbox did not answer {message['type']}")
        if event["type"] != "started":
            stream.close()
            error = event.get("error") or {}
            cls = _ERRORS.get(str(error.get("name")), SandlotError)
            raise cls(str(error.get("message", f"{message['type']} failed")))
        return LocalProcessStream(self, stream, rid, int(event["pid"]))

    def list_processes(self) -> list[ProcessInfo]:
        items = self.call({"type": "process_list"})
        return [process_from_wire(item) for item in items]

    def kill_process(self, pid: int) -> bool:
        return bool(self.call({"type": "process_kill", "pid": pid}))

    def send_stdin(self, pid: int, data: bytes) -> None:
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            chunk = base64.b64encode(data[start : start + CHUNK_BYTES]).decode("ascii")
            self.call({"type": "process_stdin", "pid": pid, "data": chunk})

    def close_stdin(self, pid: int) -> None:
        self.call({"type": "process_close_stdin", "pid": pid})

    def resize_pty(self, pid: int, size: PtySize) -> None:
        self.call({"type": "pty_resize", "pid": pid, "rows": size.rows, "cols": size.cols})

    # --- files ------------------------------------------------------------------------
    def read_chunks(self, path: str) -> Iterator[bytes]:
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

    def write(self, path: str, chunks: Iterator[bytes], metadata: Mapping[str, str]) -> WriteInfo:
        first = True
        value: Any = None
        try:
            for chunk in chunks:
                value = self.call(
                    {
                        "type": "fs_write",
                        "path": path,
                        "data": base64.b64encode(chunk).decode("ascii"),
                        "append": not first,
                        # The runner refuses (and removes) an upload that grows past this.
                        "max_bytes": self.spec.resources.upload_bytes,
                        # Stored by the first chunk's write, which truncates the file.
                        "metadata": dict(metadata),
                    }
                )
                first = False
        except InvalidArgumentError:
            if not first:  # a stream that grew past the limit: leave no partial file
                with contextlib.suppress(SandlotError):
                    self.call({"type": "fs_remove", "path": path})
            raise
        if first:  # empty upload: still create the file
            value = self.call(
                {
                    "type": "fs_write",
                    "path": path,
                    "data": "",
                    "append": False,
                    "metadata": dict(metadata),
                }
            )
        info = entry_from_wire(value)
        return WriteInfo(name=info.name, type=info.type, path=info.path, metadata=info.metadata)

    def list_dir(self, path: str, depth: int) -> list[EntryInfo]:
        return entries_from_wire(self.call({"type": "fs_list", "path": path, "depth": depth}))

    def stat(self, path: str) -> EntryInfo:
        return entry_from_wire(self.call({"type": "fs_stat", "path": path}))

    def remove(self, path: str) -> None:
        self.call({"type": "fs_remove", "path": path})

    def make_dir(self, path: str) -> bool:
        return bool(self.call({"type": "fs_mkdir", "path": path}))

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return entry_from_wire(self.call({"type": "fs_rename", "src": old_path, "dst": new_path}))

    def watch_dir(self, path: str, recursive: bool, include_entry: bool) -> LocalWatchStream:
        rid = self._next_id()
        message = {
            "type": "fs_watch",
            "path": path,
            "recursive": recursive,
            "include_entry": include_entry,
            "id": rid,
        }
        stream = self._ensure().request(message)
        try:
            event = stream.next(REQUEST_TIMEOUT)
        except BaseException:
            stream.close()
            raise
        if event is None:
            stream.close()
            self._discard_handle()
            raise SandboxLost("the sandbox did not answer fs_watch")
        if event["type"] != "watching":
            stream.close()
            error = event.get("error") or {}
            cls = _ERRORS.get(str(error.get("name")), FileOperationError)
            raise cls(str(error.get("message", f"cannot watch {path}")))
        return LocalWatchStream(self, stream, rid)


class _RunnerStream:
    """A long-lived request's events (a watch, a background process): the state both
    share, and :meth:`close`, which tells the runner to stop streaming (``STOP``)."""

    POLL = 0.25
    """Seconds between checks for :meth:`close` while no event arrives."""
    STOP = ""
    """The request that ends the runner's side of the stream."""

    def __init__(self, core: LocalCore, stream: EventStream, rid: str) -> None:
        self._core = core
        self._stream = stream
        self._rid = rid
        self._closed = threading.Event()
        self._ended = False

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if not self._ended:
            with contextlib.suppress(SandlotError):
                self._core.call({"type": self.STOP, "target": self._rid}, timeout=5)
        self._stream.close()


class LocalWatchStream(_RunnerStream):
    """The events of one directory watch, from the runner (a ``WatchStream``)."""

    STOP = "fs_watch_stop"

    def events(self) -> Iterator[FilesystemEvent]:
        try:
            while not self._closed.is_set():
                event = self._stream.next(self.POLL)
                if event is None:
                    continue
                if event["type"] == "fs_event":
                    kind = event["event"]
                    if kind in EVENT_TYPES:  # anything else is the runner's own business
                        yield FilesystemEvent(
                            name=event["name"], type=kind, entry=event_entry(event.get("entry"))
                        )
                elif event["type"] in ("exit", "reply"):
                    self._ended = True
                    return
        finally:
            if self._closed.is_set() or self._ended:
                self._stream.close()


class LocalProcessStream(_RunnerStream):
    """The events of one background process, from the runner (a ``ProcessStream``).
    Closing it detaches: the process runs on."""

    STOP = "process_detach"

    def __init__(self, core: LocalCore, stream: EventStream, rid: str, pid: int) -> None:
        super().__init__(core, stream, rid)
        self._pid = pid
        limit = core.spec.resources.output_bytes
        # The runner caps output at output_bytes; the host never trusts that count.
        self._room = None if limit is None else limit + OUTPUT_SLACK
        self._cut = False

    def _within(self, size: int) -> bool:
        if self._room is None:
            return True
        self._room -= size
        if self._room >= 0:
            return True
        self._cut = True
        return False

    @property
    def pid(self) -> int:
        return self._pid

    def events(self) -> Iterator[ProcessEvent]:
        try:
            while not self._closed.is_set():
                event = self._stream.next(self.POLL)
                if event is None:
                    continue
                kind = event["type"]
                if kind in ("stdout", "stderr"):
                    text = event["text"]
                    if self._within(len(text)):
                        yield ProcessEvent(**{kind: text})
                elif kind == "data":
                    data = base64.b64decode(event["data"])
                    if self._within(len(data)):
                        yield ProcessEvent(pty=data)
                elif kind == "exit":
                    self._ended = True
                    end = _end_event(event)
                    if self._cut and end.error is None:
                        end = dataclasses.replace(end, error="output truncated")
                    yield end
                    return
                elif kind == "reply":  # not sent after "started"; a broken runner
                    self._ended = True
                    raise SandboxLost(f"process {self._pid}: the stream ended without an exit")
        finally:
            if self._closed.is_set() or self._ended:
                self._stream.close()


def _end_event(event: dict[str, Any]) -> ProcessEvent:
    code = event.get("exit_code")
    exit_code = code if isinstance(code, int) and not isinstance(code, bool) else -1
    status = event["status"]
    error: str | None = None
    if status not in ("ok", "error"):
        error = str(status)
    elif event.get("truncated") is True:
        error = "output truncated"
    return ProcessEvent(end=True, exit_code=exit_code, error=error)


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


def _pool(pool: Pool | bool | None) -> Pool | None:
    if pool is None or pool is False:
        return None
    if pool is True:
        return default_pool()
    if isinstance(pool, Pool):
        return pool
    raise InvalidArgumentError(f"pool must be a sandlot.Pool, True or None, not {pool!r}")
