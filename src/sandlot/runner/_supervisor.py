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
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import queue
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from sandlot.protocol import (
    CHUNK_BYTES,
    HOST_REQUESTS,
    MAX_LINE_BYTES,
    NAME_MAX,
    PATH_MAX,
    PROTOCOL_VERSION,
    ProtocolViolation,
    decode,
    encode,
)
from sandlot.runner import BOOTSTRAP, _limits

PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
TEMPLATE_SHARE = "/opt/sandlot/template/share"


# --- processes ------------------------------------------------------------------------


def _process_table() -> Dict[int, int]:
    """pid -> ppid for every process this pid namespace shows."""
    table: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields follow the last ')'.
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            table[int(name)] = int(fields[1])
    return table


def _descendants(root: int, table: Dict[int, int]) -> List[int]:
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


def _signal_all(pids: List[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


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
        self.spawn_lock = threading.RLock()
        self.known: Set[int] = set()
        self.kernels: Dict[str, KernelProcess] = {}
        self.workdir = str(config.get("workdir", "/home/user"))
        self.output_bytes = config.get("output_bytes")
        self.max_results = config.get("max_results")
        self.result_bytes = config.get("result_bytes")
        self.grace = float(config.get("kill_grace", 1.0))
        self.lib = str(config.get("lib", "/opt/sandlot/lib"))
        self.fork_next_kernel = False
        """Fork the next kernel from this process (set once, by a zygote-made sandbox)."""
        self.workers = Workers(self.dispatch)

    # --- host channel -----------------------------------------------------------------
    def send(self, message: Dict[str, Any]) -> None:
        data = encode(message)
        with self.send_lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                sys.stderr.write("sandlot runner: host channel closed: %r\n" % (exc,))
                os._exit(0)  # the host is gone; so is the sandbox

    def reply(self, rid: str, value: Any = None) -> None:
        self.send({"type": "reply", "id": rid, "ok": True, "value": value})

    def fail(self, rid: str, name: str, message: str) -> None:
        self.send(
            {"type": "reply", "id": rid, "ok": False, "error": {"name": name, "message": message}}
        )

    def serve(self) -> None:
        reader = self.reader
        self.send({"type": "ready", "version": PROTOCOL_VERSION, "python": sys.version.split()[0]})
        while True:
            line = reader.readline()
            if not line:
                break
            try:
                request = decode(line, HOST_REQUESTS)
            except ProtocolViolation as exc:
                sys.stderr.write("sandlot runner: bad request: %s\n" % exc)
                continue
            if request["type"] == "shutdown":
                break
            try:
                self.workers.submit(request)
            except RuntimeError:
                # No thread to be had: user code used up the pids limit (a thread bomb).
                # Serve this request here rather than die; restarting the context frees it.
                self.dispatch(request)
        self.shutdown()

    def dispatch(self, request: Dict[str, Any]) -> None:
        kind = request["type"]
        rid = request["id"]
        try:
            handler: Callable[[Dict[str, Any]], None] = getattr(self, "on_" + kind)
            handler(request)
        except PathRefused as exc:
            self.fail(rid, "PathNotAllowedError", str(exc))
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
        for kernel in list(self.kernels.values()):
            kernel.stop()
        self.kill_strays()
        os._exit(0)

    # --- process management -----------------------------------------------------------
    def spawn(self, argv: List[str], **kwargs: Any) -> "subprocess.Popen[bytes]":
        # EAGAIN from fork is transient right after a fork bomb was killed: the pids
        # limit still counts its processes until they are reaped. Retry for ~2 s.
        for attempt in range(20):
            try:
                with self.spawn_lock:
                    proc = subprocess.Popen(
                        argv, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs
                    )
                    self.known.add(proc.pid)
                return proc
            except BlockingIOError:
                if attempt == 19:
                    raise
                self.reap_strays()
                time.sleep(0.1)
        raise AssertionError("unreachable")

    def take_fork(self) -> bool:
        """Whether to fork the kernel being launched: once, and only while this process
        has no other thread (a thread holding a lock at fork time would leave the
        child's copy of that lock held forever)."""
        fork, self.fork_next_kernel = self.fork_next_kernel, False
        return fork and threading.active_count() == 1

    def fork(self, sock_fd: int, out_w: int, err_w: int, cwd: str, argv: List[str]) -> "Forked":
        """Start a kernel as a fork of this process, with its modules already imported.

        The child gets exactly what a spawned kernel gets: its socket, the stdout and
        stderr pipes, /dev/null as stdin, a session of its own, the same cwd and
        environment, and no other descriptor (the host channel above all)."""
        with self.spawn_lock:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child never returns
                _become_kernel(sock_fd, out_w, err_w, cwd, argv)
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
            table = _process_table()
            victims = _descendants(root, table) + self.strays(table)
            if include_root and root in table:
                victims.append(root)
            if not victims:
                break
            _signal_all(victims, signal.SIGSTOP)
            _signal_all(victims, signal.SIGKILL)
            self.reap_strays()
            time.sleep(0.005)

    def kill_strays(self) -> None:
        for _ in range(200):
            victims = self.strays(_process_table())
            if not victims:
                return
            _signal_all(victims, signal.SIGKILL)
            self.reap_strays()
            time.sleep(0.005)

    def reap_strays(self) -> None:
        for pid in self.strays(_process_table()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def reaper_loop(self) -> None:
        while True:
            time.sleep(0.5)
            with contextlib.suppress(Exception):
                self.reap_strays()

    # --- contexts ---------------------------------------------------------------------
    def start_kernel(self, context_id: str, cwd: str, language: str = "python") -> "KernelProcess":
        kernel = KernelProcess(self, context_id, cwd, language)
        self.kernels[context_id] = kernel
        return kernel

    def on_create_context(self, request: Dict[str, Any]) -> None:
        if request["language"] not in ("python", ""):
            self.fail(
                request["id"],
                "InvalidArgumentError",
                "unsupported language %r" % request["language"],
            )
            return
        cwd = self.resolve(request["cwd"] or self.workdir)
        if not os.path.isdir(cwd):
            self.fail(request["id"], "NotFoundError", "cwd %s is not a directory" % cwd)
            return
        context_id = uuid.uuid4().hex[:12]
        kernel = self.start_kernel(context_id, cwd)
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
            proc = self.spawn(
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
            budget.text("stderr", "sandlot: could not start the command: %s\n" % _os_message(exc))
            self.send({"type": "exit", "id": rid, "status": "error", "exit_code": 127})
            return
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, budget, "stdout"), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, budget, "stderr"), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        status = "ok"
        try:
            code = proc.wait(timeout=float(request["timeout"]))
        except subprocess.TimeoutExpired:
            self.kill_tree(proc.pid, include_root=True)
            proc.wait()
            code = -1
            status = "timeout"
        # Pipes can stay open in a daemonised grandchild; never wait on them for long.
        for pump in pumps:
            pump.join(timeout=0.5)
        self.forget(proc.pid)
        if status == "ok" and code != 0:
            status = "error"
        message: Dict[str, Any] = {"type": "exit", "id": rid, "status": status, "exit_code": code}
        if budget.truncated:
            message["truncated"] = True
        self.send(message)

    # --- files ------------------------------------------------------------------------
    # The files API is confined to the workspace roots (the working directory and /tmp):
    # a path must name something there, and a symlink is followed only when what it
    # resolves to is there too. Writes never go through a symlink. Every open is checked
    # again on the descriptor itself (/proc/self/fd), so a link swapped in between the
    # check and the open (user code runs concurrently) is caught too. This matters
    # because the supervisor can read what user code cannot: its own /proc/1/* files.
    def resolve(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.workdir, path))

    @property
    def roots(self) -> Tuple[str, ...]:
        return (self.workdir, "/tmp")

    def confined(self, path: str) -> str:
        """The absolute, normalised path, or PathRefused when it is outside the roots."""
        _check_name(path)
        lexical = self.resolve(path)
        if lexical.startswith("//"):  # normpath keeps a leading "//"
            lexical = "/" + lexical.lstrip("/")
        if not _within(lexical, self.roots):
            raise PathRefused(
                "%s is outside the sandbox workspace (%s)" % (lexical, ", ".join(self.roots))
            )
        return lexical

    def with_real_parent(self, path: str) -> str:
        """The path with its directory's symlinks resolved; the last part is kept as is
        (stat, remove and rename act on a link itself). Refused outside the roots."""
        lexical = self.confined(path)
        if lexical in self.roots:
            return lexical
        parent = os.path.realpath(os.path.dirname(lexical))
        if not _within(parent, self.roots):
            raise PathRefused(
                "%s resolves outside the sandbox workspace (to %s) through a symlink"
                % (lexical, parent)
            )
        return os.path.join(parent, os.path.basename(lexical))

    def real(self, path: str) -> str:
        """The path with every symlink resolved; refused when that leaves the roots."""
        lexical = self.confined(path)
        target = os.path.realpath(lexical)
        if not _within(target, self.roots):
            raise PathRefused(
                "%s is a symlink (or under one) to %s, outside the sandbox workspace"
                % (lexical, target)
            )
        return target

    def check_fd(self, fd: int, shown: str) -> None:
        """Refuse (and close) a descriptor whose file is not where the checks said."""
        try:
            actual = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            actual = ""  # cannot tell: fail closed
        if not _within(actual, self.roots):
            os.close(fd)
            raise PathRefused("%s changed to point outside the sandbox workspace" % shown)

    def open_read(self, path: str) -> Tuple[int, str]:
        target = self.real(path)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathRefused("%s changed while it was opened" % target) from None
            raise
        self.check_fd(fd, target)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise IsADirectoryError(errno.EISDIR, "%s is %s" % (target, what))
        os.set_blocking(fd, True)
        return fd, target

    def open_write(self, path: str, append: bool) -> Tuple[int, int, str]:
        """(directory fd, file fd, path) for writing; never through a symlink."""
        target = self.with_real_parent(path)
        if target in self.roots:
            raise IsADirectoryError(errno.EISDIR, "%s is a directory" % target)
        parent, name = os.path.split(target)
        os.makedirs(parent, exist_ok=True)
        dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.check_fd(dir_fd, parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_APPEND if append else os.O_TRUNC
        try:
            fd = os.open(name, flags, 0o666, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            if exc.errno == errno.ELOOP:
                raise PathRefused(
                    "%s is a symlink; files.write does not write through symlinks" % target
                ) from None
            if exc.errno == errno.ENXIO:
                raise PathRefused("%s is not a regular file" % target) from None
            raise OSError(exc.errno, exc.strerror, target) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            os.close(dir_fd)
            raise PathRefused("%s is not a regular file" % target)
        os.set_blocking(fd, True)
        return dir_fd, fd, target

    def entry(self, path: str) -> Dict[str, Any]:
        info = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        target = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
        # A link's type is what it points at, but only inside the workspace: outside,
        # the files API does not even say whether something exists.
        if (
            target is not None
            and _within(os.path.realpath(path), self.roots)
            and os.path.isdir(path)
        ):
            kind = "dir"
        return {
            "name": os.path.basename(path) or path,
            "type": kind,
            "path": path,
            "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode),
            "permissions": stat.filemode(info.st_mode),
            "modified_time": info.st_mtime,
            "symlink_target": target,
        }

    def on_fs_read(self, request: Dict[str, Any]) -> None:
        rid = request["id"]
        fd, _ = self.open_read(request["path"])
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
        dir_fd, fd, path = self.open_write(request["path"], request["append"])
        try:
            size = os.fstat(fd).st_size if request["append"] else 0
            if isinstance(limit, int) and size + len(data) > limit:
                # The host checks this too; an upload over the limit leaves no partial file.
                with contextlib.suppress(OSError):
                    os.unlink(os.path.basename(path), dir_fd=dir_fd)
                self.fail(
                    request["id"],
                    "InvalidArgumentError",
                    "%s: upload larger than the limit of %d bytes" % (path, limit),
                )
                return
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
            os.close(dir_fd)
        self.reply(request["id"], {"name": os.path.basename(path), "type": "file", "path": path})

    def on_fs_list(self, request: Dict[str, Any]) -> None:
        root = self.real(request["path"])
        depth = max(1, int(request["depth"]))
        if not os.path.isdir(root):
            if os.path.lexists(root):
                self.fail(request["id"], "FileOperationError", "%s is not a directory" % root)
            else:
                self.fail(request["id"], "NotFoundError", "%s does not exist" % root)
            return
        entries: List[Dict[str, Any]] = []

        def walk(directory: str, level: int) -> None:
            for name in sorted(os.listdir(directory)):
                full = os.path.join(directory, name)
                try:
                    item = self.entry(full)
                except OSError:
                    continue
                entries.append(item)
                if level < depth and item["type"] == "dir" and not os.path.islink(full):
                    walk(full, level + 1)

        walk(root, 1)
        self.reply(request["id"], entries)

    def on_fs_stat(self, request: Dict[str, Any]) -> None:
        self.reply(request["id"], self.entry(self.with_real_parent(request["path"])))

    def on_fs_remove(self, request: Dict[str, Any]) -> None:
        path = self.with_real_parent(request["path"])
        if path in self.roots:
            raise PathRefused("%s is a workspace root and cannot be removed" % path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        self.reply(request["id"])

    def on_fs_mkdir(self, request: Dict[str, Any]) -> None:
        path = self.with_real_parent(request["path"])
        if os.path.isdir(path):
            self.reply(request["id"], False)
            return
        os.makedirs(path)
        self.reply(request["id"], True)

    def on_fs_rename(self, request: Dict[str, Any]) -> None:
        src = self.with_real_parent(request["src"])
        dst = self.with_real_parent(request["dst"])
        if src in self.roots or dst in self.roots:
            raise PathRefused("a workspace root cannot be renamed or replaced")
        parent = os.path.dirname(dst)
        if parent:
            os.makedirs(parent, exist_ok=True)
        os.rename(src, dst)
        self.reply(request["id"], self.entry(dst))


class Workers:
    """Threads that serve requests, each on its own thread as before, but reused: a
    request goes to an idle worker if there is one, else to a new thread. Starting a
    thread per request cost about a tenth of a millisecond of every cell's round trip.
    Idle workers exit after a minute."""

    IDLE = 60.0

    def __init__(self, handler: Callable[[Dict[str, Any]], None]) -> None:
        self.handler = handler
        self.lock = threading.Lock()
        self.idle = 0
        self.tasks: "queue.SimpleQueue[Dict[str, Any]]" = queue.SimpleQueue()

    def submit(self, request: Dict[str, Any]) -> None:
        """Hand ``request`` to a worker; RuntimeError if no thread can be started."""
        with self.lock:
            if self.idle > 0:
                self.idle -= 1
                self.tasks.put(request)
                return
        threading.Thread(target=self.work, args=(request,), daemon=True).start()

    def work(self, request: Dict[str, Any]) -> None:
        while True:
            self.handler(request)
            with self.lock:
                self.idle += 1
            try:
                request = self.tasks.get(timeout=self.IDLE)
            except queue.Empty:
                with self.lock:
                    # A request may have been promised to us just as we timed out.
                    try:
                        request = self.tasks.get_nowait()
                    except queue.Empty:
                        self.idle -= 1
                        return


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


def _become_kernel(sock_fd: int, out_w: int, err_w: int, cwd: str, argv: List[str]) -> None:
    """In a freshly forked child: set up the process like a spawned kernel (``argv`` is
    the command line it would have been started with), run it, exit."""
    code = 70
    args = argv[5:]  # after: python -I -c BOOTSTRAP <lib>
    try:
        from sandlot.runner._zygote import set_cmdline

        set_cmdline(argv[:-2])  # without "--config <json>", which rarely fits
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        keep = {0, 1, 2, sock_fd}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.set_inheritable(sock_fd, False)
        os.chdir(cwd)
        # What a new interpreter would have: SIGPIPE ignored (Python's default), every
        # other handler the default; the kernel installs its own SIGINT handler.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        sys.argv = ["-c", *args]
        # Fresh randomness: forked interpreters would otherwise share numpy's global
        # generator state (``random`` re-seeds itself after a fork).
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()
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


class PathRefused(Exception):
    """A files.* path outside the workspace, or reaching outside through a symlink."""


def _within(path: str, roots: Tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _check_name(path: str) -> None:
    # The host checks these too; the runner does not rely on it.
    if "\0" in path or not path:
        raise PathRefused("invalid path %r" % path[:100])
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise PathRefused("path too long (at most %d bytes, %d per name)" % (PATH_MAX, NAME_MAX))


class OutputBudget:
    """Per-cell accounting of stdout/stderr bytes and rich results, with markers.

    ``truncated`` (reported on the exit event) is set when text was cut or a result
    was dropped; the markers saying so are sandlot's own and bypass the text budget,
    so a cell that already filled it still learns that its results were dropped.
    """

    def __init__(self, supervisor: Supervisor, rid: str) -> None:
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

    def text(self, kind: str, text: str) -> None:
        limit = self.supervisor.output_bytes
        with self.lock:
            if self.text_cut:
                return
            size = len(text.encode("utf-8", "replace"))
            if limit is not None and self.used + size > limit:
                room = max(0, limit - self.used)
                text = text.encode("utf-8", "replace")[:room].decode("utf-8", "ignore")
                text += (
                    "\n[sandlot: output truncated: more than %d bytes of stdout/stderr]\n" % limit
                )
                self.text_cut = True
            self.used += size
        if text:
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

    def result(self, message: Dict[str, Any]) -> None:
        limit = self.supervisor.max_results
        size_limit = self.supervisor.result_bytes
        # Size first: an oversized result is dropped without taking one of the slots.
        if size_limit is not None and len(json.dumps(message["data"])) > size_limit:
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
        self.supervisor.send(message)


def _pump(stream: Any, budget: OutputBudget, kind: str) -> None:
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
        self.pending_exit: Optional[Tuple[Any, Any]] = None
        self.timeout = 0.0


class KernelProcess:
    """A kernel subprocess for one code context, and the thread that listens to it."""

    def __init__(self, supervisor: Supervisor, context_id: str, cwd: str, language: str) -> None:
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
        self.launch()

    def describe(self) -> Dict[str, Any]:
        return {"id": self.context_id, "language": self.language, "cwd": self.cwd}

    def launch(self) -> None:
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        config = {
            "memory_mb": self.supervisor.config.get("memory_mb"),
            "rlimits": self.supervisor.config.get("rlimits") or {},
            "preload": self.supervisor.config.get("preload") or [],
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
            if self.supervisor.take_fork():
                self.proc = self.supervisor.fork(theirs.fileno(), out_w, err_w, self.cwd, argv)
            else:
                self.proc = self.supervisor.spawn(
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
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ, "sock")
        selector.register(out_r, selectors.EVENT_READ, "stdout")
        selector.register(err_r, selectors.EVENT_READ, "stderr")
        # A partial line; bytes are appended and only new data is scanned for the newline,
        # so a huge line costs linear time (it used to be quadratic: a 64 MB print took
        # the cell past its timeout). A line past the protocol limit is dropped.
        pending = bytearray()
        overlong = False
        open_pipes = {out_r, err_r}
        sock_open = True
        while sock_open:
            for key, _ in selector.select():
                if key.data == "sock":
                    data = sock.recv(1 << 20)
                    if not data:
                        sock_open = False
                        break
                    *lines, rest = data.split(b"\n")
                    for line in lines:
                        if not overlong:
                            pending += line
                            self.on_kernel_event(bytes(pending), out_r, err_r, open_pipes)
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
                    fd = key.fd
                    self.read_pipe(fd, key.data, selector, open_pipes)
        selector.close()
        for fd in (out_r, err_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        sock.close()
        self.on_kernel_gone(proc)

    def read_pipe(self, fd: int, kind: str, selector: Any, open_pipes: Set[int]) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            selector.unregister(fd)
            open_pipes.discard(fd)
            return
        cell = self.cell
        if cell is not None and not cell.done.is_set():
            cell.budget.text(kind, data.decode("utf-8", "replace"))

    def drain_pipes(self, open_pipes: Set[int]) -> None:
        """Forward whatever is already in the stdout/stderr pipes (before an exit)."""
        for fd in list(open_pipes):
            os.set_blocking(fd, False)
            try:
                while True:
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if not data:
                        break
                    cell = self.cell
                    if cell is not None:
                        cell.budget.text(self.pipes[fd], data.decode("utf-8", "replace"))
            finally:
                os.set_blocking(fd, True)

    def on_kernel_event(self, line: bytes, out_r: int, err_r: int, open_pipes: Set[int]) -> None:
        cell = self.cell
        if cell is None or cell.done.is_set():
            if b'"preloaded"' in line and _event_type(line) == "preloaded":
                self.preloaded.set()
            return
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict) or message.get("id") != cell.rid:
            return
        kind = message.get("type")
        if kind in ("stdout", "stderr") and isinstance(message.get("text"), str):
            cell.budget.text(kind, message["text"])
        elif kind == "result":
            cell.budget.result(message)
        elif kind == "error":
            if cell.timed_out and message.get("name") == "KeyboardInterrupt":
                message = self.timeout_error(cell, restarted=False)
            self.supervisor.send(message)
        elif kind == "exit":
            self.drain_pipes(open_pipes)
            status = message.get("status")
            if cell.timed_out and status in ("interrupted", "error"):
                status = "timeout"
            if status == "oom" and message.get("kept") is not True:
                # The kernel exits right after this; finish only once a fresh kernel
                # is in place, so the next cell cannot reach the dying one.
                cell.pending_exit = (status, message.get("execution_count"))
                return
            self.finish(cell, status, message.get("execution_count"))

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

    def finish(self, cell: Cell, status: Any, count: Any = None) -> None:
        """Send the cell's one and only exit event."""
        with cell.finish_lock:
            if cell.done.is_set():
                return
            message: Dict[str, Any] = {"type": "exit", "id": cell.rid, "status": status}
            if isinstance(count, int):
                message["execution_count"] = count
            if cell.budget.truncated:
                message["truncated"] = True
            self.supervisor.send(message)
            cell.done.set()

    def on_kernel_gone(self, proc: "subprocess.Popen[bytes]") -> None:
        code = proc.wait()
        self.supervisor.forget(proc.pid)
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
                    self.supervisor.kill_strays()
                    self.launch()  # a context always has a live kernel
        if cell is not None and status is not None:
            if report is not None:
                self.supervisor.send(report)
            self.finish(cell, status, count)

    # --- requests ---------------------------------------------------------------------
    def execute(self, request: Dict[str, Any]) -> None:
        with self.exec_lock:
            cell = Cell(request["id"], OutputBudget(self.supervisor, request["id"]))
            cell.timeout = float(request["timeout"])
            self.cell = cell
            message = {
                "type": "execute",
                "id": request["id"],
                "code": request["code"],
                "envs": request["envs"],
                "silent": request.get("silent") is True,
            }
            try:
                with self.state_lock:
                    self.sock.sendall(encode(message))
            except OSError:
                pass  # the kernel died; its listener reports it and restarts it
            if cell.done.wait(cell.timeout):
                return
            # Timeout: stop everything the cell started, then ask the kernel to stop.
            cell.timed_out = True
            proc = self.proc
            if proc is not None:
                self.supervisor.kill_tree(proc.pid, include_root=False)
                _signal_all([proc.pid], signal.SIGINT)
            if cell.done.wait(self.supervisor.grace):
                return
            self.supervisor.send(self.timeout_error(cell, restarted=True))
            self.finish(cell, "timeout")
            self.restart()

    def interrupt(self) -> None:
        proc = self.proc
        cell = self.cell
        if proc is not None and cell is not None and not cell.done.is_set():
            cell.interrupted = True
            self.supervisor.kill_tree(proc.pid, include_root=False)
            _signal_all([proc.pid], signal.SIGINT)

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
        self.supervisor.kill_tree(proc.pid, include_root=True)
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


def _os_message(exc: OSError) -> str:
    if exc.filename:
        return "%s: %s" % (exc.strerror or exc, exc.filename)
    return str(exc.strerror or exc)


def _prepare_home(home: str) -> None:
    """Give the sandbox user the template's matplotlib settings and warm font cache."""
    source = os.path.join(TEMPLATE_SHARE, "matplotlib")
    if not os.path.isdir(source):
        return
    rc = os.path.join(source, "matplotlibrc")
    if os.path.exists(rc):
        os.makedirs(os.path.join(home, ".config", "matplotlib"), exist_ok=True)
        shutil.copyfile(rc, os.path.join(home, ".config", "matplotlib", "matplotlibrc"))
    cache = os.path.join(source, "cache")
    if os.path.isdir(cache):
        target = os.path.join(home, ".cache", "matplotlib")
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(cache):
            if name.endswith(".json"):
                shutil.copyfile(os.path.join(cache, name), os.path.join(target, name))


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


def read_configuration(reader: Any) -> Optional[Dict[str, Any]]:
    """The host's first message, ``configure``; None (reason on stderr) if it is not."""
    try:
        first = decode(reader.readline(), HOST_REQUESTS)
    except ProtocolViolation as exc:
        sys.stderr.write("sandlot runner: bad configuration: %s\n" % exc)
        return None
    if first["type"] != "configure":
        sys.stderr.write("sandlot runner: expected a configure message first\n")
        return None
    config: Dict[str, Any] = first["config"]
    return config


def run(
    sock: "socket.socket | StdioChannel",
    reader: Any,
    config: Dict[str, Any],
    fork_kernel: bool = False,
) -> int:
    """Serve the host channel as the sandbox's supervisor until it closes.

    ``fork_kernel``: this process already holds the template's preloaded modules (a
    zygote-made sandbox), so the default kernel is forked from it instead of started
    as a new interpreter that would import them again."""
    libc = ctypes.CDLL(None, use_errno=True)
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
        # Fail closed: the host sees no "ready" and reports this line.
        sys.stderr.write("sandlot runner: cannot apply resource limits: %s\n" % exc)
        return 70
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write("sandlot runner: cannot become a child subreaper\n")
        return 70
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
    home = str(config.get("workdir", "/home/user"))
    try:
        _prepare_home(home)
    except OSError as exc:
        sys.stderr.write("sandlot runner: could not copy matplotlib settings: %s\n" % exc)
    supervisor = Supervisor(sock, reader, config)
    supervisor.fork_next_kernel = fork_kernel
    default = supervisor.start_kernel("default", home)
    if config.get("preload"):
        # "ready" then means the modules are imported (what a warm pool waits for). A
        # kernel that dies meanwhile ends the wait (its listener restarts it); a hung
        # import is bounded by the host's start timeout.
        kernel_proc = default.proc
        while not default.preloaded.wait(0.1):
            if kernel_proc is None or kernel_proc.poll() is not None:
                break
    threading.Thread(target=supervisor.reaper_loop, daemon=True).start()
    supervisor.serve()
    return 0
