"""The sandbox's process table, as the supervisor sees it.

The supervisor is the sandbox's child subreaper: processes orphaned by user code
(double fork, setsid) re-parent to it. :class:`Processes` remembers which children
the supervisor started on purpose (kernels, commands); everything else re-parented
to it is a stray, which a timeout, a restart or shutdown finds and kills.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple


def _stats() -> Iterator[Tuple[int, List[bytes]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every process this
    pid namespace shows (zombies included); gone ones are skipped."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields follow the last ')'.
        yield int(name), data[data.rfind(b")") + 2 :].split()


def process_table() -> Dict[int, int]:
    """pid -> ppid for every process this pid namespace shows."""
    return {pid: int(fields[1]) for pid, fields in _stats() if len(fields) > 1}


def group_members(pgid: int) -> List[int]:
    """Every process (zombies included) in process group ``pgid``."""
    return [pid for pid, fields in _stats() if len(fields) > 2 and int(fields[2]) == pgid]


def descendants(root: int, table: Dict[int, int]) -> List[int]:
    children: Dict[int, List[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found: List[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def signal_all(pids: List[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


_LIBC = ctypes.CDLL(None, use_errno=True)
"""The C library, loaded once (in a zygote, once for every process forked from it)."""


def libc() -> ctypes.CDLL:
    """The C library (shared: a fresh ``CDLL`` in each forked process cost ~0.15 ms)."""
    return _LIBC


def close_all_but(keep: Set[int]) -> None:
    """Close every descriptor except ``keep``, in a process just forked.

    With ``close_range(2)`` over the gaps between the kept ones (Linux 5.9+): a few
    system calls, where listing ``/proc/self/fd`` and closing one by one cost a forked
    process ~0.25 ms, most of it copy-on-write faults. Where the call is missing or
    refused, every descriptor still open is closed the slow way."""
    try:
        close_range = _LIBC.close_range
    except AttributeError:
        close_range = None
    if close_range is not None:
        low = 0
        for fd in [*sorted(keep), None]:
            high = 0xFFFFFFFF if fd is None else fd - 1
            if low <= high and close_range(ctypes.c_uint(low), ctypes.c_uint(high), 0) != 0:
                break
            low = 0 if fd is None else fd + 1
        else:
            return
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


_ARGUMENT_AREA: List[int] = []
"""This process's argument area, once read: a fork keeps it where it was (no exec)."""


def argument_area() -> Tuple[int, int]:
    """Where ``/proc/self/cmdline`` is read from: ``(arg_start, arg_end)``. Read once;
    the zygote reads it before it forks, so its sandboxes' processes do not (reading
    and parsing ``/proc/self/stat`` cost a forked process ~0.2 ms)."""
    if not _ARGUMENT_AREA:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        _ARGUMENT_AREA[:] = [int(fields[45]), int(fields[46])]  # stat fields 48, 49
    return _ARGUMENT_AREA[0], _ARGUMENT_AREA[1]


def set_cmdline(argv: List[str]) -> None:
    """Make ``/proc/self/cmdline`` read ``argv`` (what a cold sandbox's process shows),
    by rewriting the argument area in place, as ps-title tools do. The area cannot
    grow: arguments that do not fit are dropped from the end."""
    start, end = argument_area()
    room = end - start
    data = b""
    for arg in argv:
        item = arg.encode() + b"\0"
        if len(data) + len(item) > room:
            break
        data += item
    ctypes.memmove(start, data.ljust(room, b"\0"), room)


class Forked:
    """A forked kernel, with the part of ``subprocess.Popen``'s interface the
    supervisor uses (``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            pid, status = self.pid, 9  # reaped elsewhere: report a kill
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._lock.acquire(False):
            try:
                if self.returncode is None:
                    self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if timeout is None:
            with self._lock:
                if self.returncode is None:
                    self._reap(0)
        else:
            deadline = time.monotonic() + timeout
            while self.poll() is None:
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired("kernel", timeout)
                time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Processes:
    """The children the supervisor started (kernels, commands) and the strays."""

    def __init__(self) -> None:
        self.spawn_lock = threading.RLock()
        self.known: Set[int] = set()

    def spawn(
        self, argv: List[str], stdin: Any = subprocess.DEVNULL, **kwargs: Any
    ) -> "subprocess.Popen[bytes]":
        # EAGAIN from fork is transient right after a fork bomb was killed: the pids
        # limit still counts its processes until they are reaped. Retry for ~2 s.
        for attempt in range(20):
            try:
                with self.spawn_lock:
                    proc = subprocess.Popen(argv, start_new_session=True, stdin=stdin, **kwargs)
                    self.known.add(proc.pid)
                return proc
            except BlockingIOError:
                if attempt == 19:
                    raise
                self.reap_strays()
                time.sleep(0.1)
        raise AssertionError("unreachable")

    def fork(self, child: Callable[[], None]) -> Forked:
        """Fork this process; the child runs ``child``, which must never return."""
        with self.spawn_lock:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child never returns
                child()
                os._exit(70)
            self.known.add(pid)
        return Forked(pid)

    def forget(self, pid: int) -> None:
        with self.spawn_lock:
            self.known.discard(pid)

    def strays(self, table: Dict[int, int]) -> List[int]:
        """Orphans re-parented to the supervisor that no kernel or command owns."""
        me = os.getpid()
        with self.spawn_lock:
            return [pid for pid, ppid in table.items() if ppid == me and pid not in self.known]

    def kill_tree(self, root: int, include_root: bool) -> None:
        """Kill everything below ``root`` (and root itself if asked) plus all strays.

        Processes are stopped before they are killed, repeatedly, so a fork bomb
        cannot outrun the scan.
        """
        for _ in range(200):
            table = process_table()
            victims = descendants(root, table) + self.strays(table)
            if include_root and root in table:
                victims.append(root)
            if not victims:
                break
            signal_all(victims, signal.SIGSTOP)
            signal_all(victims, signal.SIGKILL)
            self.reap_strays()
            time.sleep(0.005)

    def drain_group(self, pgid: int) -> None:
        """Kill what is left of process group ``pgid`` and reap its zombies.

        A killed fork bomb's processes re-parent here and stay zombies until reaped,
        and zombies still count against the sandbox's pids limit: a kill that answered
        before they were reaped let the next command start with no process or thread
        to be had. The host sees no such process (a zombie has no command line)."""
        for _ in range(200):
            members = group_members(pgid)
            if not members:
                return
            signal_all(members, signal.SIGKILL)
            self.reap_strays()
            time.sleep(0.005)

    def kill_strays(self) -> None:
        for _ in range(200):
            victims = self.strays(process_table())
            if not victims:
                return
            signal_all(victims, signal.SIGKILL)
            self.reap_strays()
            time.sleep(0.005)

    def reap_strays(self) -> None:
        for pid in self.strays(process_table()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def reaper_loop(self) -> None:
        while True:
            time.sleep(0.5)
            with contextlib.suppress(Exception):
                self.reap_strays()
