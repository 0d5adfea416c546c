"""A :class:`SandboxHandle` over a byte channel to the runner (shared by backends).

The backend starts the sandbox process and gives this class its end of the
protocol socket. Whichever caller is waiting for an event reads the channel, decodes
every line with :func:`sandlot.protocol.decode` (size limit, schema check) and routes
events to the stream of the request they answer (no thread of its own per sandbox).
A message that breaks the protocol is treated as an attack: the sandbox is killed
and every waiting call gets :class:`SandboxLost`.

What a sandbox can make the host hold is bounded before anything is parsed
(:func:`frame_cost`): ``json.loads`` turns a line of tiny values (``"ab",`` repeated)
into objects worth twelve to thirty times its size, so the size of a line alone says
little. Per cell, results and errors share a budget of ``Resources.result_bytes``
counted in that parsed cost; a line over it is dropped unparsed and the cell is told
with a ``limit`` event (the SDK marks the Execution truncated). Events a consumer has
not taken yet are bounded too: the channel is not read (and the sandbox, whose
writes then block, waits) while a cell's queue holds more than :data:`QUEUE_COST` of them.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import re
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sandlot._exceptions import (
    IsolationUnavailable,
    ProtocolError,
    SandboxLost,
    SandboxStartError,
    SandlotError,
)
from sandlot.backends import _reaper
from sandlot.backends._base import Event, EventStream, SandboxHandle
from sandlot.policy import MiB, Resources
from sandlot.protocol import (
    FATAL_LIMITS,
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    RUNNER_MESSAGES,
    TERMINAL_EVENTS,
    ProtocolViolation,
)
from sandlot.protocol import decode as decode_message
from sandlot.protocol import encode as encode_message
from sandlot.safetext import escape

log = logging.getLogger("sandlot.backend")

_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR
_DEAD = object()
_NOTHING = object()
READ_BYTES = 256 * 1024
"""Bytes read from the channel at a time."""
SEND_POLL = 0.05
"""Seconds a send that the runner does not take waits before it reads the channel
again (the runner may be waiting for its own writes to be read)."""

VALUE_COST = 64
"""Bytes of host memory one JSON value may cost once parsed, beyond its text. Measured
with tracemalloc on CPython 3.12 for the worst shapes: ``{"a":1},`` 64.3 per value,
``"ab",`` 59.8, ``[[]],`` 50.9, ``{},`` 36.2 (plus one byte of text each)."""
ENVELOPE_VALUES = 16
"""JSON values an event's own fields may use without charge (``exit`` has the most)."""
CELL_SLACK = 1 * MiB
"""Added to a cell's result budget: error events, tracebacks, sandlot's markers."""
QUEUE_COST = 16 * MiB
"""Parsed cost of the events of one cell that may wait for their consumer; past it the
reader waits, so a slow consumer makes the sandbox wait, not the host grow."""
FRAME_COST_MAX = 4 * MAX_LINE_BYTES
"""Largest parsed cost of any one line outside a cell's budget (replies, file chunks,
exit events); over it the sandbox broke the protocol. Lines of characters beyond
Latin-1 cost up to four bytes a byte, so every line within MAX_LINE_BYTES can fit."""
EXACT_BYTES = 1 * MiB
"""Lines up to this size have their values counted exactly (outside string literals);
larger ones count every ``,:[{`` byte, which over-counts only text inside strings."""

_HEADER = re.compile(rb'\{"type":"([a-z_]{1,32})"(?:,"id":"([^"\\]{1,512})")?')
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_WIDE4 = re.compile(rb"[\xf0-\xff]|\\u[dD][89abAB]")
_WIDE2 = re.compile(rb"[\xc4-\xef]|\\u(?!00)")


def frame_cost(line: bytes) -> tuple[int, int]:
    """``(values, cost)`` of one line, without parsing it.

    ``values`` bounds the number of JSON values the line holds (each needs a ``,``
    ``:`` ``[`` or ``{`` before it, but the first); ``cost`` bounds the host memory
    ``json.loads`` turns it into: its characters at the widest width a Python string
    of them can take (1, 2 or 4 bytes), plus :data:`VALUE_COST` a value. Runs at
    memchr speed: four ``bytes.count`` calls, and a regex over small lines that seem
    to hold many values (a printed CSV line holds commas, but in one string).
    """
    values = _values(line)
    if values > ENVELOPE_VALUES and len(line) <= EXACT_BYTES:
        values = _values(_STRING.sub(b"", line))  # what looked like values in strings
    if line.isascii() and b"\\u" not in line:
        width = 1
    else:
        width = 4 if _WIDE4.search(line) else 2 if _WIDE2.search(line) else 1
    return values, width * len(line) + VALUE_COST * values


def _values(data: bytes) -> int:
    return data.count(b",") + data.count(b":") + data.count(b"[") + data.count(b"{")


@dataclass(slots=True)
class CellBudget:
    """What one cell (``execute``) or command may make the host hold.

    ``results``: parsed cost of results, errors and anything but plain output, for the
    whole cell (None: no limit). Output text is bounded where it is kept
    (:mod:`sandlot._fold`, ``output_bytes``) and while it waits (:data:`QUEUE_COST`).
    """

    results: int | None
    limit: int | None
    """The limit as the caller set it, for the message."""

    @classmethod
    def for_request(cls, kind: str, resources: Resources) -> CellBudget | None:
        if kind == "execute":
            limit = resources.result_bytes
            return cls(None if limit is None else limit + CELL_SLACK, limit)
        if kind in ("command", "process_start", "process_connect"):
            return cls(CELL_SLACK, CELL_SLACK)  # no results: errors and markers only
        return None


class _Stream(EventStream):
    """The events of one request. They are queued by whichever thread reads the
    channel (usually the one waiting on this very stream) under the handle's lock."""

    def __init__(self, owner: ChannelHandle, rid: str, budget: CellBudget | None) -> None:
        self._owner = owner
        self._rid = rid
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._queued = 0
        self._closed = False
        self._finished = False
        self.budget = budget
        self.limited: set[str] = set()
        """The budgets this cell went over (a ``limit`` event was sent for each)."""

    def push(self, item: Any, cost: int = 0) -> None:
        """Queue ``item`` (the owner's lock held). A cell's stream holding more than
        :data:`QUEUE_COST` stops the channel being read until its consumer takes some,
        closes it, or the sandbox dies (and with it the sandbox, whose writes block)."""
        if self._closed:
            return
        self._items.append((item, cost))
        self._queued += cost
        if self.budget is not None and self._queued > QUEUE_COST:
            self._owner._full.add(self)

    def _take(self) -> Any:
        if self._items:
            item, cost = self._items.popleft()
            self._queued -= cost
            if self._queued <= QUEUE_COST and self in self._owner._full:
                self._owner._full.discard(self)
                self._owner._cond.notify_all()  # the channel may be read again
            return item
        if self._owner._drained:
            return _DEAD
        return _NOTHING

    def next(self, timeout: float | None) -> Event | None:
        if self._finished:
            return None
        item = self._owner._await(self._take, timeout)
        if item is _NOTHING:
            return None
        if item is _DEAD:
            self._finished = True
            raise SandboxLost(self._owner.death_reason or "the sandbox exited")
        assert isinstance(item, dict)
        if item["type"] in TERMINAL_EVENTS:
            self._finished = True
            self._owner._forget(self._rid)
        return item

    def close(self) -> None:
        self._finished = True
        owner = self._owner
        with owner._cond:
            self._closed = True
            self._items.clear()
            self._queued = 0
            if self in owner._full:
                owner._full.discard(self)
                owner._cond.notify_all()
            owner._streams.pop(self._rid, None)


class SandboxProcess(Protocol):
    """What :class:`ChannelHandle` needs of the sandbox's host-side process: a
    ``subprocess.Popen`` (bwrap), or a container seen through its engine."""

    @property
    def pid(self) -> Any: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ChannelHandle(SandboxHandle):
    """Protocol routing for a sandbox reachable through ``sock``.

    ``process`` is the sandbox's host-side process (for bwrap, the bwrap process);
    killing it must destroy the whole sandbox. ``on_exit`` runs once after the
    sandbox is gone (cleanup of temporary files and the like).

    No thread reads the channel on its own: a caller waiting for an event reads it
    (one at a time; the others wait for what it routes to their streams), so an event
    reaches the caller waiting for it without a hop between threads. While nobody
    waits, what the runner sends stays in the socket (and the runner waits once it is
    full). The process's exit is noticed by the process-wide :mod:`._reaper` thread
    through a pidfd (a process without one, a container, gets a thread of its own),
    which also runs ``on_exit``; :meth:`kill` signals the sandbox and returns, leaving
    the reaping to it.
    """

    limits_fix = "Lower the limits in Resources or raise the host's hard limits (ulimit -H)."
    """How to fix the host when the runner reports ``fatal`` ``limits``."""
    FATAL_MESSAGE_CHARS = 1000
    """A ``fatal`` message is cut to this in errors: it comes from inside the sandbox."""
    DRAIN_AFTER_EXIT = 2.0
    """Seconds the channel is still read after the sandbox's process exited, for what it
    sent last (its end closes once every process in it is gone)."""

    def __init__(
        self,
        sock: socket.socket,
        process: SandboxProcess,
        *,
        stderr_tail: Callable[[], str] = lambda: "",
        on_exit: Callable[[], None] | None = None,
        exit_reason: Callable[[int], str] | None = None,
        resources: Resources | None = None,
    ) -> None:
        self._resources = resources if resources is not None else Resources()
        self._sock = sock
        self._process = process
        self._exit_reason = exit_reason
        self._stderr_tail = stderr_tail
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._full: set[_Stream] = set()
        """Streams over :data:`QUEUE_COST`: the channel is not read while any is."""
        self._greeting: Event | None = None  # the first "ready" or "fatal"
        self._greeted = False  # a "ready" or "fatal" arrived (only the first counts)
        self._dead = False
        self._death_reason = ""
        self._drained = False
        """No more events will be routed (end of the channel, a kill, a violation)."""
        self._drain_by: float | None = None
        self._reading = False
        """A thread is reading the channel (only it touches the buffer below)."""
        self._close_pending = False
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._exited = False
        self._ids = itertools.count(1)
        self._exit_fd: int | None = None
        self._own_exit_fd = False
        self._waiter: threading.Thread | None = None
        self._checkpointing = False
        """The runner was asked to let go of the channel for a checkpoint."""
        self._watch_exit()

    # --- the process's exit -----------------------------------------------------------
    def _watch_exit(self) -> None:
        process = self._process
        fd: int | None = None
        if isinstance(process, subprocess.Popen):
            if process.returncode is None:
                try:
                    fd = os.pidfd_open(process.pid)
                    self._own_exit_fd = True
                except OSError:
                    fd = None  # already reaped: process.wait() answers at once
            else:
                self._process_exited()
                return
        else:
            exit_fd = getattr(process, "exit_fd", None)
            fd = exit_fd() if callable(exit_fd) else None
        if fd is None:
            self._waiter = threading.Thread(
                target=self._process_exited, name="sandlot-waiter", daemon=True
            )
            self._waiter.start()
            return
        self._exit_fd = fd
        _reaper.watch(fd, self._process_exited)

    def _process_exited(self) -> None:
        """The sandbox's process exited (or is waited for here, off the reaper): the
        handle is dead; the channel is still read for what the sandbox sent last."""
        code = self._process.wait()
        if self._exit_reason is not None:
            reason = self._exit_reason(code)
        elif code < 0:
            reason = f"the sandbox process was killed by signal {-code}"
        else:
            reason = f"the sandbox process exited with status {code}"
        self._die(reason, drained=False)
        if self._own_exit_fd and self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        with self._lock:
            if self._exited:
                return
            self._exited = True
        if self._on_exit is not None:
            try:
                self._on_exit()
            except Exception:
                log.exception("sandbox cleanup failed")

    # --- lifecycle --------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> Event:
        """Block until the runner says ``ready`` in our protocol version; raise
        SandboxStartError (or ProtocolError for another version) otherwise."""
        item = self._await(self._take_greeting, timeout)
        if item is _NOTHING:
            self.kill()
            raise SandboxStartError(
                f"the sandbox did not become ready within {timeout:g} s" + self._stderr_suffix()
            )
        if item is _DEAD:
            self.kill()  # reaps the process and closes our end of the channel
            raise SandboxStartError(
                f"the sandbox exited while starting ({self._death_reason})" + self._stderr_suffix()
            )
        assert isinstance(item, dict)
        if item["type"] == "fatal":
            self.kill()
            raise self._refusal(item)
        if item.get("version") != PROTOCOL_VERSION:
            self.kill()
            raise ProtocolError(
                f"runner speaks protocol {item.get('version')}, the host {PROTOCOL_VERSION}"
            )
        return item

    def _take_greeting(self) -> Any:
        if self._greeting is not None:
            return self._greeting
        return _DEAD if self._drained else _NOTHING

    def _refusal(self, fatal: Event) -> SandlotError:
        """The error for a runner that said ``fatal`` instead of ``ready``. Only before
        ``ready``, when no user code has run yet in the sandbox, is the message trusted
        to choose the error; it is still cut to a bounded length."""
        message = str(fatal["message"])[: self.FATAL_MESSAGE_CHARS]
        if fatal["reason"] == FATAL_LIMITS:
            return IsolationUnavailable(
                f"the sandbox could not apply its resource limits, so sandlot refuses to run "
                f"it: {message}. {self.limits_fix}"
            )
        reason = str(fatal["reason"])[:100]
        return SandboxStartError(f"the sandbox's runner could not start ({reason}): {message}")

    def _stderr_suffix(self) -> str:
        tail = self._stderr_tail().strip()
        return f":\n{tail}" if tail else ""

    @property
    def alive(self) -> bool:
        return not self._dead

    @property
    def death_reason(self) -> str:
        return self._death_reason

    def kill(self) -> None:
        """SIGKILL the sandbox and return: the reaper thread reaps it and runs
        ``on_exit`` (:func:`._reaper.drain` waits for that). Every waiting call gets
        :class:`SandboxLost` now."""
        self._die("the sandbox was killed")
        with contextlib.suppress(OSError):
            self._process.kill()
        fd = self._exit_fd
        if fd is not None:
            _reaper.killed(fd)
        self._close_socket()
        waiter = self._waiter
        if waiter is not None and waiter is not threading.current_thread():
            # No pidfd to watch (a container): wait here, as its engine answers.
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("sandbox process %s did not exit after SIGKILL", self._process.pid)
            waiter.join(timeout=10)

    def _close_socket(self) -> None:
        with self._lock:
            if self._reading:
                # The reader closes it when it is done (closing it under a poll() could
                # let the number be reused for another file meanwhile).
                self._close_pending = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _die(self, reason: str, *, drained: bool = True) -> None:
        """Mark the sandbox dead with ``reason`` (the first one counts). ``drained``:
        nothing more it sent will be delivered; else the channel is read up to its end
        (or :data:`DRAIN_AFTER_EXIT`) and waiting calls get what came before."""
        with self._cond:
            if not self._dead:
                self._dead = True
                self._death_reason = reason
                self._drain_by = time.monotonic() + self.DRAIN_AFTER_EXIT
            if drained:
                self._drained = True
            self._cond.notify_all()

    # --- reading the channel, by whoever waits ----------------------------------------
    def _await(self, take: Callable[[], Any], timeout: float | None) -> Any:
        """``take()`` (under the lock) until it returns something other than
        ``_NOTHING``, or ``_NOTHING`` after ``timeout`` seconds. While it waits, this
        thread reads the channel if no other one does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while True:
                    item = take()
                    if item is not _NOTHING:
                        return item
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return _NOTHING
                    if not self._reading and not self._drained and not self._full:
                        self._reading = True
                        break
                    self._cond.wait(left)
            self._as_reader(left)

    def _as_reader(self, timeout: float | None, writing: bool = False) -> None:
        """Read the channel once (this thread took the read side), then give it back.
        ``writing``: also return once the channel takes writes again."""
        try:
            self._read(timeout, writing)
        except ProtocolViolation as exc:
            # The runner shares the sandbox with untrusted code: a malformed message
            # means the sandbox is compromised or broken. Kill it; trust nothing more.
            log.warning("protocol violation from sandbox: %s", escape(exc, 1024))
            self._die(f"the sandbox broke the protocol ({exc}) and was killed")
            with contextlib.suppress(OSError):
                self._process.kill()
        finally:
            with self._cond:
                self._reading = False
                close = self._close_pending
                self._close_pending = False
                self._cond.notify_all()
            if close:
                self._sock.close()

    def _read(self, timeout: float | None, writing: bool = False) -> None:
        """Route the complete lines buffered, or else wait up to ``timeout`` seconds for
        more from the channel (the calling thread holds the read side)."""
        if self._buffer and self._route_buffered():
            return
        drain_by = self._drain_by
        if drain_by is not None:
            # Dead: read what is there, and what comes until then.
            left = max(0.0, drain_by - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        poller = self._poll
        if writing:
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLIN | select.POLLOUT)
        try:
            ready = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
            if not ready or not any(events & _READABLE for _, events in ready):
                if drain_by is not None and time.monotonic() >= drain_by:
                    self._set_drained()  # gone, and its channel still open: done
                return
            chunk = self._sock.recv(READ_BYTES)
        except (OSError, ValueError):
            chunk = b""  # closed under us (kill)
        if chunk:
            self._buffer += chunk
            self._route_buffered()
            return
        self._end_of_channel()

    def _route_buffered(self) -> bool:
        """Route the complete lines in the buffer, in order, stopping early while a
        stream is full; True if any was."""
        buffer = self._buffer
        start = 0
        end = 0
        while not self._full:
            end = buffer.find(b"\n", max(start, self._scanned))
            if end < 0:
                break
            if end + 1 - start > MAX_LINE_BYTES:
                raise ProtocolViolation(f"message longer than {MAX_LINE_BYTES} bytes")
            with memoryview(buffer) as view:
                line = bytes(view[start : end + 1])
            start = end + 1
            self._route(line)
            del line  # a 64 MiB line must not outlive its turn
        if start:
            del buffer[:start]
        # Bytes left without a newline need not be searched again.
        self._scanned = len(buffer) if end < 0 else 0
        if len(buffer) >= MAX_LINE_BYTES and end < 0:
            raise ProtocolViolation(f"message longer than {MAX_LINE_BYTES} bytes")
        return start > 0

    def _set_drained(self) -> None:
        with self._cond:
            self._drained = True
            self._cond.notify_all()

    def _end_of_channel(self) -> None:
        """The sandbox's end of the channel closed: everything in it is gone (or it
        closed the channel, which only the sandbox's death should do)."""
        if not self._dead and self._checkpointing:
            # The runner let go of its end to be checkpointed: the process ends when
            # CRIU is done with it (or is killed if CRIU fails), not here.
            self._die("the sandbox was checkpointed")
        elif not self._dead:
            try:
                code = self._process.wait(timeout=2)
                self._die(f"the sandbox exited (status {code})")
            except subprocess.TimeoutExpired:
                self._die("the sandbox closed its channel")
                with contextlib.suppress(OSError):
                    self._process.kill()
        self._set_drained()

    # --- requests ---------------------------------------------------------------------
    def prepare_checkpoint(self, timeout: float) -> None:
        """Ask the runner to let go of the channel so that its processes can be
        checkpointed; returns once it has (the channel is of no more use then).
        RuntimeError if a call is in flight (a checkpoint is taken between calls) or
        the runner does not answer."""
        with self._lock:
            if self._streams:
                raise RuntimeError(f"{len(self._streams)} call(s) still running in the sandbox")
            if self._dead:
                raise RuntimeError(f"the sandbox is gone: {self._death_reason}")
            self._checkpointing = True
        stream = self.request({"type": "checkpoint"})
        try:
            event = stream.next(timeout)
        finally:
            stream.close()
        if event is None or event.get("type") != "reply" or not event.get("ok"):
            raise RuntimeError(f"the sandbox did not get ready for a checkpoint: {event}")

    def request(self, message: dict[str, Any]) -> EventStream:
        rid = str(message.get("id") or f"r{next(self._ids)}")
        message = {**message, "id": rid}
        stream = _Stream(
            self, rid, CellBudget.for_request(str(message.get("type")), self._resources)
        )
        with self._lock:
            if self._dead:
                stream.push(_DEAD)  # a call after death fails at once
                return stream
            self._streams[rid] = stream
        try:
            self._send(encode_message(message))
        except OSError as exc:
            self._die(f"the sandbox channel broke ({exc})")
        return stream

    def _send(self, data: bytes) -> None:
        """Send ``data`` whole. While the runner does not take it, read the channel
        (if no other thread does): the runner may be waiting for us to read first."""
        with self._send_lock:
            view = memoryview(data)
            while view:
                try:
                    view = view[self._sock.send(view, socket.MSG_DONTWAIT) :]
                    continue
                except BlockingIOError:
                    pass
                with self._cond:
                    read = not self._reading and not self._drained and not self._full
                    if read:
                        self._reading = True
                if read:
                    self._as_reader(SEND_POLL, writing=True)
                else:
                    poller = select.poll()
                    poller.register(self._sock.fileno(), select.POLLOUT)
                    poller.poll(SEND_POLL * 1000)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def _route(self, line: bytes) -> None:
        """Account for one line, then parse and deliver it, or drop it unparsed.

        The runner writes ``type`` and ``id`` first (:func:`sandlot.protocol.encode`),
        so the stream a line is for, and its kind, are known before it is parsed.
        """
        values, cost = frame_cost(line)
        header = _HEADER.match(line)
        if header is None:
            raise ProtocolViolation("a message must start with its type (and then its id)")
        kind = header.group(1).decode()
        rid = header.group(2).decode("utf-8", "replace") if header.group(2) else None
        stream = None
        if rid is not None:
            with self._lock:
                stream = self._streams.get(rid)
            if stream is None:
                return  # nobody is listening (closed or unknown): not worth parsing
        elif kind in ("ready", "fatal"):
            if self._greeted:
                # Only the first of these counts: a later "ready" or "fatal" is dropped
                # unparsed (and not queued, so a flood of them costs nothing).
                return
        else:
            # Else its cost could not be charged to the request it is for.
            raise ProtocolViolation(f"a {kind} message must give its id right after its type")
        budget = stream.budget if stream is not None else None
        if stream is not None and budget is not None and kind not in TERMINAL_EVENTS:
            # Plain output is bounded where it is kept and while it waits; anything else
            # a cell sends is charged to its budget.
            plain = kind in ("stdout", "stderr") and values <= ENVELOPE_VALUES
            if not plain:
                room = FRAME_COST_MAX if budget.results is None else budget.results
                if cost > room:
                    # Dropped unparsed; what fits later (an error event) still goes.
                    self._over(stream, "results")
                    return
                if budget.results is not None:
                    budget.results -= cost
        elif cost > FRAME_COST_MAX:
            raise ProtocolViolation(
                f"a {kind or 'message'} line that would take {cost} bytes to parse "
                f"(limit {FRAME_COST_MAX})"
            )
        event = decode_message(line, RUNNER_MESSAGES)
        if event["type"] != kind or event.get("id") != rid:
            # Duplicate keys: the parsed message is not the one that was accounted for.
            raise ProtocolViolation(f"a message whose type or id is given twice ({kind!r})")
        with self._cond:
            if stream is None:
                self._greeted = True
                self._greeting = event
            else:
                stream.push(event, cost)
            self._cond.notify_all()

    def _over(self, stream: _Stream, what: str) -> None:
        """Tell a cell, once per budget, that the host dropped some of what it sent."""
        if what in stream.limited:
            return
        stream.limited.add(what)
        limit = None if stream.budget is None else stream.budget.limit
        with self._cond:
            stream.push({"type": "limit", "id": stream._rid, "what": what, "limit": limit}, 0)
            self._cond.notify_all()
