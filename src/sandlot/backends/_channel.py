"""A :class:`SandboxHandle` over a byte channel to the runner (shared by backends).

The backend starts the sandbox process and gives this class its end of the
protocol socket. A reader thread decodes every line with
:func:`sandlot.protocol.decode` (size limit, schema check) and routes events to the
stream of the request they answer. A message that breaks the protocol is treated as
an attack: the sandbox is killed and every waiting call gets :class:`SandboxLost`.

What a sandbox can make the host hold is bounded before anything is parsed
(:func:`frame_cost`): ``json.loads`` turns a line of tiny values (``"ab",`` repeated)
into objects worth twelve to thirty times its size, so the size of a line alone says
little. Per cell, results and errors share a budget of ``Resources.result_bytes``
counted in that parsed cost; a line over it is dropped unparsed and the cell is told
with a ``limit`` event (the SDK marks the Execution truncated). Events a consumer has
not taken yet are bounded too: the reader waits (and with it the sandbox, whose
writes then block) while a cell's queue holds more than :data:`QUEUE_COST` of them.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import re
import socket
import subprocess
import threading
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

_DEAD = object()

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
    def __init__(self, owner: ChannelHandle, rid: str, budget: CellBudget | None) -> None:
        self._owner = owner
        self._rid = rid
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._cond = threading.Condition()
        self._queued = 0
        self._closed = False
        self._finished = False
        self.budget = budget
        self.limited: set[str] = set()
        """The budgets this cell went over (a ``limit`` event was sent for each)."""

    def push(self, item: Any, cost: int = 0) -> None:
        """Queue ``item``; for a cell, wait while more than :data:`QUEUE_COST` waits
        (until the consumer takes some, closes the stream, or the sandbox dies)."""
        with self._cond:
            if self.budget is not None and item is not _DEAD:
                while self._queued > QUEUE_COST and not self._closed and not self._owner._dead:
                    self._cond.wait(1.0)
            if self._closed:
                return
            self._items.append((item, cost))
            self._queued += cost
            self._cond.notify_all()

    def next(self, timeout: float | None) -> Event | None:
        if self._finished:
            return None
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._items), timeout):
                return None
            item, cost = self._items.popleft()
            self._queued -= cost
            self._cond.notify_all()
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
        with self._cond:
            self._closed = True
            self._items.clear()
            self._queued = 0
            self._cond.notify_all()
        self._owner._forget(self._rid)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


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
    """

    limits_fix = "Lower the limits in Resources or raise the host's hard limits (ulimit -H)."
    """How to fix the host when the runner reports ``fatal`` ``limits``."""
    FATAL_MESSAGE_CHARS = 1000
    """A ``fatal`` message is cut to this in errors: it comes from inside the sandbox."""

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
        self._streams: dict[str, _Stream] = {}
        self._ready: queue.Queue[Any] = queue.Queue()
        self._greeted = False  # a "ready" or "fatal" arrived (only the first counts)
        self._dead = False
        self._death_reason = ""
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read_loop, name="sandlot-reader", daemon=True)
        self._reader.start()
        self._waiter = threading.Thread(target=self._wait_loop, name="sandlot-waiter", daemon=True)
        self._waiter.start()

    # --- lifecycle --------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> Event:
        """Block until the runner says ``ready`` in our protocol version; raise
        SandboxStartError (or ProtocolError for another version) otherwise."""
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise SandboxStartError(
                f"the sandbox did not become ready within {timeout:g} s" + self._stderr_suffix()
            ) from None
        if item is _DEAD:
            # The process may be seen dead before the reader has read the runner's last
            # message: the channel reaches EOF once the sandbox is gone, so wait for the
            # reader (bounded, in case something else holds the channel) and look again.
            self._reader.join(timeout=10)
            fatal = next((i for i in self._drain_ready() if i is not _DEAD), None)
            self.kill()  # reaps the process and closes our end of the channel
            if fatal is not None and fatal.get("type") == "fatal":
                raise self._refusal(fatal)
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

    def _drain_ready(self) -> list[Any]:
        found = []
        while True:
            try:
                found.append(self._ready.get_nowait())
            except queue.Empty:
                return found

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
        self._die("the sandbox was killed")
        with contextlib.suppress(OSError):
            self._process.kill()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("sandbox process %s did not exit after SIGKILL", self._process.pid)
        self._close_socket()
        self._waiter.join(timeout=10)

    def _close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
            self._death_reason = reason
            streams = list(self._streams.values())
            self._streams.clear()
        self._ready.put(_DEAD)
        for stream in streams:
            stream.wake()  # a reader waiting for room in a queue gives up
            stream.push(_DEAD)

    def _wait_loop(self) -> None:
        code = self._process.wait()
        if self._exit_reason is not None:
            reason = self._exit_reason(code)
        elif code < 0:
            reason = f"the sandbox process was killed by signal {-code}"
        else:
            reason = f"the sandbox process exited with status {code}"
        self._die(reason)
        if self._on_exit is not None:
            try:
                self._on_exit()
            except Exception:
                log.exception("sandbox cleanup failed")

    # --- requests ---------------------------------------------------------------------
    def request(self, message: dict[str, Any]) -> EventStream:
        rid = str(message.get("id") or f"r{next(self._ids)}")
        message = {**message, "id": rid}
        stream = _Stream(
            self, rid, CellBudget.for_request(str(message.get("type")), self._resources)
        )
        with self._lock:
            if self._dead:
                stream.push(_DEAD)
                return stream
            self._streams[rid] = stream
        try:
            data = encode_message(message)
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            self._die(f"the sandbox channel broke ({exc})")
        return stream

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def _read_loop(self) -> None:
        reader = self._sock.makefile("rb")
        try:
            while True:
                line = reader.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if not line.endswith(b"\n"):
                    raise ProtocolViolation(f"message longer than {MAX_LINE_BYTES} bytes")
                self._route(line)
                del line  # a 64 MiB line must not outlive its turn
        except ProtocolViolation as exc:
            # The runner shares the sandbox with untrusted code: a malformed message
            # means the sandbox is compromised or broken. Kill it; trust nothing more.
            log.warning("protocol violation from sandbox: %s", escape(exc, 1024))
            self._die(f"the sandbox broke the protocol ({exc}) and was killed")
            self._process.kill()
        except (OSError, ValueError):
            pass
        finally:
            reader.close()
        if not self._dead:
            try:
                code = self._process.wait(timeout=2)
                self._die(f"the sandbox exited (status {code})")
            except subprocess.TimeoutExpired:
                self._die("the sandbox closed its channel")
                self._process.kill()

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
        if stream is None:
            self._greeted = True
            self._ready.put(event)
        else:
            stream.push(event, cost)

    def _over(self, stream: _Stream, what: str) -> None:
        """Tell a cell, once per budget, that the host dropped some of what it sent."""
        if what in stream.limited:
            return
        stream.limited.add(what)
        limit = None if stream.budget is None else stream.budget.limit
        stream.push({"type": "limit", "id": stream._rid, "what": what, "limit": limit}, 0)
