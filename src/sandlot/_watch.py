"""Directory watches: ``files.watch_dir`` -> :class:`WatchHandle`.

A core (local, remote or the fake) opens a :class:`WatchStream`; the handle reads it
on a thread of its own and either calls ``on_event`` for each event or keeps the
events for :meth:`WatchHandle.get_new_events` (E2B's sync shape), at most
:data:`KEPT_EVENTS` of them: past that, new events are dropped and the next
``get_new_events()`` ends with one ``overflow`` event saying how many.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from sandlot._exceptions import SandlotError
from sandlot._models import EntryInfo

__all__ = ["FilesystemEvent", "WatchHandle", "WatchStream"]

FilesystemEventType = Literal["create", "write", "remove", "rename", "chmod", "overflow"]
EVENT_TYPES: frozenset[str] = frozenset(
    {"create", "write", "remove", "rename", "chmod", "overflow"}
)
KEPT_EVENTS = 10_000
"""Events a handle keeps for ``get_new_events()`` between two calls."""


@dataclass(frozen=True, slots=True)
class FilesystemEvent:
    """One change in a watched directory.

    ``type``: ``create`` (also the new name of a rename), ``write``, ``remove``,
    ``rename`` (the old name), ``chmod``; or ``overflow``: events were lost (too
    many at once, or a new subdirectory past the sandbox's watch cap; ``name`` says
    which, or how many were dropped). ``name`` is relative to the watched directory.
    ``entry``: with ``watch_dir(..., include_entry=True)``, what ``name`` is just
    after the change (as ``files.get_info`` says), when it still exists; else None.
    """

    name: str
    type: FilesystemEventType
    entry: EntryInfo | None = None


class WatchStream(Protocol):
    """The events of one watch, as a core delivers them (blocking iterator)."""

    def events(self) -> Iterator[FilesystemEvent]:
        """Events until the watch ends (its directory went away) or :meth:`close`."""
        ...

    def close(self) -> None:
        """End the watch in the sandbox. Idempotent, callable from any thread."""
        ...


class WatchHandle:
    """A watch on a directory in the sandbox, from ``files.watch_dir``.

    Without ``on_event``, call :meth:`get_new_events` for what changed since the last
    call. Call :meth:`stop` when done (the sandbox has a cap on watches).
    """

    def __init__(
        self, stream: WatchStream, on_event: Callable[[FilesystemEvent], object] | None = None
    ) -> None:
        self._stream = stream
        self._on_event = on_event
        self._lock = threading.Lock()
        self._events: list[FilesystemEvent] = []
        self._dropped = 0
        self._stopped = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True, name="sandlot-watch")
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream.events():
                if self._on_event is not None:
                    self._on_event(event)
                    continue
                with self._lock:
                    if len(self._events) < KEPT_EVENTS:
                        self._events.append(event)
                    else:
                        self._dropped += 1
        except BaseException as exc:  # kept for the caller: a thread has no one to raise to
            self._error = exc
            self._stream.close()
        finally:
            self._done.set()

    @property
    def running(self) -> bool:
        """False once stopped, or once the watch ended (its directory went away)."""
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the watch ends (stopped, or its directory went away); False if
        it still runs after ``timeout`` seconds."""
        return self._done.wait(timeout)

    def get_new_events(self) -> list[FilesystemEvent]:
        """The events since the last call (or since the watch began)."""
        if self._stopped:
            raise SandlotError("the watch is stopped")
        with self._lock:
            events, self._events = self._events, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            events.append(FilesystemEvent(name=f"{dropped} events dropped", type="overflow"))
        if not events and self._error is not None:
            error, self._error = self._error, None
            raise error
        return events

    def stop(self) -> None:
        """Stop watching. Idempotent."""
        self._stopped = True
        self._stream.close()
        if threading.current_thread() is not self._thread:
            self._thread.join()
