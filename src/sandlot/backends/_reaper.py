"""One thread for the whole process that notices sandbox processes exit.

A sandbox's host-side process (bwrap, or a zygote-made sandbox's pid 1) is watched
through a pidfd: it becomes readable when the process exits. Every handle registers
its pidfd here instead of starting a thread of its own that waits, so starting a
sandbox starts no thread, and ``kill()`` can return once the sandbox is signalled:
reaping it and releasing what it held (its cgroup, host ids, egress lease) happens
here, in the background. :func:`drain` waits for that work (the interpreter's exit
does), so nothing a sandbox held outlives the process that made it.

The thread starts on first use and ends once it has nothing to watch for a while.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
from collections.abc import Callable

log = logging.getLogger("sandlot.backend")

IDLE_EXIT = 2.0
"""Seconds the thread stays with nothing to watch before it ends (the next sandbox
starts it again)."""

_lock = threading.Lock()
_idle = threading.Condition(_lock)
_watched: dict[int, Callable[[], None]] = {}
_epoll: select.epoll | None = None
_running = False
_busy = 0
"""Callbacks being run right now (for :func:`drain`)."""
_dying: set[int] = set()
"""Watched descriptors whose process was killed (what :func:`drain` waits for; a live
sandbox at exit is not waited for: it dies with this process)."""


def watch(fd: int, on_exit: Callable[[], None]) -> None:
    """Call ``on_exit()`` on the reaper thread once ``fd`` (a pidfd) is readable, which
    is once its process has exited. ``fd`` must stay open until then; it is the
    caller's to close afterwards. Exceptions from ``on_exit`` are logged."""
    global _epoll, _running
    with _lock:
        if _epoll is None:
            _epoll = select.epoll()
        _watched[fd] = on_exit
        _epoll.register(fd, select.EPOLLIN)
        if not _running:
            _running = True
            threading.Thread(
                target=_run, args=(_epoll,), name="sandlot-reaper", daemon=True
            ).start()


def killed(fd: int) -> None:
    """``fd``'s process was sent SIGKILL: :func:`drain` waits for its ``on_exit``."""
    with _lock:
        if fd in _watched:
            _dying.add(fd)


def drain(timeout: float) -> bool:
    """Wait until every killed process has exited and its ``on_exit`` ran; True if so
    within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with _idle:
        while _dying or _busy:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _idle.wait(left)
    return True


def _run(epoll: select.epoll) -> None:
    global _running, _busy
    idle_since: float | None = None
    while True:
        try:
            ready = epoll.poll(IDLE_EXIT if idle_since is not None else 1.0)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        callbacks = []
        with _lock:
            for fd, _ in ready:
                callback = _watched.pop(fd, None)
                _dying.discard(fd)
                if callback is not None:
                    epoll.unregister(fd)
                    callbacks.append(callback)
            _busy += len(callbacks)
            if not _watched and not callbacks:
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= IDLE_EXIT:
                    _running = False
                    return
            else:
                idle_since = None
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("sandbox cleanup failed")
            finally:
                with _idle:
                    _busy -= 1
                    _idle.notify_all()


def _reset_after_fork() -> None:
    # A forked child has no reaper thread and none of its parent's sandboxes to reap.
    global _lock, _idle, _epoll, _running, _busy
    _lock = threading.Lock()
    _idle = threading.Condition(_lock)
    _watched.clear()
    _dying.clear()
    _epoll = None
    _running = False
    _busy = 0


os.register_at_fork(after_in_child=_reset_after_fork)


@atexit.register
def _drain_at_exit() -> None:
    # Sandboxes killed just before exit are still being cleaned up (cgroups removed,
    # host ids released): let that finish rather than leave them to the next start's
    # sweep. Bounded: a cgroup that cannot be removed is reported, not waited for.
    if not drain(10.0):
        log.error("sandbox cleanup did not finish before exit")
