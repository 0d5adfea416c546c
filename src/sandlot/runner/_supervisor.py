"""The supervisor: the sandbox's side of the host channel.

Started by the backend as the first process in the sandbox (under bwrap's pid 1).
It owns the protocol socket to the host (fd 3) and:

* applies the resource limits to itself before anything else (every process in the
  sandbox inherits them) and refuses to start if one cannot be applied;
* keeps one kernel process per code context and forwards ``execute`` requests;
* enforces each cell's wall-clock timeout: SIGINT to the kernel and SIGKILL to every
  process the cell started; if the kernel does not stop within the grace period it is
  killed and restarted (variables lost, files kept);
* caps output per cell and results per cell, with a visible marker;
* runs ``commands.run`` and the ``files.*`` operations. These run inside the sandbox,
  so a path or symlink can only ever reach what the sandbox itself can see.

It is a child subreaper: processes orphaned by user code (double fork, setsid)
re-parent here, where a timeout or a restart finds and kills them.

The parts: this module speaks the host channel and dispatches requests;
``_contexts`` runs the code contexts (their kernel processes), ``_processes`` keeps
the process table (kernels, commands, strays), ``_files`` does ``files.*``.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import functools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from sandlot.protocol import (
    CHUNK_BYTES,
    DEFAULT_BASH_CONTEXT,
    FATAL_LIMITS,
    HOST_REQUESTS,
    KERNEL_LANGUAGES,
    PROTOCOL_VERSION,
    ProtocolViolation,
    decode,
    encode,
)
from sandlot.protocol.layout import HOME, LIB_GUEST, TEMPLATE_SHARE
from sandlot.runner import BOOTSTRAP, _limits
from sandlot.runner._background import Background
from sandlot.runner._contexts import Deadlines, KernelProcess, OutputBudget, Prestarted
from sandlot.runner._files import Files, FilesError
from sandlot.runner._processes import Forked, Processes
from sandlot.runner._processes import libc as _shared_libc
from sandlot.runner._watch import Watches

BATCH_BYTES = 64 * 1024
"""A batch of messages (:meth:`Supervisor.batched`) is written out once this big."""
PIPE_GRACE = 0.5
"""Seconds a command's pipes may stay open after it exits (held by a daemonised
grandchild) before its exit is reported without them."""
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4


class StdioChannel:
    """The host channel on stdin (requests) and stdout (events), for container engines.

    A container's only link to its host that needs no host mount and no network is
    the engine's attach stream, which arrives on pid 1's stdin/stdout. User code never
    sees these descriptors: kernels and commands get their own pipes.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        # Engines may hand these over non-blocking; a full pipe would then fail a
        # large write with EAGAIN, which send() takes for "the host is gone".
        os.set_blocking(read_fd, True)
        os.set_blocking(write_fd, True)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def makefile(self, mode: str) -> Any:
        return os.fdopen(self.read_fd, mode, closefd=False)


class Supervisor:
    def __init__(
        self, sock: "socket.socket | StdioChannel", reader: Any, config: Dict[str, Any]
    ) -> None:
        self.sock = sock
        self.reader = reader
        self.config = config
        self.send_lock = threading.Lock()
        self.batches = threading.local()
        self.processes = Processes()
        self.kernels: Dict[str, KernelProcess] = {}
        self.workdir = str(config.get("workdir", HOME))
        self.output_bytes = config.get("output_bytes")
        self.max_results = config.get("max_results")
        self.result_bytes = config.get("result_bytes")
        self.grace = float(config.get("kill_grace", 1.0))
        self.lib = str(config.get("lib", LIB_GUEST))
        self.fork_next_kernel = False
        """Fork the next kernel from this process (set once, by a zygote-made sandbox)."""
        self.prestarted: "Optional[Prestarted]" = None
        """A kernel started before this supervisor (a restored microVM's), for the
        first kernel launched."""
        self.files = Files(self.workdir)
        self.workers = Workers()
        self.deadlines = Deadlines(self.workers.submit)
        self.background = Background(self)
        self.watches = Watches(self)

    # --- host channel -----------------------------------------------------------------
    def send(self, message: Dict[str, Any]) -> None:
        self.send_line(encode(message))

    def send_line(self, data: bytes) -> None:
        """Send one message already encoded (a whole line, newline included)."""
        batch: Optional[List[bytes]] = getattr(self.batches, "parts", None)
        if batch is None:
            self.write(data)
            return
        batch.append(data)
        self.batches.size += len(data)
        if self.batches.size >= BATCH_BYTES:
            self.write(b"".join(batch))
            batch.clear()
            self.batches.size = 0

    def write(self, data: bytes) -> None:
        with self.send_lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                sys.stderr.write("sandlot runner: host channel closed: %r\n" % (exc,))
                os._exit(0)  # the host is gone; so is the sandbox

    def batched(self) -> "Batch":
        """Messages this thread sends inside the block go to the host in one write at
        its end (or every :data:`BATCH_BYTES`): a kernel's result and exit, read
        together, then wake the host once. Other threads' messages are not held.
        The block may be entered again (and nested); a kernel's listener keeps one."""
        return Batch(self)

    def reply(self, rid: str, value: Any = None) -> None:
        self.send({"type": "reply", "id": rid, "ok": True, "value": value})

    def changed(self, rid: str, value: Any = None) -> None:
        """:meth:`reply` to a files operation that changed something, once every watch
        has forwarded what it saw of the change (so the caller finds it there)."""
        self.watches.settle()
        self.reply(rid, value)

    def fail(self, rid: str, name: str, message: str) -> None:
        self.send(
            {"type": "reply", "id": rid, "ok": False, "error": {"name": name, "message": message}}
        )

    def serve(self) -> None:
        reader = self.reader
        self.send(ready_message())
        while True:
            line = reader.readline()
            if not line:
                break
            try:
                request = decode(line, HOST_REQUESTS)
            except ProtocolViolation as exc:
                sys.stderr.write("sandlot runner: bad request: %s\n" % exc)
                continue
            kind = request["type"]
            if kind == "shutdown":
                break
            if kind == "checkpoint":
                if not self.checkpoint(request["id"]):
                    break
                continue
            if kind == "execute":
                task = self.start_cell(request, line)
                if task is None:
                    continue  # with its kernel already
            else:
                task = functools.partial(self.dispatch, request)
            try:
                self.workers.submit(task)
            except RuntimeError:
                # No thread to be had: user code used up the pids limit (a thread bomb).
                # Serve this request here rather than die; restarting the context frees it.
                task()
        self.shutdown()

    def checkpoint(self, rid: str) -> bool:
        """Get ready to be checkpointed: answer, let go of the host's channel (a socket
        of the host's network namespace, which CRIU cannot take), wait to be restored.

        The host's end is replaced, under the same descriptor number, by a stream socket
        that is not connected (not a datagram socket: CRIU would wait for a sender to
        refill its queue; not a pipe: CRIU reopens an inherited pipe, which a socket
        cannot be); this thread checks every 2 ms whether that number holds a
        connected socket again, which it does only in the restored sandbox: CRIU hands
        the host's new channel in for the placeholder. Its first line is "resumed".
        The send lock is held throughout, so no other thread writes to the placeholder
        (that would fail, and a failed write ends the sandbox); they wait and send on
        the new channel. Returns False if the channel
        closed instead (the host gave up: end)."""
        if not isinstance(self.sock, socket.socket):
            self.fail(rid, "CheckpointError", "this sandbox's channel cannot be checkpointed")
            return True
        fd = self.sock.fileno()
        with self.send_lock:
            # The placeholder goes in first and the answer goes out on a copy of the
            # channel afterwards: once the host has the answer, the descriptor it reads
            # (to name the channel for the restore) and CRIU dumps is the placeholder.
            # Answered first, a slow runner could still hold the channel there: the
            # dump failed, or named the wrong socket and the restored copy had none.
            channel = socket.socket(fileno=os.dup(fd))
            placeholder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            os.dup2(placeholder.fileno(), fd)
            placeholder.close()
            try:
                channel.settimeout(None)
                channel.sendall(encode({"type": "reply", "id": rid, "ok": True, "value": None}))
            finally:
                channel.close()
            while not _connected(self.sock):
                time.sleep(0.002)
            line = self.reader.readline()
            if not line:
                return False
            resumed = expect(
                line, "resumed", "bad request after restore", "expected resumed after a checkpoint"
            )
            if resumed is None:
                return False
            self.sock.sendall(encode(ready_message()))
        return True

    def start_cell(self, request: Dict[str, Any], line: bytes) -> Optional[Callable[[], None]]:
        """Hand a cell to an idle kernel right here, on the thread that read it: no
        worker wakes between the host's request and the kernel. ``line``: the request
        as it came (checked by ``decode``), which the kernel is sent as it is. Returns
        what is left for a worker: nothing; the rest of a message the kernel did not
        take; or, when the cell must wait (or needs a kernel started), its
        :meth:`dispatch`."""
        kernel = self.kernels.get(request["context"])
        whole = line if line.endswith(b"\n") else None  # (the channel's last, cut line)
        cell = None if kernel is None else kernel.try_begin(request, whole)
        if kernel is None or cell is None:
            return functools.partial(self.dispatch, request)
        return functools.partial(kernel.send_rest, cell) if cell.unsent else None

    def dispatch(self, request: Dict[str, Any]) -> None:
        kind = request["type"]
        rid = request["id"]
        try:
            handler: Callable[[Dict[str, Any]], None] = getattr(self, "on_" + kind)
            handler(request)
        except FilesError as exc:
            self.fail(rid, exc.name, str(exc))
        except FileNotFoundError as exc:
            self.fail(rid, "NotFoundError", _os_message(exc))
        except OSError as exc:
            self.fail(rid, "FileOperationError", _os_message(exc))
        except Exception as exc:  # never leave the host waiting for a terminal event
            if kind in ("execute", "command"):
                self.send(
                    {
                        "type": "error",
                        "id": rid,
                        "name": "RunnerError",
                        "value": repr(exc),
                        "traceback": "",
                    }
                )
                self.send({"type": "exit", "id": rid, "status": "died"})
            else:
                self.fail(rid, "RunnerError", repr(exc))

    def shutdown(self) -> None:
        self.background.kill_all()
        for kernel in list(self.kernels.values()):
            kernel.stop()
        self.processes.kill_strays()
        os._exit(0)

    def take_fork(self) -> bool:
        """Whether to fork the kernel being launched: once, and only while this process
        has no other thread (a thread holding a lock at fork time would leave the
        child's copy of that lock held forever)."""
        fork, self.fork_next_kernel = self.fork_next_kernel, False
        return fork and threading.active_count() == 1

    def take_prestarted(self) -> "Optional[Prestarted]":
        """The kernel started ahead of this supervisor, once; it becomes one of this
        supervisor's children like any kernel it forked."""
        start, self.prestarted = self.prestarted, None
        if start is None:
            return None

        def adopt(cwd: str, config: Dict[str, Any]) -> "Tuple[Forked, socket.socket, int, int]":
            assert start is not None
            kernel = start(cwd, config)
            with self.processes.spawn_lock:
                self.processes.known.add(kernel[0].pid)
            return kernel

        return adopt

    def resolve(self, path: str) -> str:
        """A context's or command's working directory, relative to the workdir."""
        return os.path.normpath(os.path.join(self.workdir, path))

    # --- contexts ---------------------------------------------------------------------
    def start_kernel(self, context_id: str, cwd: str, language: str = "python") -> "KernelProcess":
        kernel = KernelProcess(self, context_id, cwd, language)
        self.kernels[context_id] = kernel
        return kernel

    def on_create_context(self, request: Dict[str, Any]) -> None:
        language = request["language"] or "python"
        if language not in KERNEL_LANGUAGES:
            self.fail(request["id"], "InvalidArgumentError", "unsupported language %r" % language)
            return
        cwd = self.resolve(request["cwd"] or self.workdir)
        if not os.path.isdir(cwd):
            self.fail(request["id"], "NotFoundError", "cwd %s is not a directory" % cwd)
            return
        context_id = uuid.uuid4().hex[:12]
        kernel = self.start_kernel(context_id, cwd, language)
        self.reply(request["id"], kernel.describe())

    def on_list_contexts(self, request: Dict[str, Any]) -> None:
        self.reply(request["id"], [k.describe() for k in self.kernels.values()])

    def _kernel_or_fail(self, request: Dict[str, Any]) -> Optional["KernelProcess"]:
        kernel = self.kernels.get(request["context"])
        if kernel is None:
            self.fail(
                request["id"], "ContextNotFoundError", "no code context %r" % request["context"]
            )
        return kernel

    def on_restart_context(self, request: Dict[str, Any]) -> None:
        kernel = self._kernel_or_fail(request)
        if kernel is not None:
            kernel.restart()
            self.reply(request["id"], kernel.describe())

    def on_remove_context(self, request: Dict[str, Any]) -> None:
        kernel = self._kernel_or_fail(request)
        if kernel is not None:
            self.kernels.pop(kernel.context_id, None)
            kernel.stop()
            self.reply(request["id"])

    def on_interrupt(self, request: Dict[str, Any]) -> None:
        kernel = self._kernel_or_fail(request)
        if kernel is not None:
            kernel.interrupt()
            self.reply(request["id"])

    def on_execute(self, request: Dict[str, Any]) -> None:
        kernel = self.kernels.get(request["context"])
        if kernel is None and request["context"] == DEFAULT_BASH_CONTEXT:
            kernel = self.start_kernel(DEFAULT_BASH_CONTEXT, self.workdir, "bash")
        if kernel is None:
            rid = request["id"]
            message = "no code context %r" % request["context"]
            self.send(
                {
                    "type": "error",
                    "id": rid,
                    "name": "ContextNotFoundError",
                    "value": message,
                    "traceback": "",
                }
            )
            self.send({"type": "exit", "id": rid, "status": "error"})
            return
        kernel.execute(request)

    # --- commands ---------------------------------------------------------------------
    def on_command(self, request: Dict[str, Any]) -> None:
        rid = request["id"]
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in request["envs"].items()})
        cwd = self.resolve(request["cwd"] or self.workdir)
        budget = OutputBudget(self, rid)
        try:
            limits = json.dumps(self.config.get("rlimits") or {})
            proc = self.processes.spawn(
                [
                    sys.executable,
                    "-I",
                    "-c",
                    BOOTSTRAP,
                    self.lib,
                    "exec",
                    "--limits",
                    limits,
                    "--",
                    "/bin/sh",
                    "-c",
                    request["cmd"],
                ],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            reason = _os_message(exc)
            if isinstance(exc, BlockingIOError):  # EAGAIN from fork: no process to be had
                reason = (
                    "the sandbox's process limit (resources.pids) is used up; kill "
                    "processes (or restart the context that started them) and retry"
                )
            budget.text("stderr", "sandlot: could not start the command: %s\n" % reason)
            self.send({"type": "exit", "id": rid, "status": "error", "exit_code": 127})
            return
        try:
            code, status = self.collect(proc, budget, float(request["timeout"]))
        finally:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self.processes.forget(proc.pid)
        if status == "ok" and code != 0:
            status = "error"
        message: Dict[str, Any] = {"type": "exit", "id": rid, "status": status, "exit_code": code}
        if budget.truncated:
            message["truncated"] = True
        self.send(message)

    def collect(
        self, proc: "subprocess.Popen[bytes]", budget: OutputBudget, timeout: float
    ) -> Tuple[int, str]:
        """Forward a command's stdout and stderr until it exits; (exit code, status).

        Read here, on the request's own thread, not by pump threads: with the pids
        limit used up (a fork bomb, or one just killed whose zombies still count) a
        thread may fail to start after the command did, and its output would be lost;
        and a pump thread starved past its join left the output behind the exit event.
        What the command wrote before it exited is in its pipes, so it is read before
        the exit is sent. A daemonised grandchild that keeps the pipes open gets
        :data:`PIPE_GRACE` seconds after the command exits, as before."""
        assert proc.stdout is not None and proc.stderr is not None
        kinds = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in kinds}
        poller = select.poll()  # not select(): descriptors may be past its 1024
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout
        code: Optional[int] = None
        status = "ok"
        ended = 0.0
        try:
            while kinds:
                now = time.monotonic()
                if code is None:
                    code = proc.poll()
                    ended = now
                if code is None and now >= deadline:
                    self.processes.kill_tree(proc.pid, include_root=True)
                    proc.wait()
                    code, status, ended = -1, "timeout", now
                if code is None:
                    # Without a pidfd (old kernel or Python), look at the process often.
                    wait = deadline - now if pidfd is not None else min(deadline - now, 0.05)
                else:
                    wait = ended + PIPE_GRACE - now
                    if wait <= 0:
                        break  # a grandchild holds the pipes open
                for fd, _ in poller.poll(int(min(wait, 3600.0) * 1000) + 1):  # a C int
                    if fd == pidfd:
                        poller.unregister(fd)  # exited: proc.poll() reaps it next
                        continue
                    data = os.read(fd, 65536)
                    text = decoders[fd].decode(data, final=not data)
                    if text:
                        budget.text(kinds[fd], text)
                    if not data:
                        poller.unregister(fd)
                        del kinds[fd]
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if code is None:  # both pipes closed, the command still runs
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.processes.kill_tree(proc.pid, include_root=True)
                proc.wait()
                code, status = -1, "timeout"
        return code, status

    # --- background processes and terminals (_background.py) ---------------------------
    def on_process_start(self, request: Dict[str, Any]) -> None:
        self.background.start(request)

    def on_process_connect(self, request: Dict[str, Any]) -> None:
        self.background.connect(request)

    def on_process_detach(self, request: Dict[str, Any]) -> None:
        self.background.detach(request)

    def on_process_list(self, request: Dict[str, Any]) -> None:
        self.background.list(request)

    def on_process_kill(self, request: Dict[str, Any]) -> None:
        self.background.kill(request)

    def on_process_stdin(self, request: Dict[str, Any]) -> None:
        self.background.stdin(request)

    def on_process_close_stdin(self, request: Dict[str, Any]) -> None:
        self.background.close_stdin(request)

    def on_pty_resize(self, request: Dict[str, Any]) -> None:
        self.background.resize(request)

    # --- files ------------------------------------------------------------------------
    # The operations themselves are in _files.py; these handlers only speak the protocol.
    def on_fs_read(self, request: Dict[str, Any]) -> None:
        rid = request["id"]
        fd, _ = self.files.open_read(request["path"])
        size = 0
        with os.fdopen(fd, "rb") as handle:
            while True:
                chunk = handle.read(CHUNK_BYTES)
                if not chunk:
                    break
                size += len(chunk)
                self.send(
                    {"type": "data", "id": rid, "data": base64.b64encode(chunk).decode("ascii")}
                )
        self.reply(rid, {"size": size})

    def on_fs_write(self, request: Dict[str, Any]) -> None:
        try:
            data = base64.b64decode(request["data"], validate=True)
        except ValueError:
            self.fail(request["id"], "InvalidArgumentError", "fs_write data is not base64")
            return
        limit = request.get("max_bytes")
        written = self.files.write(
            request["path"],
            data,
            request["append"],
            limit if isinstance(limit, int) else None,
            request.get("metadata"),  # checked by files.write
        )
        self.changed(request["id"], written)

    def on_fs_list(self, request: Dict[str, Any]) -> None:
        self.reply(request["id"], self.files.list(request["path"], int(request["depth"])))

    def on_fs_stat(self, request: Dict[str, Any]) -> None:
        self.reply(request["id"], self.files.stat(request["path"]))

    def on_fs_remove(self, request: Dict[str, Any]) -> None:
        self.files.remove(request["path"])
        self.changed(request["id"])

    def on_fs_mkdir(self, request: Dict[str, Any]) -> None:
        self.changed(request["id"], self.files.make_dir(request["path"]))

    def on_fs_rename(self, request: Dict[str, Any]) -> None:
        self.changed(request["id"], self.files.rename(request["src"], request["dst"]))

    def on_fs_watch(self, request: Dict[str, Any]) -> None:
        self.watches.start(request)

    def on_fs_watch_stop(self, request: Dict[str, Any]) -> None:
        self.watches.stop(request)


class Batch:
    """The context manager of :meth:`Supervisor.batched` (a class: a generator-based
    one cost microseconds of every kernel event)."""

    __slots__ = ("supervisor",)

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def __enter__(self) -> None:
        local = self.supervisor.batches
        if getattr(local, "parts", None) is None:
            local.parts, local.size, local.depth = [], 0, 1
        else:
            local.depth += 1  # nested: the outermost block writes

    def __exit__(self, *exc: Any) -> None:
        local = self.supervisor.batches
        local.depth -= 1
        if local.depth == 0:
            parts, local.parts = local.parts, None
            if parts:
                self.supervisor.write(b"".join(parts))


class Workers:
    """Threads that serve requests (a task each: a request's handler, or the watch of
    a cell already started), each on its own thread as before, but reused: a task
    goes to an idle worker if there is one, else to a new thread. Starting a thread
    per request cost about a tenth of a millisecond of every cell's round trip. Idle
    workers exit after a minute."""

    IDLE = 60.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = 0
        self.tasks: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()

    def submit(self, task: Callable[[], None]) -> None:
        """Hand ``task`` to a worker; RuntimeError if no thread can be started."""
        with self.lock:
            if self.idle > 0:
                self.idle -= 1
                self.tasks.put(task)
                return
        threading.Thread(target=self.work, args=(task,), daemon=True).start()

    def work(self, task: Callable[[], None]) -> None:
        while True:
            task()
            with self.lock:
                self.idle += 1
            try:
                task = self.tasks.get(timeout=self.IDLE)
            except queue.Empty:
                with self.lock:
                    # A task may have been promised to us just as we timed out.
                    try:
                        task = self.tasks.get_nowait()
                    except queue.Empty:
                        self.idle -= 1
                        return


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when ``pid`` exits, or None where the
    kernel or the template's Python has no ``pidfd_open``."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:
        return None
    return fd


def _os_message(exc: OSError) -> str:
    if exc.filename:
        return "%s: %s" % (exc.strerror or exc, exc.filename)
    return str(exc.strerror or exc)


def _prepare_home(home: str, files: "Optional[List[Tuple[str, bytes]]]" = None) -> None:
    """Give the sandbox user the template's matplotlib settings and warm font cache
    (``files``: :func:`home_files`, read before; else they are read now)."""
    for relative, data in home_files() if files is None else files:
        target = os.path.join(home, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def home_files() -> List[Tuple[str, bytes]]:
    """The template's matplotlib files a new home gets: (path under the home, contents).
    A zygote reads them once; each sandbox's pid 1 then only writes them (reading and
    copying them with shutil cost every forked sandbox ~0.5 ms)."""
    source = os.path.join(TEMPLATE_SHARE, "matplotlib")
    if not os.path.isdir(source):
        return []
    wanted: List[Tuple[str, str]] = []
    rc = os.path.join(source, "matplotlibrc")
    if os.path.exists(rc):
        wanted.append((os.path.join(".config", "matplotlib", "matplotlibrc"), rc))
    cache = os.path.join(source, "cache")
    if os.path.isdir(cache):
        for name in sorted(os.listdir(cache)):
            if name.endswith(".json"):
                wanted.append(
                    (os.path.join(".cache", "matplotlib", name), os.path.join(cache, name))
                )
    files: List[Tuple[str, bytes]] = []
    for relative, path in wanted:
        with open(path, "rb") as handle:
            files.append((relative, handle.read()))
    return files


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


def main(argv: List[str]) -> int:
    sock: "socket.socket | StdioChannel"
    if "--stdio" in argv:
        sock = StdioChannel(0, 1)
    else:
        sock = socket.socket(fileno=int(argv[argv.index("--fd") + 1]))
    # The configuration comes over the channel, not argv: argv is readable by every
    # process in the sandbox (/proc/1/cmdline) and on the host (ps).
    reader = sock.makefile("rb")
    config = read_configuration(reader)
    if config is None:
        return 70
    return run(sock, reader, config)


def fatal(sock: "socket.socket | StdioChannel", reason: str, message: str) -> None:
    """Tell the host, instead of ``ready``, why this sandbox cannot start (a ``fatal``
    event); the caller exits next. The same line goes to stderr for whoever reads it."""
    sys.stderr.write("sandlot runner: %s\n" % message)
    with contextlib.suppress(OSError):  # the host is gone: nobody to tell
        sock.sendall(encode({"type": "fatal", "reason": reason, "message": message}))


def read_configuration(reader: Any) -> Optional[Dict[str, Any]]:
    """The host's first message, ``configure``; None (reason on stderr) if it is not."""
    first = expect(
        reader.readline(), "configure", "bad configuration", "expected a configure message first"
    )
    if first is None:
        return None
    config: Dict[str, Any] = first["config"]
    return config


def expect(line: bytes, kind: str, bad: str, other: str) -> Optional[Dict[str, Any]]:
    """``line`` as a host request of type ``kind``; None, saying ``bad`` (with why) or
    ``other`` on stderr, if it is not one."""
    try:
        message = decode(line, HOST_REQUESTS)
    except ProtocolViolation as exc:
        sys.stderr.write("sandlot runner: %s: %s\n" % (bad, exc))
        return None
    if message["type"] != kind:
        sys.stderr.write("sandlot runner: %s\n" % other)
        return None
    return message


def ready_message() -> Dict[str, Any]:
    """What the runner says when it takes requests: at start, and once restored."""
    return {"type": "ready", "version": PROTOCOL_VERSION, "python": sys.version.split()[0]}


def run(
    sock: "socket.socket | StdioChannel",
    reader: Any,
    config: Dict[str, Any],
    fork_kernel: bool = False,
    home_ready: Optional[str] = None,
    prestarted: "Optional[Prestarted]" = None,
) -> int:
    """Serve the host channel as the sandbox's supervisor until it closes.

    ``fork_kernel``: this process already holds the template's preloaded modules (a
    zygote-made sandbox), so the default kernel is forked from it instead of started
    as a new interpreter that would import them again. ``home_ready``: a home the
    caller has already given the template's matplotlib files (not copied again).
    ``prestarted``: the default kernel is already running and waits for its
    configuration (a restored microVM's)."""
    libc = _shared_libc()
    # Not dumpable: user code (same uid, no capabilities) can then neither ptrace this
    # process nor open its /proc/<pid>/fd, mem or environ, nor take its host socket
    # with pidfd_getfd. Kernels and commands are exec'ed (or, forked, made dumpable)
    # again; they are user code's side anyway. No user code runs before this point.
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.stderr.write("sandlot runner: cannot make the supervisor non-dumpable\n")
        return 70
    try:
        _limits.check(config.get("rlimits") or {})
    except (OSError, ValueError) as exc:
        # Fail closed: no "ready"; the host refuses the sandbox for this typed reason.
        fatal(sock, FATAL_LIMITS, "cannot apply resource limits: %s" % exc)
        return 70
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write("sandlot runner: cannot become a child subreaper\n")
        return 70
    if config.get("checkpointable") and isinstance(sock, socket.socket):
        # Standard input and output are the host's /dev/null, a file CRIU cannot find in
        # the sandbox's mounts: the sandbox's own instead (kernels inherit it). bwrap
        # leaves the user namespace descriptor it joined open: close every descriptor
        # but the channel and stderr (nothing else of the host's belongs here).
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        os.closerange(3, sock.fileno())
        os.closerange(sock.fileno() + 1, 65536)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Python's own SIGINT handler (KeyboardInterrupt) would let user code kill pid 1
    # with `kill -INT 1`: the kernel drops a signal from inside the pid namespace only
    # when init leaves it at SIG_DFL. Children inherit SIG_DFL too (kernels set their own).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.update({str(k): str(v) for k, v in (config.get("envs") or {}).items()})
    if config.get("egress"):
        # The sandbox's only way out (network policy): a relay to the host's proxy.
        from sandlot.runner import _egress

        try:
            _egress.start(config["egress"])
        except (OSError, KeyError, ValueError) as exc:
            sys.stderr.write("sandlot runner: cannot start the egress forwarder: %s\n" % exc)
            return 70
    home = str(config.get("workdir", HOME))
    try:
        if home != home_ready:
            _prepare_home(home)
    except OSError as exc:
        sys.stderr.write("sandlot runner: could not copy matplotlib settings: %s\n" % exc)
    supervisor = Supervisor(sock, reader, config)
    supervisor.fork_next_kernel = fork_kernel
    supervisor.prestarted = prestarted
    default = supervisor.start_kernel("default", home)
    if config.get("preload"):
        # "ready" then means the modules are imported (what a warm pool waits for). A
        # kernel that dies meanwhile ends the wait (its listener restarts it); a hung
        # import is bounded by the host's start timeout.
        kernel_proc = default.proc
        while not default.preloaded.wait(0.1):
            if kernel_proc is None or kernel_proc.poll() is not None:
                break
    threading.Thread(target=supervisor.processes.reaper_loop, daemon=True).start()
    supervisor.deadlines.start()
    supervisor.serve()
    return 0
