"""Background processes and terminals: ``commands.run(background=True)`` and ``pty``.

A background process outlives the request that started it. The supervisor keeps it
in a table (pid -> :class:`Tracked`) until it exits; any number of host requests may
*subscribe* to its output (``process_start`` subscribes the starter,
``process_connect`` a later one) and leave again (``process_detach``) without
touching the process.

Bounds, all per sandbox or per process:

* at most ``max_processes`` live background processes and terminals (the sandbox's
  ``background_processes`` resource); the next start is refused with
  ``ProcessLimitError``;
* output forwarded per process is capped at ``output_bytes``, as for a cell (a
  marker says so; the pipe keeps being drained so the process never blocks);
* the output kept for a later ``process_connect`` is a ring of the last
  :data:`RING_BYTES` bytes: a subscriber that comes late gets what the ring still
  holds, then the live output.

Every process starts in a session (and process group) of its own through the
``exec`` role, which applies the sandbox's rlimits; a kill stops and kills the whole
group and every descendant. All of it is inside the sandbox: its pid namespace and
cgroup end with it.
"""

from __future__ import annotations

import base64
import codecs
import collections
import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Protocol, Tuple

from sandlot.protocol.layout import HOME
from sandlot.runner import BOOTSTRAP
from sandlot.runner._processes import Processes, descendants, process_table, signal_all

RING_BYTES = 1024 * 1024
"""Output kept per process for subscribers that connect later (the newest bytes)."""
STDIN_WAIT = 10.0
"""Seconds a write to a process's stdin may wait for the process to read."""
SUBSCRIBERS = 8
"""Streams one process may have at once (``process_start`` and ``process_connect``):
each costs the host a stream, and a server a thread."""
KILL_WAIT = 5.0
"""Seconds ``process_kill`` waits for the killed process to be reaped."""


class Host(Protocol):
    """What this module needs of the supervisor."""

    processes: Processes
    config: Dict[str, Any]
    output_bytes: Optional[int]
    lib: str

    def send(self, message: Dict[str, Any]) -> None: ...

    def reply(self, rid: str, value: Any = None) -> None: ...

    def fail(self, rid: str, name: str, message: str) -> None: ...

    def resolve(self, path: str) -> str: ...


class Tracked:
    """One background process (or terminal): its output ring and its subscribers."""

    def __init__(
        self,
        table: "Background",
        proc: "subprocess.Popen[bytes]",
        info: Dict[str, Any],
        stdin: Optional[int],
        pty: bool,
    ) -> None:
        self.table = table
        self.proc = proc
        self.pid = proc.pid
        self.info = info
        self.stdin = stdin
        """A descriptor to write the process's input to (the terminal for a pty)."""
        self.pty = pty
        self.lock = threading.Lock()
        """Guards the output ring, subscribers and exit."""
        self.stdin_lock = threading.Lock()
        """Guards ``stdin``. Separate from ``lock``: a write waiting for the process to
        read must not hold up its output (a ``cat`` stops reading while its stdout is
        full)."""
        self.ring: Deque[Tuple[Dict[str, Any], int]] = collections.deque()
        self.ring_size = 0
        self.used = 0
        self.cut = False
        self.subscribers: List[str] = []
        self.exit: Optional[Dict[str, Any]] = None
        self.finished = threading.Event()

    # --- output -----------------------------------------------------------------------
    def output(self, kind: str, data: bytes, text: str) -> None:
        """Forward one chunk (``kind`` stdout, stderr or pty) within the output cap."""
        limit = self.table.host.output_bytes
        events: List[Tuple[Dict[str, Any], int]] = []
        with self.lock:
            if self.cut:
                return
            if limit is not None and self.used + len(data) > limit:
                room = max(0, limit - self.used)
                data = data[:room]
                text = data.decode("utf-8", "ignore")
                self.cut = True
            self.used += len(data)
            # (Text may be empty while data is not: a chunk that ends inside a character.)
            if data and (kind == "pty" or text):
                events.append((self._event(kind, data, text), len(data)))
            if self.cut:
                marker = "\n[sandlot: output truncated: more than %d bytes of stdout/stderr]\n" % (
                    limit or 0
                )
                note = "pty" if self.pty else "stderr"
                events.append((self._event(note, marker.encode(), marker), len(marker)))
            for event, size in events:
                self._keep(event, size)
                for rid in self.subscribers:
                    self.table.host.send(dict(event, id=rid))

    @staticmethod
    def _event(kind: str, data: bytes, text: str) -> Dict[str, Any]:
        if kind == "pty":
            return {"type": "data", "data": base64.b64encode(data).decode("ascii")}
        return {"type": kind, "text": text}

    def _keep(self, event: Dict[str, Any], size: int) -> None:
        self.ring.append((event, size))
        self.ring_size += size
        while self.ring_size > RING_BYTES and len(self.ring) > 1:
            _, dropped = self.ring.popleft()
            self.ring_size -= dropped

    # --- subscribers ------------------------------------------------------------------
    def subscribe(self, rid: str) -> None:
        """Send ``started``, replay the ring, then stream live output to ``rid``."""
        send = self.table.host.send
        with self.lock:
            if len(self.subscribers) >= SUBSCRIBERS:
                self.table.host.fail(
                    rid,
                    "ProcessLimitError",
                    "process %d already streams to %d connections; disconnect one first"
                    % (self.pid, SUBSCRIBERS),
                )
                return
            send({"type": "started", "id": rid, "pid": self.pid})
            for event, _ in self.ring:
                send(dict(event, id=rid))
            if self.exit is not None:
                send(dict(self.exit, id=rid))
            else:
                self.subscribers.append(rid)

    def detach(self, rid: str) -> bool:
        with self.lock:
            if rid in self.subscribers:
                self.subscribers.remove(rid)
                return True
            return False

    def finish(self, code: int, status: str) -> None:
        with self.lock:
            self.exit = {"type": "exit", "status": status, "exit_code": code}
            if self.cut:
                self.exit["truncated"] = True
            for rid in self.subscribers:
                self.table.host.send(dict(self.exit, id=rid))
            self.subscribers = []
        self.finished.set()

    # --- input ------------------------------------------------------------------------
    def write(self, data: bytes) -> Optional[str]:
        """Write ``data`` to the process's input; an error message, or None."""
        with self.stdin_lock:
            fd = self.stdin
            if fd is None:
                return "process %d has no open stdin (start it with stdin=True)" % self.pid
            deadline = time.monotonic() + STDIN_WAIT
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return "process %d is not reading its stdin (%d bytes not sent)" % (
                            self.pid,
                            len(view),
                        )
                    # poll(), not select(): the supervisor's descriptors may be past
                    # select()'s 1024 (a watch holds one per directory).
                    poller = select.poll()
                    poller.register(fd, select.POLLOUT)
                    poller.poll(int(left * 1000) + 1)
                except OSError as exc:
                    return "cannot write to process %d: %s" % (self.pid, exc.strerror or exc)
        return None

    def close_stdin(self) -> Optional[str]:
        with self.stdin_lock:
            if self.pty:
                return "a terminal has no stdin to close; send it EOF (Ctrl-D) instead"
            fd, self.stdin = self.stdin, None
        if fd is None:
            return "process %d has no open stdin (start it with stdin=True)" % self.pid
        with contextlib.suppress(OSError):
            os.close(fd)
        return None


class Background:
    """The table of live background processes of one sandbox."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.lock = threading.Lock()
        self.table: Dict[int, Tracked] = {}
        limit = host.config.get("max_processes")
        self.limit: Optional[int] = limit if isinstance(limit, int) else None

    def get(self, rid: str, pid: Any) -> Optional[Tracked]:
        with self.lock:
            tracked = self.table.get(pid) if isinstance(pid, int) else None
        if tracked is None:
            self.host.fail(rid, "ProcessNotFoundError", "no running process with pid %r" % (pid,))
        return tracked

    # --- start ------------------------------------------------------------------------
    def start(self, request: Dict[str, Any]) -> None:
        rid = request["id"]
        host = self.host
        envs = {str(k): str(v) for k, v in request["envs"].items()}
        env = dict(os.environ)
        env.update(envs)
        cwd = host.resolve(request["cwd"] or str(host.config.get("workdir", HOME)))
        if not os.path.isdir(cwd):
            host.fail(rid, "NotFoundError", "cwd %s is not a directory" % cwd)
            return
        size = request.get("pty")
        pty = isinstance(size, dict)
        if pty:
            env.setdefault("TERM", "xterm-256color")
            program = ["/bin/bash", "-i", "-l"]
            info_cmd, info_args = "/bin/bash", ["-i", "-l"]
        else:
            program = ["/bin/sh", "-c", request["cmd"]]
            info_cmd, info_args = "/bin/sh", ["-c", request["cmd"]]
        limits = json.dumps(host.config.get("rlimits") or {})
        argv = [sys.executable, "-I", "-c", BOOTSTRAP, host.lib, "exec", "--limits", limits]
        if pty:
            argv.append("--ctty")  # make the terminal the session's controlling tty
        argv += ["--", *program]
        with self.lock:
            if self.limit is not None and len(self.table) >= self.limit:
                host.fail(
                    rid,
                    "ProcessLimitError",
                    "this sandbox already runs %d background processes, its limit "
                    "(resources.background_processes); kill one first" % len(self.table),
                )
                return
            slave = -1
            try:
                if isinstance(size, dict):
                    master, slave = os.openpty()
                    _set_size(slave, size)
                    proc = host.processes.spawn(
                        argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave
                    )
                    stdin: Optional[int] = master
                else:
                    proc = host.processes.spawn(
                        argv,
                        cwd=cwd,
                        env=env,
                        stdin=subprocess.PIPE if request.get("stdin") else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                    )
                    stdin = None
                    if proc.stdin is not None:
                        # Keep our own descriptor: Popen's file object would buffer.
                        stdin = os.dup(proc.stdin.fileno())
                        proc.stdin.close()
            except OSError as exc:
                host.fail(rid, "CommandError", "could not start the process: %s" % exc)
                return
            finally:
                if slave >= 0:
                    os.close(slave)
            if stdin is not None:
                os.set_blocking(stdin, False)
            info = {
                "pid": proc.pid,
                "tag": request.get("tag") if isinstance(request.get("tag"), str) else None,
                "cmd": info_cmd,
                "args": info_args,
                "envs": envs,
                "cwd": cwd,
            }
            tracked = Tracked(self, proc, info, stdin, pty)
            self.table[proc.pid] = tracked
        tracked.subscribe(rid)
        if pty:
            assert stdin is not None
            pumps = [_thread(_pump_pty, stdin, tracked)]
        else:
            assert proc.stdout is not None and proc.stderr is not None
            pumps = [
                _thread(_pump, proc.stdout, tracked, "stdout"),
                _thread(_pump, proc.stderr, tracked, "stderr"),
            ]
        timeout = float(request["timeout"])
        _thread(self._wait, tracked, pumps, timeout if timeout > 0 else None)

    def _wait(
        self, tracked: Tracked, pumps: List[threading.Thread], timeout: Optional[float]
    ) -> None:
        status = "ok"
        try:
            code = tracked.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(tracked.pid)
            code = tracked.proc.wait()
            status = "timeout"
        # A daemonised grandchild may hold the pipes open; never wait on it for long.
        for thread in pumps:
            thread.join(timeout=0.5)
        with self.lock:
            self.table.pop(tracked.pid, None)
        self.host.processes.forget(tracked.pid)
        if status == "ok" and code != 0:
            status = "error"
        tracked.finish(code, status)
        with tracked.stdin_lock:
            fd, tracked.stdin = tracked.stdin, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- requests ---------------------------------------------------------------------
    def connect(self, request: Dict[str, Any]) -> None:
        tracked = self.get(request["id"], request["pid"])
        if tracked is not None:
            tracked.subscribe(request["id"])

    def detach(self, request: Dict[str, Any]) -> None:
        with self.lock:
            processes = list(self.table.values())
        for tracked in processes:
            if tracked.detach(request["target"]):
                break
        self.host.reply(request["id"])

    def list(self, request: Dict[str, Any]) -> None:
        with self.lock:
            self.host.reply(request["id"], [t.info for t in self.table.values()])

    def kill(self, request: Dict[str, Any]) -> None:
        with self.lock:
            tracked = self.table.get(request["pid"])
        if tracked is None:
            self.host.reply(request["id"], False)
            return
        kill_group(tracked.pid)
        # Answer once it is reaped: a list() right after must not show it.
        tracked.finished.wait(KILL_WAIT)
        # And once its group's zombies are: they hold the pids limit until then.
        self.host.processes.drain_group(tracked.pid)
        self.host.reply(request["id"], True)

    def stdin(self, request: Dict[str, Any]) -> None:
        tracked = self.get(request["id"], request["pid"])
        if tracked is None:
            return
        try:
            data = base64.b64decode(request["data"], validate=True)
        except ValueError:
            self.host.fail(request["id"], "InvalidArgumentError", "stdin data is not base64")
            return
        error = tracked.write(data)
        if error is None:
            self.host.reply(request["id"])
        else:
            self.host.fail(request["id"], "InvalidArgumentError", error)

    def close_stdin(self, request: Dict[str, Any]) -> None:
        tracked = self.get(request["id"], request["pid"])
        if tracked is None:
            return
        error = tracked.close_stdin()
        if error is None:
            self.host.reply(request["id"])
        else:
            self.host.fail(request["id"], "InvalidArgumentError", error)

    def resize(self, request: Dict[str, Any]) -> None:
        tracked = self.get(request["id"], request["pid"])
        if tracked is None:
            return
        with tracked.stdin_lock:
            fd = tracked.stdin if tracked.pty else None
            if fd is None:
                self.host.fail(
                    request["id"],
                    "InvalidArgumentError",
                    "process %d is not a terminal" % (tracked.pid),
                )
                return
            _set_size(fd, {"rows": request["rows"], "cols": request["cols"]})
        with contextlib.suppress(OSError):
            os.killpg(tracked.pid, signal.SIGWINCH)
        self.host.reply(request["id"])

    def kill_all(self) -> None:
        with self.lock:
            pids = list(self.table)
        for pid in pids:
            kill_group(pid)


def kill_group(pid: int) -> None:
    """Kill ``pid``, its process group and every descendant.

    Stopped before killed, repeatedly, so a fork bomb cannot outrun the scan; ends
    once nothing is left (the root, a zombie until its waiter reaps it, included)."""
    for _ in range(400):
        table = process_table()
        victims = descendants(pid, table)
        if pid in table:
            victims.append(pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGSTOP)
        signal_all(victims, signal.SIGSTOP)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        signal_all(victims, signal.SIGKILL)
        if not victims:
            return
        time.sleep(0.005)


def _set_size(fd: int, size: Dict[str, Any]) -> None:
    rows, cols = int(size.get("rows", 24)), int(size.get("cols", 80))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _thread(target: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _pump(stream: Any, tracked: Tracked, kind: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while True:
        chunk = stream.read1(65536)
        if not chunk:
            tail = decoder.decode(b"", final=True)
            if tail:
                tracked.output(kind, tail.encode(), tail)
            return
        # Whole characters only: a chunk may end inside one.
        tracked.output(kind, chunk, decoder.decode(chunk))


def _pump_pty(fd: int, tracked: Tracked) -> None:
    poller = select.poll()  # not select(): the descriptor may be past its 1024
    poller.register(fd, select.POLLIN)
    while True:
        try:
            poller.poll()
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        except OSError:  # EIO: every holder of the terminal's other side is gone
            return
        if not chunk:
            return
        tracked.output("pty", chunk, "")
