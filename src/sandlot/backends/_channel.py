"""A :class:`SandboxHandle` over a byte channel to the runner (shared by backends).

The backend starts the sandbox process and gives this class its end of the
protocol socket. A reader thread decodes every line with
:func:`sandlot.protocol.decode` (size limit, schema check) and routes events to the
stream of the request they answer. A message that breaks the protocol is treated as
an attack: the sandbox is killed and every waiting call gets :class:`SandboxLost`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any, Protocol

from sandlot._exceptions import (
    IsolationUnavailable,
    ProtocolError,
    SandboxLost,
    SandboxStartError,
    SandlotError,
)
from sandlot.backends._base import Event, EventStream, SandboxHandle
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


class _Stream(EventStream):
    def __init__(self, owner: ChannelHandle, rid: str) -> None:
        self._owner = owner
        self._rid = rid
        self._queue: queue.Queue[Any] = queue.Queue()
        self._finished = False

    def push(self, item: Any) -> None:
        self._queue.put(item)

    def next(self, timeout: float | None) -> Event | None:
        if self._finished:
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
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
        self._owner._forget(self._rid)


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
    ) -> None:
        self._sock = sock
        self._process = process
        self._exit_reason = exit_reason
        self._stderr_tail = stderr_tail
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._ready: queue.Queue[Any] = queue.Queue()
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
        stream = _Stream(self, rid)
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
        greeted = False
        try:
            while True:
                line = reader.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if not line.endswith(b"\n"):
                    raise ProtocolViolation(f"message longer than {MAX_LINE_BYTES} bytes")
                event = decode_message(line, RUNNER_MESSAGES)
                if event["type"] in ("ready", "fatal"):
                    # Only the first of these counts: a later "ready" or "fatal" is
                    # ignored (and not queued, so a flood of them costs nothing).
                    if not greeted:
                        greeted = True
                        self._ready.put(event)
                    continue
                with self._lock:
                    stream = self._streams.get(event["id"])
                if stream is not None:
                    stream.push(event)
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
