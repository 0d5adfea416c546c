"""A fake backend for unit tests: ``Sandbox`` without a sandbox.

:class:`FakeBackend` stands in for an isolation backend the way
``httpx.MockTransport`` stands in for the network. You write a *handler* that
answers each protocol request (:mod:`sandlot.protocol`) with the events a runner
would send, and the SDK folds them exactly as it folds a real runner's: same
callbacks, limits, timeouts and error values. No code runs and nothing is
isolated, so tests of code that *uses* sandlot (agents, tools, UIs) need no
privileges and take milliseconds.

::

    from sandlot import Sandbox
    from sandlot.testing import FakeBackend

    def handler(request):
        if request["type"] == "execute":
            yield {"type": "stdout", "text": "hello\\n"}
            yield {"type": "result", "data": {"text/plain": "2"}, "is_main_result": True}
            yield {"type": "exit", "status": "ok", "execution_count": 1}
        else:
            yield {"type": "reply", "ok": False, "error": {"name": "FileOperationError",
                                                           "message": "not faked"}}

    backend = FakeBackend(handler)
    with Sandbox(backend=backend) as sbx:
        execution = sbx.run_code("print('hello'); 1 + 1")
    assert execution.text == "2"
    assert execution.logs.stdout == ["hello\\n"]
    assert backend.requests[0]["code"] == "print('hello'); 1 + 1"

The fake behaves like the real channel (:mod:`sandlot.backends._channel`):

* A handler's events are pulled one per ``stream.next()``; the handler is first
  called on the first ``next()``. Events without an ``id`` get the request's id;
  events naming another id are not delivered to this request (as on the wire).
* Every event goes through :func:`sandlot.protocol.decode`, like a real
  runner's. One the protocol forbids (unknown type, missing field, bad exit
  status) kills the fake sandbox, as the host does to a hostile runner, and the
  stream raises :class:`sandlot.SandboxLost`.
* Nothing after the terminal event (``exit`` or ``reply``) is delivered.
* A handler that stops without a terminal event is a hung runner: ``next(timeout)``
  waits ``timeout`` seconds and returns None (forever for None, until killed).
* ``raise Die("reason")`` in a handler simulates the sandbox dying: the events
  already yielded are delivered, then every stream raises ``SandboxLost(reason)``.
* After :meth:`FakeHandle.kill`, every stream raises ``SandboxLost``.
* A request the protocol forbids raises
  :class:`~sandlot.protocol.ProtocolViolation` from ``request()``: that is a bug
  in the caller, not the sandbox's doing.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from sandlot._exceptions import SandboxLost
from sandlot.backends import Backend, Event, EventStream, Probe, SandboxHandle
from sandlot.policy import SandboxSpec
from sandlot.protocol import (
    HOST_REQUESTS,
    RUNNER_MESSAGES,
    TERMINAL_EVENTS,
    ProtocolViolation,
    decode,
    encode,
)

__all__ = [
    "ECHO_PID",
    "Die",
    "FakeBackend",
    "FakeHandle",
    "FakeStream",
    "Handler",
    "echo_handler",
]

Handler = Callable[[dict[str, Any]], Iterable[Mapping[str, Any]]]
"""``handler(request) -> events``: a generator function or one returning a list."""


class Die(Exception):
    """Raise inside a handler to simulate the sandbox dying mid-request.

    ``reason`` becomes the handle's :attr:`~FakeHandle.death_reason` and the
    message of the :class:`sandlot.SandboxLost` every stream raises.
    """

    def __init__(self, reason: str = "the sandbox died") -> None:
        super().__init__(reason)
        self.reason = reason


class FakeStream(EventStream):
    """The events a handler produces for one request (see the module docstring)."""

    def __init__(self, handle: FakeHandle, request: dict[str, Any]) -> None:
        self._handle = handle
        self._request = request
        self._events: Iterator[Mapping[str, Any]] | None = None
        self._exhausted = False
        self._finished = False

    def next(self, timeout: float | None) -> Event | None:
        if self._finished:
            return None
        while True:
            self._raise_if_dead()
            if self._exhausted:
                # A runner that never sends its terminal event: silence until killed.
                if self._handle._wait_dead(timeout):
                    self._raise_if_dead()
                return None
            try:
                raw = next(self._iterator())
            except StopIteration:
                self._exhausted = True
                continue
            except Die as exc:
                self._handle._die(exc.reason)
                continue
            event = self._check(raw)
            if event is None:
                continue
            if event["type"] in TERMINAL_EVENTS:
                self.close()
            return event

    def close(self) -> None:
        self._finished = True
        close = getattr(self._events, "close", None)
        if callable(close):  # run the handler's finally blocks now
            close()

    def _iterator(self) -> Iterator[Mapping[str, Any]]:
        if self._events is None:
            events = self._handle._handler(self._request)
            if events is None:
                raise TypeError("the FakeBackend handler returned None instead of events")
            self._events = iter(events)
        return self._events

    def _raise_if_dead(self) -> None:
        if not self._handle.alive:
            self._finished = True
            raise SandboxLost(self._handle.death_reason or "the sandbox exited")

    def _check(self, raw: Mapping[str, Any]) -> Event | None:
        """The event as the host would see it, or None if it is not for this request."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"a FakeBackend handler yielded {type(raw).__name__}, not a dict")
        rid = self._request["id"]
        try:
            line = encode({"id": rid, **raw})
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"a FakeBackend handler yielded an event that is not JSON: {exc}"
            ) from exc
        try:
            event = decode(line, RUNNER_MESSAGES)
        except ProtocolViolation as exc:
            self._handle._die(f"the sandbox broke the protocol ({exc}) and was killed")
            return None
        if event["type"] == "ready" or event.get("id") != rid:
            return None  # the real channel routes these elsewhere
        return event


class FakeHandle(SandboxHandle):
    """A fake running sandbox: answers requests with its backend's handler."""

    def __init__(self, handler: Handler, spec: SandboxSpec) -> None:
        self.spec = spec
        """The spec this sandbox was started with."""
        self.requests: list[dict[str, Any]] = []
        """Every request sent while the sandbox was alive, in order, as the runner sees it."""
        self._handler = handler
        self._lock = threading.Lock()
        self._dead = threading.Event()
        self._death_reason = ""
        self._ids = itertools.count(1)

    def request(self, message: dict[str, Any]) -> FakeStream:
        rid = str(message.get("id") or f"r{next(self._ids)}")
        request = decode(encode({**message, "id": rid}), HOST_REQUESTS)
        with self._lock:
            if not self._dead.is_set():
                self.requests.append(request)
        # The handler gets its own copy: it may not alter what tests assert on.
        return FakeStream(self, copy.deepcopy(request))

    def kill(self) -> None:
        self._die("the sandbox was killed")

    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    @property
    def death_reason(self) -> str:
        return self._death_reason

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead.is_set():
                return
            self._death_reason = reason
            self._dead.set()

    def _wait_dead(self, timeout: float | None) -> bool:
        return self._dead.wait(timeout)


class FakeBackend(Backend):
    """A backend whose sandboxes answer requests with ``handler`` (see the module docs).

    ``Sandbox(backend=FakeBackend(handler))`` accepts it like any backend. Every
    start makes a new :class:`FakeHandle`, kept in :attr:`handles`.
    """

    name = "fake"

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.handles: list[FakeHandle] = []
        """Every sandbox started, oldest first (``len(handles)`` counts starts)."""
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> Probe:
        return Probe(
            name="fake",
            available=True,
            details={"isolation": "none: a test double that runs no code"},
        )

    def start(self, spec: SandboxSpec) -> FakeHandle:
        handle = FakeHandle(self.handler, spec)
        with self._lock:
            self.handles.append(handle)
        return handle

    @property
    def handle(self) -> FakeHandle:
        """The most recently started sandbox."""
        with self._lock:
            if not self.handles:
                raise LookupError("no sandbox was started on this FakeBackend")
            return self.handles[-1]

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every request to every sandbox of this backend, in order of sandbox start."""
        with self._lock:
            handles = list(self.handles)
        return [request for handle in handles for request in handle.requests]


ECHO_PID = 100
"""The pid ``echo_handler`` gives every background command it "starts"."""


def echo_handler(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A ready-made handler: cells and commands print their source and succeed.

    ``run_code(code)`` prints ``code`` to stdout and returns it as the main result's
    text; ``commands.run(cmd)`` prints ``cmd`` and exits 0, in the foreground and in the
    background (pid :data:`ECHO_PID`, ended before anyone can reattach: ``list()`` is
    empty, ``kill`` answers False, ``connect``/``send_stdin`` raise
    ``ProcessNotFoundError``). Every other request fails with a
    ``FileOperationError`` naming the request type.

    A handler of your own fakes background processes with the same events a runner
    sends: ``{"type": "started", "pid": N}``, output (``stdout``/``stderr``, or
    ``data`` with base64 for a terminal), then ``{"type": "exit", "status": "ok" |
    "error" | "timeout", "exit_code": C}``; a refusal is a failed ``reply`` (``error``
    ``{"name": "ProcessLimitError", ...}``).

    ``files.watch_dir(path)`` is watched at once and reports one ``create`` event
    named ``path``, then ends. A handler of your own fakes a watch with
    ``{"type": "watching"}``, ``{"type": "fs_event", "event": "create" | "write" |
    "remove" | "rename" | "chmod", "name": N}`` events, and ``exit`` (or nothing: the
    watch then runs until ``stop()``, which sends ``fs_watch_stop``); a refusal is a
    failed ``reply`` (``WatchLimitError``, ``NotFoundError``, ``PathNotAllowedError``).
    """
    kind = request["type"]
    if kind == "fs_watch":
        yield {"type": "watching"}
        yield {"type": "fs_event", "event": "create", "name": request["path"]}
        yield {"type": "exit", "status": "ok"}
        return
    if kind == "fs_watch_stop":
        yield {"type": "reply", "ok": True, "value": False}
        return
    if kind == "process_start":
        yield {"type": "started", "pid": ECHO_PID}
        yield {"type": "stdout", "text": request["cmd"]}
        yield {"type": "exit", "status": "ok", "exit_code": 0}
        return
    if kind in ("process_list", "process_kill", "process_detach"):
        yield {"type": "reply", "ok": True, "value": [] if kind == "process_list" else False}
        return
    if kind in ("process_connect", "process_stdin", "process_close_stdin", "pty_resize"):
        message = f"echo_handler: no running process {request['pid']}"
        yield {
            "type": "reply",
            "ok": False,
            "error": {"name": "ProcessNotFoundError", "message": message},
        }
        return
    if kind == "execute":
        yield {"type": "stdout", "text": request["code"]}
        yield {"type": "result", "data": {"text/plain": request["code"]}, "is_main_result": True}
        yield {"type": "exit", "status": "ok"}
    elif kind == "command":
        yield {"type": "stdout", "text": request["cmd"]}
        yield {"type": "exit", "status": "ok", "exit_code": 0}
    else:
        yield {
            "type": "reply",
            "ok": False,
            "error": {"name": "FileOperationError", "message": f"echo_handler: no {kind}"},
        }
