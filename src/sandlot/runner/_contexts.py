"""Code contexts: one kernel process per context, seen from the supervisor.

A :class:`KernelProcess` starts its kernel (spawned as a new interpreter, or forked
from a zygote-made supervisor that already holds the preloaded modules), listens to
its event socket and its stdout/stderr pipes on a thread of its own, forwards a
cell's events to the host within the cell's :class:`OutputBudget`, and enforces the
cell's timeout (SIGINT, then a kill and a restart after the grace period).
"""

from __future__ import annotations

import array
import contextlib
import functools
import heapq
import itertools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Set, Tuple

from sandlot.protocol import MAX_LINE_BYTES, encode, loads
from sandlot.runner import BOOTSTRAP
from sandlot.runner._processes import (
    Forked,
    Processes,
    close_all_but,
    libc,
    set_cmdline,
    signal_all,
)

PR_SET_DUMPABLE = 4
READ_BYTES = 64 * 1024
"""Bytes a kernel's listener reads from its socket at a time. Under glibc's threshold
for allocating with ``mmap`` (128 KiB): a megabyte read cost an ``mmap``, an ``mremap``
and an ``munmap`` (with its TLB shootdown across the supervisor's threads) every cell."""
INLINE_BYTES = 16 * 1024
"""Largest ``execute`` message the thread that read it sends to an idle kernel itself
(:meth:`KernelProcess.try_begin`); it never waits for the kernel to read it."""


_HEADS = {
    kind: b'{"type":"%s","id":"' % kind.encode() for kind in ("stdout", "stderr", "result", "exit")
}
"""How :func:`encode` starts a kernel event of each kind that may be passed on as it is."""
VERBATIM_BYTES = 64 * 1024
"""Longest kernel line passed on as it is. Anything the kernel pads a line with (JSON
allows any whitespace between values) then costs the host no more than this a line; the
lines themselves are bounded as before (output budget, ``max_results``, one exit)."""
TEXT_SLACK = 64
"""Bytes of envelope (type, id, quotes) a plain-output line may have beyond twice its
text's size and still be passed on as it is: text as JSON escapes it, not padding."""
_PLAIN_ID = re.compile(r"[-0-9A-Za-z_.:]{1,512}\Z")
"""Request ids that JSON writes as they are (no escapes), as the host makes them."""

Deadline = List[Any]
"""``[when, sequence number, callback or None once cancelled]`` (a heap entry)."""


class Deadlines:
    """One thread that enforces the timeout of every running cell.

    A cell adds its deadline when it starts and cancels it when it ends. The thread
    wakes only for the earliest deadline, so a cell that ends in time wakes no thread
    at all (a thread per cell that waited for it cost tens of microseconds of every
    round trip). What a deadline's callback returns, which may block (a grace period,
    a restart), runs on a worker. Cancelled entries are dropped in bulk once they are
    half the heap, so a stream of short cells keeps it small.
    """

    def __init__(self, submit: Callable[[Callable[[], None]], None]) -> None:
        self.submit = submit
        self.cond = threading.Condition()
        self.heap: List[Deadline] = []
        self.cancelled = 0
        self.count = itertools.count()

    def start(self) -> None:
        """Start the thread: once, before the first cell (and after a zygote-made
        supervisor forked its first kernel, which it does only while single-threaded)."""
        threading.Thread(target=self.run, name="sandlot-deadlines", daemon=True).start()

    def add(self, when: float, callback: Callable[[], Optional[Callable[[], None]]]) -> Deadline:
        entry: Deadline = [when, next(self.count), callback]
        with self.cond:
            heapq.heappush(self.heap, entry)
            if self.heap[0] is entry:
                self.cond.notify()  # earlier than what the thread waits for
        return entry

    def cancel(self, entry: Deadline) -> None:
        with self.cond:
            if entry[2] is None:
                return
            entry[2] = None
            self.cancelled += 1
            if self.cancelled > 64 and self.cancelled * 2 > len(self.heap):
                self.heap = [e for e in self.heap if e[2] is not None]
                heapq.heapify(self.heap)
                self.cancelled = 0

    def run(self) -> None:
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    if self.heap and self.heap[0][0] <= now:
                        entry = heapq.heappop(self.heap)
                        callback, entry[2] = entry[2], None
                        if callback is not None:
                            break
                        self.cancelled -= 1
                        continue
                    self.cond.wait(self.heap[0][0] - now if self.heap else None)
            try:
                task = callback()
                if task is not None:
                    try:
                        self.submit(task)
                    except RuntimeError:
                        task()  # no thread to be had (a thread bomb): here, then
            except Exception as exc:  # one cell's failure must not end all enforcement
                sys.stderr.write("sandlot runner: timeout handling failed: %r\n" % (exc,))


Prestarted = Callable[[str, Dict[str, Any]], "Tuple[Forked, socket.socket, int, int]"]
"""Hands over a kernel started ahead of its sandbox (the microvm backend's snapshot
holds one): given the working directory and the kernel's configuration, it lets the
kernel go on and returns it, its end of the kernel's socket, and its stdout and
stderr pipes (read ends, non-blocking)."""


class Host(Protocol):
    """What a kernel needs from the supervisor that owns it."""

    config: Dict[str, Any]
    deadlines: Deadlines
    lib: str
    grace: float
    output_bytes: Any
    max_results: Any
    result_bytes: Any
    processes: Processes

    def send(self, message: Dict[str, Any]) -> None: ...

    def send_line(self, data: bytes) -> None: ...

    def batched(self) -> ContextManager[None]: ...

    def take_fork(self) -> bool: ...

    def take_prestarted(self) -> "Optional[Prestarted]": ...


class OutputBudget:
    """Per-cell accounting of stdout/stderr bytes and rich results, with markers.

    ``truncated`` (reported on the exit event) is set when text was cut or a result
    was dropped; the markers saying so are sandlot's own and bypass the text budget,
    so a cell that already filled it still learns that its results were dropped.
    """

    def __init__(self, supervisor: Host, rid: str) -> None:
        self.supervisor = supervisor
        self.rid = rid
        self.used = 0
        self.results = 0
        self.text_cut = False
        self.dropped = False
        self.lock = threading.Lock()

    @property
    def truncated(self) -> bool:
        return self.text_cut or self.dropped

    def text(self, kind: str, text: str, line: Optional[bytes] = None) -> None:
        """Forward ``text`` within the cell's output limit. ``line``: the kernel's own
        line for exactly this event (checked by the caller, :meth:`Cell.verbatim`),
        passed on as it is when the text is not cut (not encoded a second time)."""
        limit = self.supervisor.output_bytes
        with self.lock:
            if self.text_cut:
                return
            size = len(text.encode("utf-8", "replace"))
            if limit is not None and self.used + size > limit:
                line = None
                room = max(0, limit - self.used)
                text = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
                text += (
                    "\n[sandlot: output truncated: more than %d bytes of stdout/stderr]\n" % limit
                )
                self.text_cut = True
            self.used += size
        if not text:
            return
        if line is not None and len(line) <= 2 * size + TEXT_SLACK:
            self.supervisor.send_line(line + b"\n")
        else:
            self.supervisor.send({"type": kind, "id": self.rid, "text": text})

    def cut(self) -> None:
        """Mark the text output as truncated (a line too large to even forward)."""
        limit = self.supervisor.output_bytes
        with self.lock:
            if self.text_cut:
                return
            self.text_cut = True
        self.supervisor.send(
            {
                "type": "stderr",
                "id": self.rid,
                "text": "\n[sandlot: output truncated: more than %s bytes of stdout/stderr]\n"
                % (limit if limit is not None else MAX_LINE_BYTES),
            }
        )

    def note(self, text: str) -> None:
        """A marker about dropped results (at most one per allowed result, so bounded)."""
        self.dropped = True
        self.supervisor.send({"type": "stderr", "id": self.rid, "text": text})

    def result(
        self,
        message: Dict[str, Any],
        line_bytes: Optional[int] = None,
        line: Optional[bytes] = None,
    ) -> None:
        """Forward a result within the cell's limits. ``line_bytes``: the size of the
        line it came in; ``json.dumps`` of its data is at most three times that (a
        UTF-8 byte becomes at most three ASCII-escaped characters), so a result whose
        line is that small is not serialised again only to be measured. ``line``: that
        line, when it may be passed on as it is (:meth:`Cell.verbatim`)."""
        limit = self.supervisor.max_results
        size_limit = self.supervisor.result_bytes
        # Size first: an oversized result is dropped without taking one of the slots.
        if (
            size_limit is not None
            and (line_bytes is None or 3 * line_bytes > size_limit)
            and len(json.dumps(message["data"])) > size_limit
        ):
            self.note("[sandlot: a result larger than %d bytes was dropped]\n" % size_limit)
            return
        with self.lock:
            self.results += 1
            count = self.results
        if limit is not None and count > limit:
            if count == limit + 1:
                self.note(
                    "[sandlot: more than %d results in one cell; the rest were dropped]\n" % limit
                )
            else:
                self.dropped = True
            return
        if line is not None:
            self.supervisor.send_line(line + b"\n")
        else:
            self.supervisor.send(message)


def pump(stream: Any, budget: OutputBudget, kind: str) -> None:
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            return
        budget.text(kind, chunk.decode("utf-8", "replace"))


class Cell:
    """State of the cell a kernel is running."""

    def __init__(self, rid: str, budget: OutputBudget) -> None:
        self.rid = rid
        self.budget = budget
        self.done = threading.Event()
        self.finish_lock = threading.Lock()
        self.timed_out = False
        self.interrupted = False
        self.error_sent = False
        """The cell's error event went to the host (a cell that ends in error sends one)."""
        self.pending_exit: Optional[Tuple[Any, Any]] = None
        self.timeout = 0.0
        self.deadline = 0.0
        """``time.monotonic()`` at which the cell times out (set when it is sent)."""
        self.unsent = b""
        """The end of its ``execute`` message that the kernel has not taken yet."""
        self.sock: Optional[socket.socket] = None
        """The kernel socket ``unsent`` is for (a replaced kernel must not get it)."""
        self.deadline_entry: Optional[List[Any]] = None
        self.rid_bytes = rid.encode() if _PLAIN_ID.match(rid) else None
        """The id as :func:`encode` writes it (None: one never passed on verbatim)."""
        self.watcher_releases = True
        """Who ends the cell's hold on its kernel (``exec_lock``): once its message is
        sent (:meth:`KernelProcess.sent`), its exit (finish), so that the next cell
        waits for no other thread; once it timed out, :meth:`KernelProcess.expire`.
        Until then, the thread that sends it."""

    def verbatim(self, kind: str, line: bytes) -> Optional[bytes]:
        """``line`` if it may go to the host as the kernel wrote it, else None.

        The kernel is user code. Its line was parsed here (``kind``, and this cell's
        id, are what the parsed message holds); the host reads the type and the id
        off the start of a line to route and account it, and refuses a line whose
        parsed type or id differs from those (duplicate keys). So only a line that
        starts with exactly this cell's type and id, as :func:`encode` writes them,
        is passed on; any other is encoded again from what was parsed."""
        head, rid = _HEADS[kind], self.rid_bytes
        if rid is None or len(line) > VERBATIM_BYTES or not line.startswith(head):
            return None
        start = len(head)
        if line.startswith(rid, start) and line.startswith(b'",', start + len(rid)):
            return line
        return None


class KernelProcess:
    """A kernel subprocess for one code context, and the thread that listens to it."""

    def __init__(
        self,
        supervisor: Host,
        context_id: str,
        cwd: str,
        language: str,
        sock: Optional[socket.socket] = None,
    ) -> None:
        """``sock``: no kernel process is started; the kernel is whatever answers on
        this socket (a zygote's warm-up, :func:`sandlot.runner._zygote._warm_up`)."""
        self.supervisor = supervisor
        self.context_id = context_id
        self.cwd = cwd
        self.language = language
        self.exec_lock = threading.Lock()
        self.state_lock = threading.RLock()
        """Held while the kernel process is replaced, so requests see a live one."""
        self.cell: Optional[Cell] = None
        self.stopping = False
        self.proc: "Optional[subprocess.Popen[bytes] | Forked]" = None
        self.preloaded = threading.Event()
        """Set when the kernel has imported the configured ``preload`` modules."""
        if sock is None:
            self.launch()
        else:
            self.sock = sock
            self.pipes: Dict[int, str] = {}

    def describe(self) -> Dict[str, Any]:
        return {"id": self.context_id, "language": self.language, "cwd": self.cwd}

    def launch(self) -> None:
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        # Our ends only (the kernel's stay blocking): a drain before a cell's exit is
        # then one read a pipe, without switching modes around it.
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        config = {
            "memory_mb": self.supervisor.config.get("memory_mb"),
            "rlimits": self.supervisor.config.get("rlimits") or {},
            "preload": self.supervisor.config.get("preload") or [],
            "language": self.language,
        }
        argv = [
            sys.executable,
            "-I",
            "-c",
            BOOTSTRAP,
            self.supervisor.lib,
            "kernel",
            "--fd",
            str(theirs.fileno()),
            "--config",
            json.dumps(config),
        ]
        try:
            prestarted = self.supervisor.take_prestarted()
            if prestarted is not None:  # a microVM's kernel, started before its snapshot
                ours.close()
                os.close(out_r)
                os.close(err_r)
                self.proc, ours, out_r, err_r = prestarted(self.cwd, config)
            elif self.supervisor.take_fork():
                sock_fd, cwd = theirs.fileno(), self.cwd
                self.proc = self.supervisor.processes.fork(
                    lambda: become_kernel(sock_fd, out_w, err_w, cwd, argv)
                )
            else:
                self.proc = self.supervisor.processes.spawn(
                    argv,
                    cwd=self.cwd,
                    env=dict(os.environ),
                    stdout=out_w,
                    stderr=err_w,
                    pass_fds=(theirs.fileno(),),
                )
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        self.sock = ours
        self.pipes = {out_r: "stdout", err_r: "stderr"}
        self.listener = threading.Thread(
            target=self.listen, args=(self.proc, ours, out_r, err_r), daemon=True
        )
        self.listener.start()

    # --- the listener thread ----------------------------------------------------------
    def listen(
        self, proc: "subprocess.Popen[bytes]", sock: socket.socket, out_r: int, err_r: int
    ) -> None:
        # poll() itself, not selectors: one wake-up per kernel event, and the selectors
        # layer cost microseconds of every one.
        poller = select.poll()
        sock_fd = sock.fileno()
        poller.register(sock_fd, select.POLLIN)
        poller.register(out_r, select.POLLIN)
        poller.register(err_r, select.POLLIN)
        kinds = {out_r: "stdout", err_r: "stderr"}
        # A partial line; bytes are appended and only new data is scanned for the newline,
        # so a huge line costs linear time (it used to be quadratic: a 64 MB print took
        # the cell past its timeout). A line past the protocol limit is dropped.
        pending = bytearray()
        overlong = False
        open_pipes = {out_r, err_r}
        sock_open = True
        batch = self.supervisor.batched()  # a result and its exit: one write
        while sock_open:
            for fd, _ in poller.poll():
                if fd == sock_fd:
                    data = sock.recv(READ_BYTES)
                    if not data:
                        sock_open = False
                        break
                    *lines, rest = data.split(b"\n")
                    if lines:
                        with batch:
                            for line in lines:
                                if not overlong:
                                    if pending:
                                        pending += line
                                        line = bytes(pending)
                                    self.on_kernel_event(line, out_r, err_r, open_pipes)
                                pending = bytearray()
                                overlong = False
                    if not overlong:
                        pending += rest
                    if len(pending) > MAX_LINE_BYTES:
                        pending = bytearray()
                        overlong = True
                        cell = self.cell
                        if cell is not None and not cell.done.is_set():
                            cell.budget.cut()
                else:
                    self.read_pipe(fd, kinds[fd], poller, open_pipes)
        for fd in (out_r, err_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        sock.close()
        self.on_kernel_gone(proc)

    def read_pipe(self, fd: int, kind: str, poller: Any, open_pipes: Set[int]) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return  # drained meanwhile (by drain_pipes)
        except OSError:
            data = b""
        if not data:
            poller.unregister(fd)
            open_pipes.discard(fd)
            return
        cell = self.cell
        if cell is not None and not cell.done.is_set():
            cell.budget.text(kind, data.decode("utf-8", "replace"))

    def drain_pipes(self, open_pipes: Set[int]) -> None:
        """Forward whatever is already in the stdout/stderr pipes (before an exit)."""
        poller = select.poll()  # one system call finds the (usual) nothing to drain
        for fd in open_pipes:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):  # non-blocking (see launch)
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # BlockingIOError: drained
                    break
                if not data:
                    break
                cell = self.cell
                if cell is not None:
                    cell.budget.text(self.pipes[fd], data.decode("utf-8", "replace"))

    def on_kernel_event(self, line: bytes, out_r: int, err_r: int, open_pipes: Set[int]) -> None:
        cell = self.cell
        if cell is None or cell.done.is_set():
            if b'"preloaded"' in line and _event_type(line) == "preloaded":
                self.preloaded.set()
            return
        try:
            message = loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(message, dict) or message.get("id") != cell.rid:
            return
        kind = message.get("type")
        if kind in ("stdout", "stderr") and isinstance(message.get("text"), str):
            # Passed on as it is only with no other field (the host takes a line of
            # type, id and text alone for plain output, outside the results budget).
            raw = cell.verbatim(kind, line) if len(message) == 3 else None
            cell.budget.text(kind, message["text"], raw)
        elif kind == "result":
            cell.budget.result(message, len(line), cell.verbatim(kind, line))
        elif kind == "error":
            if cell.timed_out and message.get("name") == "KeyboardInterrupt":
                message = self.timeout_error(cell, restarted=False)
            cell.error_sent = True
            self.supervisor.send(message)
        elif kind == "exit":
            self.drain_pipes(open_pipes)
            status = message.get("status")
            if cell.timed_out and (status == "ok" or not cell.error_sent):
                # The timeout killed what the cell was waiting for (a shell command,
                # a subprocess) and the cell then ran to its end before the interrupt
                # reached it, or the interrupt landed where the kernel could not report
                # it (inside a write of a flood of output): it still did not finish in
                # time, and says so.
                cell.error_sent = True
                self.supervisor.send(self.timeout_error(cell, restarted=False))
            if cell.timed_out and status in ("interrupted", "error", "ok"):
                status = "timeout"
            if status == "oom" and message.get("kept") is not True:
                # The kernel exits right after this; finish only once a fresh kernel
                # is in place, so the next cell cannot reach the dying one.
                cell.pending_exit = (status, message.get("execution_count"))
                return
            count = message.get("execution_count")
            raw = None
            if status in ("ok", "error") and not cell.timed_out and len(message) == 4:
                raw = cell.verbatim(kind, line) if type(count) is int else None
            self.finish(cell, status, count, raw)

    def timeout_error(self, cell: Cell, restarted: bool) -> Dict[str, Any]:
        if restarted:
            detail = "the kernel did not stop and was restarted; its variables were lost"
        else:
            detail = "the cell was interrupted; variables from earlier cells are kept"
        return {
            "type": "error",
            "id": cell.rid,
            "name": "TimeoutError",
            "value": "execution timed out after %g seconds (%s)" % (cell.timeout, detail),
            "traceback": "",
        }

    def finish(
        self, cell: Cell, status: Any, count: Any = None, line: Optional[bytes] = None
    ) -> None:
        """Send the cell's one and only exit event. ``line``: the kernel's exit, which
        says this (its type, id, ``status`` and ``execution_count`` alone), to pass on
        as it is unless the cell's output was cut (the exit then says so)."""
        with cell.finish_lock:
            if cell.done.is_set():
                return
            if line is not None and not cell.budget.truncated:
                self.supervisor.send_line(line + b"\n")
            else:
                message: Dict[str, Any] = {"type": "exit", "id": cell.rid, "status": status}
                if isinstance(count, int):
                    message["execution_count"] = count
                if cell.budget.truncated:
                    message["truncated"] = True
                self.supervisor.send(message)
            cell.done.set()
            if cell.deadline_entry is not None:
                self.supervisor.deadlines.cancel(cell.deadline_entry)
            if not cell.watcher_releases:
                self.exec_lock.release()

    def on_kernel_gone(self, proc: "subprocess.Popen[bytes]") -> None:
        code = proc.wait()
        self.supervisor.processes.forget(proc.pid)
        cell = self.cell
        report: Optional[Dict[str, Any]] = None
        status: Any = None
        count: Any = None
        if cell is not None and not cell.done.is_set() and not cell.timed_out:
            if cell.pending_exit is not None:
                status, count = cell.pending_exit
            else:
                name, status, value = _death_cause(code, self.stopping)
                report = {
                    "type": "error",
                    "id": cell.rid,
                    "name": name,
                    "value": value,
                    "traceback": "",
                }
        # (a timed-out cell is reported by execute(), which also restarts the kernel)
        if not self.stopping and proc is self.proc:
            with self.state_lock:
                if not self.stopping and proc is self.proc:
                    self.supervisor.processes.kill_strays()
                    self.launch()  # a context always has a live kernel
        if cell is not None and status is not None:
            if report is not None:
                self.supervisor.send(report)
            self.finish(cell, status, count)

    # --- requests ---------------------------------------------------------------------
    def execute(self, request: Dict[str, Any]) -> None:
        """Start a cell on a worker: wait for the kernel to be free, then send it."""
        self.exec_lock.acquire()
        try:
            cell = self.begin(request)
        except BaseException:
            self.exec_lock.release()
            raise
        try:
            with self.state_lock:
                self.sock.sendall(self.message(request))
        except OSError:
            pass  # the kernel died; its listener reports it and restarts it
        finally:
            self.sent(cell)

    def try_begin(self, request: Dict[str, Any], data: Optional[bytes] = None) -> Optional[Cell]:
        """Start a cell only if that cannot block (the kernel idle, in place, and the
        message small): the caller is the thread that reads the host channel. If the
        kernel did not take all of it, :meth:`send_rest` must follow on a worker.
        ``data``: the host's ``execute`` line, which the kernel takes as it is (it
        reads ``id``, ``code``, ``envs`` and ``silent``; the rest is the supervisor's);
        None: :meth:`message` makes one. None: nothing was done."""
        if data is None:
            data = self.message(request)
        if len(data) > INLINE_BYTES or not self.exec_lock.acquire(blocking=False):
            return None
        if not self.state_lock.acquire(blocking=False):  # the kernel is being replaced
            self.exec_lock.release()
            return None
        try:
            cell = self.begin(request, arm=False)
        except BaseException:
            self.state_lock.release()
            self.exec_lock.release()
            raise
        try:
            # Never waits: a kernel that does not read its socket (stopped, or
            # forging its cells' exits) leaves the rest to send_rest().
            sent = self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = len(data)  # the kernel died; its listener reports it
        finally:
            self.state_lock.release()
        self.arm(cell)  # after the send: the kernel starts the cell meanwhile
        cell.unsent, cell.sock = data[sent:], self.sock
        if not cell.unsent:
            self.sent(cell)
        return cell

    def send_rest(self, cell: Cell) -> None:
        """Send what :meth:`try_begin` could not (waiting for the kernel to read it)."""
        try:
            with self.state_lock:
                if self.sock is cell.sock:
                    self.sock.sendall(cell.unsent)
        except OSError:
            pass  # the kernel died; its listener reports it and restarts it
        finally:
            cell.unsent, cell.sock = b"", None
            self.sent(cell)

    def sent(self, cell: Cell) -> None:
        """The cell's message is with its kernel: from now on its exit releases the
        kernel (if the exit came already, this does)."""
        with cell.finish_lock:
            if cell.timed_out:
                return  # the timeout's handling releases it
            cell.watcher_releases = False
            ended = cell.done.is_set()
        if ended:
            self.exec_lock.release()

    def begin(self, request: Dict[str, Any], arm: bool = True) -> Cell:
        """The cell of ``request``, made current, its timeout armed (``arm``; else the
        caller arms it with :meth:`arm`); exec_lock held."""
        cell = Cell(request["id"], OutputBudget(self.supervisor, request["id"]))
        cell.timeout = float(request["timeout"])
        cell.deadline = time.monotonic() + cell.timeout
        self.cell = cell
        if arm:
            self.arm(cell)
        return cell

    def arm(self, cell: Cell) -> None:
        """Enforce the cell's deadline (counted from :meth:`begin`). Armed after the
        kernel was sent the cell, off the way from the host to the kernel; a cell that
        ended meanwhile (its exit already sent) needs none."""
        with cell.finish_lock:
            if not cell.done.is_set():
                cell.deadline_entry = self.supervisor.deadlines.add(
                    cell.deadline, functools.partial(self.on_deadline, cell)
                )

    @staticmethod
    def message(request: Dict[str, Any]) -> bytes:
        return encode(
            {
                "type": "execute",
                "id": request["id"],
                "code": request["code"],
                "envs": request["envs"],
                "silent": request.get("silent") is True,
            }
        )

    def on_deadline(self, cell: Cell) -> Optional[Callable[[], None]]:
        """The cell's time is up (on the deadline thread): if it still runs, what stops
        it (for a worker: it waits)."""
        with cell.finish_lock:
            if cell.done.is_set():
                return None  # ended in time (and its exit released the kernel)
            cell.timed_out = True
            cell.watcher_releases = True
        return functools.partial(self.expire, cell)

    def expire(self, cell: Cell) -> None:
        """Stop a timed-out cell: kill what it started and interrupt the kernel; if the
        kernel does not stop within the grace period, kill and restart it. Releases
        the kernel for the next cell at the end."""
        try:
            proc = self.proc
            if proc is not None:
                self.supervisor.processes.kill_tree(proc.pid, include_root=False)
                signal_all([proc.pid], signal.SIGINT)
            if cell.done.wait(self.supervisor.grace):
                return
            self.supervisor.send(self.timeout_error(cell, restarted=True))
            self.finish(cell, "timeout")
            self.restart()
        finally:
            self.exec_lock.release()

    def interrupt(self) -> None:
        proc = self.proc
        cell = self.cell
        if proc is not None and cell is not None and not cell.done.is_set():
            cell.interrupted = True
            self.supervisor.processes.kill_tree(proc.pid, include_root=False)
            signal_all([proc.pid], signal.SIGINT)

    def restart(self) -> None:
        with self.state_lock:
            self.kill()
            self.stopping = False
            self.launch()

    def kill(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is None:
            return
        self.supervisor.processes.kill_tree(proc.pid, include_root=True)
        proc.wait()
        self.listener.join(timeout=2)

    def stop(self) -> None:
        self.kill()


def _event_type(line: bytes) -> Any:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message.get("type") if isinstance(message, dict) else None


def _death_cause(code: int, stopped: bool) -> "tuple[str, str, str]":
    """Name, exit status and message for a kernel that went away mid-cell."""
    lost = "it was restarted and its variables were lost"
    if stopped:
        return "KernelDiedError", "died", "the context was restarted or removed while the cell ran"
    if code == -signal.SIGKILL:
        return (
            "OutOfMemoryError",
            "oom",
            "the kernel was killed (SIGKILL), most likely for using too much memory; " + lost,
        )
    if code == -signal.SIGXCPU:
        return "TimeoutError", "timeout", "the kernel used up its CPU time limit; " + lost
    return "KernelDiedError", "died", "the kernel exited (status %s); %s" % (code, lost)


def become_kernel(sock_fd: int, out_w: int, err_w: int, cwd: str, argv: List[str]) -> None:
    """In a freshly forked child: set up the process like a spawned kernel (``argv`` is
    the command line it would have been started with), run it, exit."""
    code = 70
    args = argv[5:]  # after: python -I -c BOOTSTRAP <lib>
    try:
        set_cmdline(argv[:-2])  # without "--config <json>", which rarely fits
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        close_all_but({0, 1, 2, sock_fd})
        os.set_inheritable(sock_fd, False)
        os.chdir(cwd)
        # What a new interpreter would have: SIGPIPE ignored (Python's default), every
        # other handler the default; the kernel installs its own SIGINT handler.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        sys.argv = ["-c", *args]
        # Fresh randomness: forked interpreters would otherwise share numpy's global
        # generator state (``random`` re-seeds itself after a fork). A full MT19937
        # state (624 words) straight from os.urandom, through ``set_state``: in a fresh
        # fork, ``seed()`` (128 bits through a SeedSequence) and ``seed(array)`` (checked
        # with ufuncs) each touch 130-180 pages of the zygote's memory (a copy-on-write
        # fault each) and cost ~0.5 ms; this touches ~55. Position 624: the next draw
        # regenerates the whole state; no cached Gaussian.
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            key = array.array("I", os.urandom(4 * 624))
            numpy_random.set_state(("MT19937", key, 624, 0, 0.0))
        tempfile = sys.modules.get("tempfile")
        if tempfile is not None:
            tempfile._name_sequence = None  # type: ignore[attr-defined]
        from sandlot.runner._kernel import main as kernel_main

        code = kernel_main(args[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
