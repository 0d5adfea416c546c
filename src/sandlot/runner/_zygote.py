"""The zygote: a fork server that makes sandboxes with the data stack already imported.

Started by the host inside a bubblewrap sandbox of its own (read-only template root,
no network, uid 1000, the sandbox seccomp filter minus ``mount``, ``unshare``,
``setns`` and ``sethostname``), as
``python -I -c <bootstrap> zygote --fd N --filter-fd M``, with CAP_SYS_ADMIN,
CAP_NET_ADMIN and CAP_SETPCAP in *its own* user namespace and none on the host. It
imports the preload modules once, runs a few ``1 + 1`` cells of its own through a
throwaway supervisor and kernel (:func:`_warm_up`), freezes it all out of the garbage
collector, says ``ready`` and then only forks. It never runs user code.

It first moves into a pid namespace of its own (``unshare`` and one fork, before any
import). That namespace belongs to the user namespace the zygote holds CAP_SYS_ADMIN
in, unlike bubblewrap's, so the zygote can point ``pid_for_children`` at a fresh pid
namespace, fork the new sandbox's pid 1 straight into it, and ``setns`` back for the
next one: a sandbox costs one fork of the zygote, not two (a fork and the exit of a
process with the data stack mapped each cost milliseconds of page-table work).

Control channel (fd N, a SOCK_SEQPACKET socket to the host; one JSON object per
packet)::

    host   -> zygote  {"type": "configure", "preload": [...]}
    zygote -> host    {"type": "ready", "version": PROTOCOL_VERSION, "vm_bytes": ...}
    host   -> zygote  {"type": "spawn", "id": <random>} + SCM_RIGHTS: the new sandbox's channel
    zygote -> host    {"type": "spawned", "id": ...} | {"type": "failed", "id": ..., "message": ...}

The new sandbox's own settings never pass through the zygote: the host writes them on
the sandbox's channel before it asks for the fork, and the forked process reads them
there (:func:`read_setup`), as one frame: a 4-byte big-endian length, then JSON
``{"mounts": [[path, bytes|null, mode]], "hostname": ..., "quotas": {"user": {name: n},
"rlimits": {name: n}}}``. The zygote's memory, which every later sandbox inherits,
so holds no earlier sandbox's settings (not even freed copies), and the request ids
are random, not a count of the sandboxes made before.

What one ``spawn`` does, in the new sandbox's first process (its pid 1):

1. a fresh pid namespace (made by the zygote, which forks the sandbox's first process
   into it as its pid 1), then fresh mount, network, ipc and uts namespaces;
2. a private tmpfs at every writable place (``/home/user``, ``/tmp``, ``/dev/shm``),
   its own ``/dev/pts`` instance, a new ``/proc`` for the new pid namespace (with
   bubblewrap's read-only covers), the hostname, loopback up;
3. a user namespace of its own, nested in the zygote's, mapping only uid/gid 1000,
   with this sandbox's share of the kernel's per-user quotas (see below);
4. says who it is on the channel with SCM_CREDENTIALS, so the host learns its pid as
   the host sees it (the kernel translates it; the sandbox cannot lie about it);
   the host makes the sandbox's own cgroup meanwhile and, on cgroup v2, moves it in;
   on v1 it sends that cgroup's ``tasks`` files and the process moves itself in
   (:func:`_join_cgroup`), then reads ``configure``;
5. a new cgroup namespace (rooted at that cgroup), then every capability dropped
   (bounding, ambient, permitted, effective, inheritable) and the full sandbox seccomp
   filter installed on top of the zygote's (no_new_privs is already set);
6. becomes the supervisor, and forks the default kernel from itself.

Per-user quotas. Every sandbox a zygote forks runs as the zygote's host uid, and the
kernel charges some resources to the host uid that created the outermost user
namespace, whatever uid a process switches to below it: inotify instances and watches
(``fs.inotify.max_user_*``), message queue bytes, pending signals. Forks of one zygote
therefore share one budget, and each gets a fixed share of it instead: the limits of
its own user namespace (``/proc/sys/user/max_inotify_*``, which the kernel checks at
every level) and its rlimits (``RLIMIT_MSGQUEUE``, ``RLIMIT_SIGPENDING``, counted per
user namespace). The host sizes the shares and forks no more sandboxes than there are
shares (more start cold, as a uid of their own).

Nothing of the zygote stays reachable: the control socket and every other descriptor
are closed first, the zygote's processes are in a pid namespace the sandbox cannot
see, its files are under the new tmpfs mounts, and its namespaces can only be
joined with capabilities the sandbox no longer has.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import importlib
import json
import linecache
import os
import resource
import select
import signal
import socket
import struct
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

from sandlot.protocol import PROTOCOL_VERSION
from sandlot.protocol.layout import HOME
from sandlot.runner._processes import argument_area, close_all_but, libc, set_cmdline

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MADV_COLLAPSE = 25
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 1
MOVED = b"\0"
"""The host's first byte to a new sandbox: it has moved it into its cgroup (v2)."""
MOVE_YOURSELF = b"\1"
"""The host's first byte to a new sandbox, with its cgroup's v1 ``tasks`` files: move in."""
PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")
"""What bubblewrap mounts read-only over a sandbox's /proc; a zygote child does the same."""
MAX_PACKET = 1 << 16
SETUP_HEADER = struct.Struct(">I")
"""The length before a new sandbox's setup frame on its channel."""
MAX_SETUP = 1 << 16
RLIMITS = {"msgqueue": resource.RLIMIT_MSGQUEUE, "sigpending": resource.RLIMIT_SIGPENDING}
"""The rlimits a spawn request may set (soft and hard) in the new sandbox."""
USER_LIMITS = ("max_inotify_instances", "max_inotify_watches", "max_user_namespaces")
"""The ``/proc/sys/user`` limits a spawn request may set in the sandbox's user namespace."""


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class SetupFailed(Exception):
    """A step that isolates a new sandbox failed; the sandbox must not run."""


_libc = libc()  # the one CDLL every process forked from the zygote shares


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupFailed("%s: %s" % (what, os.strerror(err)))


def _mount(
    source: Optional[str], target: str, fstype: Optional[str], flags: int, data: str = ""
) -> None:
    rc = _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, "mount %s" % target)


# --- the zygote process -----------------------------------------------------------------


_COMMAND: List[str] = []
"""The interpreter and bootstrap arguments this process was started with (everything
before the role), which a sandbox's processes show as their own command line."""


def main(argv: List[str]) -> int:
    with open("/proc/self/cmdline", "rb") as handle:
        words = handle.read().decode().split("\0")
    _COMMAND[:] = words[: words.index("zygote")]
    control = socket.socket(fileno=int(argv[argv.index("--fd") + 1]))
    filter_fd = int(argv[argv.index("--filter-fd") + 1])
    program = _read_all(filter_fd)
    os.close(filter_fd)
    if not program or len(program) % 8:
        sys.stderr.write("sandlot zygote: no seccomp program for the sandboxes\n")
        return 70
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _last_cap()  # read here once, not in every sandbox
    argument_area()  # likewise
    own_pid_ns = _enter_own_pid_namespace(control)
    configure = json.loads(control.recv(MAX_PACKET) or b"null")
    if not isinstance(configure, dict) or configure.get("type") != "configure":
        sys.stderr.write("sandlot zygote: expected a configure message first\n")
        return 70
    _preload([str(name) for name in configure.get("preload") or []])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every sandbox's pid 1 is a child of this process: reap them as they end.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    # Its address space, which every fork starts with: a sandbox whose per-process
    # memory limit (RLIMIT_AS) is not well above it could not allocate anything.
    with open("/proc/self/statm") as handle:
        vm_bytes = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    hello = {"type": "ready", "version": PROTOCOL_VERSION, "vm_bytes": vm_bytes}
    control.send(json.dumps(hello).encode())
    # poll(), not select(): the control socket keeps the number it had in the host,
    # which may be past select()'s 1024 in a process with many sandboxes.
    poller = select.poll()
    poller.register(control.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        ready = [fd for fd, _ in poller.poll(5000)]
        _reap()
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
        if control.fileno() not in ready:
            continue
        fds = array.array("i")
        try:
            data, ancdata, _, _ = control.recvmsg(MAX_PACKET, socket.CMSG_SPACE(4 * 4))
        except InterruptedError:
            continue
        if not data:
            return 0  # the host closed the channel: the sandboxes go with us
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        try:
            request = json.loads(data)
            _serve(control, request, list(fds), program, own_pid_ns)
        except ZygoteBroken as exc:
            sys.stderr.write("sandlot zygote: %s\n" % exc)
            return 70  # the host starts a new zygote
        except Exception as exc:  # a bad request must not take the zygote down
            rid = request.get("id") if isinstance(request, dict) else None
            control.send(json.dumps({"type": "failed", "id": rid, "message": repr(exc)}).encode())
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


class ZygoteBroken(Exception):
    """The zygote cannot make further sandboxes safely: it exits, the host restarts it."""


def _enter_own_pid_namespace(control: socket.socket) -> int:
    """Continue as pid 1 of a new pid namespace; return a descriptor of it.

    The process bubblewrap started stays behind, small (nothing is imported yet), and
    only waits for the zygote to end, then ends the same way."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare pid namespace")
    pid = os.fork()
    if pid != 0:
        control.close()
        while True:
            try:
                done, status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(70)
            if done == pid:
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    return os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


def _read_all(fd: int) -> bytes:
    chunks: List[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


_HOME_FILES: List[Tuple[str, bytes]] = []
"""The template's matplotlib files for a new home, read once here for every sandbox."""


def _preload(names: List[str]) -> None:
    """Import the runner and the preload modules once, for every sandbox to come."""
    # Both roles every sandbox runs: its supervisor, and its kernel forked from it.
    from sandlot.runner import _kernel, _shell, _supervisor  # and so every runner module

    # The home a sandbox's kernel starts with: matplotlib reads its settings and font
    # cache from there when it is imported, which is now. Each sandbox gets its own
    # fresh copy of the same files in its own /home/user.
    try:
        _HOME_FILES[:] = _supervisor.home_files()
        _supervisor._prepare_home(os.environ.get("HOME", HOME), _HOME_FILES)
    except OSError as exc:
        sys.stderr.write("sandlot zygote: could not copy matplotlib settings: %s\n" % exc)
    # The kernel's own preload (headless matplotlib, errors on stderr, gc.freeze()).
    _kernel._preload(names)
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:  # what every kernel's import hook would do to it (~0.3 ms)
        _kernel._accept_boxplot_labels(pyplot)
    # Every kernel makes an IPython shell (when the template has IPython): import it
    # here once rather than in each sandbox's first cell.
    _shell.preload()
    # A few trivial cells through the supervisor's and the kernel's own code, so that
    # each sandbox's first cell costs what its later ones do.
    try:
        _warm_up()
    except Exception as exc:  # purely for speed: the sandboxes work without it
        sys.stderr.write("sandlot zygote: warm-up failed: %r\n" % (exc,))
    importlib.invalidate_caches()
    gc.collect()
    gc.freeze()
    _collapse_to_huge_pages()


WARM_UP_CELLS = 16
"""Cells :func:`_warm_up` runs: CPython 3.11 quickens a function's code after 8 calls."""


def _warm_up(cells: int = WARM_UP_CELLS) -> None:
    """Run ``1 + 1`` cells from a host's ``execute`` line to the supervisor's reply,
    through a throwaway supervisor and kernel in this process, before any fork.

    Every sandbox's first cell otherwise built the same state itself (C library
    lookups, lazily made objects, the interpreter's quickening of each function on the
    way) in memory it shares with the zygote, one copy-on-write fault at a time: its
    first cell cost ~2 ms against ~0.5 ms for the next. Nothing of it stays: both
    objects, their sockets, the kernel's namespace (a module of its own, not the
    shell's prestarted one) and the cells' source lines are dropped, and the shell is
    left as it was (:func:`_shell.preload`). No user code runs, no thread starts (the
    supervisor's deadline thread is not started: the deadlines are only added and
    cancelled), and nothing random or per sandbox is made: each sandbox makes its own
    after its fork."""
    from sandlot.protocol import HOST_REQUESTS, decode, encode
    from sandlot.runner import _contexts, _kernel, _supervisor

    host, ours = socket.socketpair()
    supervisor_end, kernel_end = socket.socketpair()
    home = os.environ.get("HOME", HOME)
    supervisor = _supervisor.Supervisor(ours, None, {"workdir": home})
    kernel = _kernel.Kernel(_kernel.Channel(kernel_end.detach()), {}, types.ModuleType("__main__"))
    try:
        context = _contexts.KernelProcess(supervisor, "default", home, "python", supervisor_end)
        supervisor.kernels["default"] = context
        for number in range(cells):
            line = encode(
                {
                    "type": "execute",
                    "id": "warm-up-%d" % number,
                    "code": "1 + 1",
                    "context": "default",
                    "envs": {},
                    "timeout": 60.0,
                }
            )
            if supervisor.start_cell(decode(line, HOST_REQUESTS), line) is not None:
                raise RuntimeError("the warm-up kernel did not take its cell")
            request = kernel.channel.receive()
            if request is None:
                raise RuntimeError("the warm-up kernel's socket closed")
            kernel.execute(request)
            events = supervisor_end.recv(_contexts.READ_BYTES)
            with supervisor.batched():
                for event in events.split(b"\n")[:-1]:
                    context.on_kernel_event(event, -1, -1, set())
            host.recv(1 << 16)
    finally:
        supervisor.files.close()
        kernel.channel.reader.close()
        kernel.channel.sock.close()
        for sock in (host, ours, supervisor_end):
            sock.close()
        for number in range(cells + 1):
            linecache.cache.pop("<cell-%d>" % number, None)


def _collapse_to_huge_pages() -> None:
    """Back the zygote's anonymous memory with transparent huge pages where it can.

    A fork copies, and an exit tears down, one page-table entry per 4 KiB page shared
    with the zygote: with the data stack imported that is most of a sandbox's start-up
    CPU. A huge page is one entry for 2 MiB. ``MADV_COLLAPSE`` (Linux 6.1+) does it now
    and leaves the mappings' THP settings alone, so memory a sandbox allocates later is
    unaffected. Best effort, purely for speed: an older kernel, THP turned off, or a
    range with nothing in it is left as it is."""
    if os.sysconf("SC_PAGE_SIZE") != 4096:
        return  # huge pages are not 2 MiB there
    huge = 2 << 20
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as handle:
        maps = handle.read().splitlines()
    for line in maps:
        fields = line.split()
        if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue  # only private anonymous memory (the heap and mmap'd arenas)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        chunk = (start + huge - 1) & ~(huge - 1)
        while chunk + huge <= end:
            madvise(chunk, huge, MADV_COLLAPSE)  # per chunk: one failure stops nothing
            chunk += huge


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _serve(
    control: socket.socket,
    request: Dict[str, Any],
    fds: List[int],
    program: bytes,
    own_pid_ns: int,
) -> None:
    if request.get("type") != "spawn" or len(fds) != 1:
        raise ValueError("expected a spawn request with one descriptor")
    rid = request.get("id")
    # The next fork lands in a new pid namespace as its pid 1; then back to our own,
    # or the next unshare would fail (only allowed while they are the same).
    _check(_libc.unshare(CLONE_NEWPID), "unshare pid namespace")
    try:
        pid = os.fork()
    except BaseException:
        _back_to(own_pid_ns)
        raise
    if pid == 0:  # pragma: no cover - exercised through the host's tests
        code = 70
        try:
            # Not the zygote's: its wake-up descriptor (closed below; the number would
            # be reused) and its SIGCHLD handler.
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            control.close()
            code = _child(fds[0], program)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                os.write(2, ("sandlot zygote: sandbox setup failed: %r\n" % (exc,)).encode())
        os._exit(code)
    _back_to(own_pid_ns)
    control.send(json.dumps({"type": "spawned", "id": rid}).encode())


def _quotas(value: Any) -> Dict[str, Dict[str, int]]:
    """A spawn request's quotas, checked: known names, non-negative integers."""
    if not isinstance(value, dict):
        raise ValueError("a spawn request needs the sandbox's quotas")
    user = {str(k): int(v) for k, v in dict(value.get("user") or {}).items()}
    rlimits = {str(k): int(v) for k, v in dict(value.get("rlimits") or {}).items()}
    if not set(user) <= set(USER_LIMITS) or not set(rlimits) <= set(RLIMITS):
        raise ValueError("unknown quota in %r" % (value,))
    if min([*user.values(), *rlimits.values(), 0]) < 0:
        raise ValueError("negative quota in %r" % (value,))
    return {"user": user, "rlimits": rlimits}


def _back_to(own_pid_ns: int) -> None:
    if _libc.setns(own_pid_ns, CLONE_NEWPID) != 0:
        raise ZygoteBroken(
            "cannot return to its own pid namespace: %s" % os.strerror(ctypes.get_errno())
        )


# --- a new sandbox ------------------------------------------------------------------------


def read_setup(sock: socket.socket) -> Tuple[List[Any], str, Dict[str, Dict[str, int]]]:
    """This sandbox's settings, from the frame the host wrote on its channel before it
    asked for the fork: tmpfs mounts, hostname, quotas (checked). Read to the byte, so
    nothing of the host's next message (the cgroup move, which carries descriptors) is
    taken with it."""
    (size,) = SETUP_HEADER.unpack(_read_exactly(sock, SETUP_HEADER.size))
    if size > MAX_SETUP:
        raise SetupFailed("a setup frame of %d bytes" % size)
    setup = json.loads(_read_exactly(sock, size))
    if not isinstance(setup, dict):
        raise SetupFailed("the setup frame is not an object")
    mounts = [(str(p), None if s is None else int(s), str(m)) for p, s, m in setup["mounts"]]
    hostname = str(setup.get("hostname") or "sandlot")
    return mounts, hostname, _quotas(setup.get("quotas"))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise SetupFailed("the channel closed before the sandbox's settings arrived")
        data += chunk
    return data


def _child(channel_fd: int, program: bytes) -> int:
    """The sandbox's pid 1, just forked into its new pid namespace: its settings from
    its channel, the other new namespaces, then :func:`_sandbox_init`."""
    close_all_but({0, 1, 2, channel_fd})
    sock = socket.socket(fileno=channel_fd)
    # Who we are, in credentials the kernel checks and translates into the host's pid
    # namespace. Sent first: the host moves that pid into the sandbox's cgroup (which
    # can wait for the kernel's cgroup lock) while the namespaces below are set up, and
    # sends the configuration only once it has.
    ucred = struct.pack("iII", os.getpid(), os.getuid(), os.getgid())
    sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, ucred)])
    try:
        mounts, hostname, quotas = read_setup(sock)
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        return _sandbox_init(sock, mounts, hostname, program, quotas)
    except SetupFailed as exc:
        os.write(2, ("sandlot zygote: cannot isolate the sandbox: %s\n" % exc).encode())
        return 70


def _sandbox_init(
    sock: socket.socket,
    mounts: List[Any],
    hostname: str,
    program: bytes,
    quotas: Dict[str, Dict[str, int]],
) -> int:
    """The sandbox's pid 1: private file systems, identity, cgroup, then no privileges."""
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for path, size, mode in mounts:
        options = "mode=%s,uid=%d,gid=%d" % (mode, os.getuid(), os.getgid())
        if size is not None:
            options += ",size=%d" % size
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
    # A pseudo-terminal instance of its own, as bubblewrap's --dev gives a cold sandbox:
    # the zygote's /dev/pts is shared by every sandbox it forks (same uid), so one could
    # open another's terminals, read what is typed into them and write to their screens.
    _mount(
        "devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620"
    )
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Opened before /proc/sys is covered read-only: the one way to set the limits of
    # the user namespace made below (writable to its owner, until it drops CAP_SYS_RESOURCE).
    sysctl_fd = os.open("/proc/sys", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in PROC_COVERS:
        path = "/proc/" + name
        if os.path.exists(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _mount(
                None,
                path,
                None,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            )
    raw = hostname.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")
    _loopback_up()
    # The working directory was the zygote's /home/user, now hidden under the new one.
    os.chdir(os.environ.get("HOME", HOME))
    try:
        _own_user_namespace(sysctl_fd, quotas)
    finally:
        os.close(sysctl_fd)
    from sandlot.runner import _supervisor

    # The template's matplotlib files into the new home now, while the host moves us
    # into the sandbox's cgroup, rather than after (the supervisor skips it then). No
    # user code has run yet, and the home is the fresh tmpfs mounted above; its few
    # pages may be charged to the zygote's cgroup, like the ones this process copied.
    home_ready: Optional[str] = os.environ.get("HOME", HOME)
    try:
        _supervisor._prepare_home(str(home_ready), _HOME_FILES or None)
    except OSError as exc:
        home_ready = None  # the supervisor tries again, and says why if it fails
        os.write(2, ("sandlot zygote: matplotlib settings: %s\n" % exc).encode())
    _join_cgroup(sock)
    reader = sock.makefile("rb")
    config = _supervisor.read_configuration(reader)
    if config is None:
        return 70
    # Rooted at the sandbox's own cgroup, which the host moved us into before it sent
    # the configuration: /proc/self/cgroup then says "/", as in a cold sandbox.
    _check(_libc.unshare(CLONE_NEWCGROUP), "unshare cgroup namespace")
    _drop_privileges(program)
    set_cmdline([*_COMMAND, "supervisor", "--fd", str(sock.fileno())])
    return _supervisor.run(sock, reader, config, fork_kernel=True, home_ready=home_ready)


def _join_cgroup(sock: socket.socket) -> None:
    """Be in the sandbox's own cgroup before reading the configuration.

    The host sends one byte first: ``MOVED`` (it moved this process itself, cgroup v2),
    or ``MOVE_YOURSELF`` with the ``tasks`` file of each of the cgroup's v1 hierarchies,
    opened by the host. Writing ``0`` there moves the writing thread, without the
    kernel's global threadgroup lock (and the RCU grace period it waits for) that moving
    a whole process takes; this process has one thread (a fresh fork of a zygote that
    starts none), which is checked. Any failure ends the sandbox before it is
    configured; the host also checks the move once the sandbox says ``ready``."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(
        1, socket.CMSG_SPACE(8 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    try:
        if flags & socket.MSG_CTRUNC:
            raise SetupFailed("too many descriptors with the cgroup message")
        if data == MOVED and not fds:
            return
        if data != MOVE_YOURSELF or not fds:
            raise SetupFailed("no cgroup to move into (%r, %d descriptors)" % (data, len(fds)))
        if os.listdir("/proc/self/task") != [str(os.getpid())]:
            raise SetupFailed("more than one thread: cannot move into the cgroup as one")
        for fd in fds:
            try:
                os.write(fd, b"0")
            except OSError as exc:
                raise SetupFailed("move into the sandbox's cgroup: %s" % exc.strerror) from exc
    finally:
        for fd in fds:
            os.close(fd)


def _own_user_namespace(sysctl_fd: int, quotas: Dict[str, Dict[str, int]]) -> None:
    """A user namespace of the sandbox's own, below the zygote's, with its share of the
    per-user quotas (module docstring). Every later namespace and capability is its."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER), "unshare user namespace")
    # Only the owner of a dumpable process may write its id maps. Nothing else can name
    # this process meanwhile: it is pid 1 of a pid namespace no other sandbox sees.
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        for name, text in (
            ("uid_map", "%d %d 1\n" % (uid, uid)),
            ("setgroups", "deny"),
            ("gid_map", "%d %d 1\n" % (gid, gid)),
        ):
            _write_proc("/proc/self/" + name, text.encode())
    finally:
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    for name, value in sorted(quotas["user"].items()):
        # Resolved now, so in this user namespace (the kernel picks the table by the
        # caller's), through the /proc mount the read-only cover does not hide.
        fd = os.open("user/" + name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=sysctl_fd)
        try:
            os.write(fd, b"%d" % value)
        finally:
            os.close(fd)
        if int(_read_proc("/proc/sys/user/" + name)) != value:
            raise SetupFailed("user.%s did not take its value" % name)
    for name, value in sorted(quotas["rlimits"].items()):
        resource.setrlimit(RLIMITS[name], (value, value))


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        import fcntl

        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


_LAST_CAP: List[int] = []
"""The kernel's highest capability number, read once by the zygote (it cannot change)."""


def _last_cap() -> int:
    if not _LAST_CAP:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            _LAST_CAP.append(int(handle.read()))
    return _LAST_CAP[0]


def _drop_privileges(program: bytes) -> None:
    """Every capability gone, then the sandbox's seccomp filter; verified, not assumed."""
    for cap in range(_last_cap() + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability %d" % cap)
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
        "install the seccomp filter",
    )
    problem = _unprivileged(_read_proc("/proc/self/status"))
    if problem is not None:
        raise SetupFailed(problem)


def _unprivileged(status: bytes) -> Optional[str]:
    """What ``/proc/self/status`` (its bytes) says is left of the process's privileges
    (a capability set not empty, no no_new_privs, no seccomp filter), None if nothing.
    A line that is missing or unreadable counts as privileges left."""
    fields: Dict[bytes, bytes] = {}
    for line in status.split(b"\n"):
        key, colon, value = line.partition(b":")
        if colon and key in _STATUS_CHECKED:
            fields[key] = value.strip()
    for key in _CAPABILITY_SETS:
        try:
            empty = int(fields.get(key, b"1"), 16) == 0
        except ValueError:
            empty = False
        if not empty:
            return "%s is not empty after dropping capabilities" % key.decode()
    if fields.get(b"NoNewPrivs") != b"1" or fields.get(b"Seccomp") != b"2":
        return "no_new_privs or the seccomp filter is not in place"
    return None


_CAPABILITY_SETS = (b"CapInh", b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb")
_STATUS_CHECKED = frozenset((*_CAPABILITY_SETS, b"NoNewPrivs", b"Seccomp"))
"""The lines of ``/proc/self/status`` :func:`_drop_privileges` checks."""


# /proc files through plain descriptors: the few files a new sandbox's pid 1 reads and
# writes while it isolates itself cost it, through open() (text and buffer layers made
# in a fresh fork), ~60 copy-on-write faults more.


def _write_proc(path: str, data: bytes) -> None:
    """``data`` to a /proc file in one write(2), as id maps must be written."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.write(fd, data) != len(data):
            raise SetupFailed("%s: short write" % path)
    finally:
        os.close(fd)


def _read_proc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_all(fd)
    finally:
        os.close(fd)
