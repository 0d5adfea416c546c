"""What the cold bubblewrap backend and the zygote share on the host side: the host
probe (a real self-test) and doctor checks, where bwrap is, the host layout a sandbox
is built from, the spawner thread, what runs between fork and exec (cgroup join, uid
drop), the sandbox's cgroup, the handle, and the housekeeping after a crash (orphaned
cgroups, reaping a sandbox from its recovery token).

Both :mod:`sandlot.backends.bwrap` (cold starts) and :mod:`._zygote` (forks) import
this module; neither imports the other's private names.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import os
import queue
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import sandlot.protocol
import sandlot.runner
from sandlot._exceptions import (
    CheckpointError,
    IsolationUnavailable,
)
from sandlot._models import NetworkEvent, ResourceUsage
from sandlot.backends import _cgroups, _hostids, _reaper
from sandlot.backends._base import Finding, Probe, RecoveryToken
from sandlot.backends._cgroups import process_start_time
from sandlot.backends._channel import ChannelHandle, SandboxProcess
from sandlot.backends.bwrap import _seccomp
from sandlot.backends.bwrap._compile import ETC_ENTRIES, HostLayout
from sandlot.egress import EgressLease
from sandlot.policy import Resources, SandboxSpec
from sandlot.seccomp import DENIED, denied_names
from sandlot.templates import Template, cache_dir

log = logging.getLogger("sandlot.backend")

START_TIMEOUT = 30.0
MIN_VERSION = (0, 8, 0)  # --disable-userns, --size for tmpfs

HOST_FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap) and allow unprivileged user namespaces "
    "(sysctl -w kernel.unprivileged_userns_clone=1 where that sysctl exists; "
    "sysctl -w user.max_user_namespaces=15000 if it is 0; on Ubuntu >= 23.10 also "
    "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for "
    "bwrap; inside Docker, run the container with --security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined or use sandlot's docker backend)"
)


def bwrap_path() -> str | None:
    """The bwrap binary: ``$SANDLOT_BWRAP`` if set (and then only that), else PATH."""
    configured = os.environ.get("SANDLOT_BWRAP")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def _version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, timeout=10, env={}
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else None


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def probe_host() -> Probe:
    details: dict[str, str] = {}
    bwrap = bwrap_path()
    if bwrap is None:
        where = os.environ.get("SANDLOT_BWRAP") or "PATH"
        return Probe(
            "bwrap",
            False,
            f"bubblewrap (bwrap) is not installed (looked in {where})",
            HOST_FIX,
            10,
            details,
        )
    version = _version(bwrap)
    details["bwrap"] = f"{bwrap} {'.'.join(map(str, version or ()))}"
    if version is None or version < MIN_VERSION:
        return Probe(
            "bwrap",
            False,
            f"bubblewrap {'.'.join(map(str, version or ())) or '?'} is too old; sandlot needs "
            f">= {'.'.join(map(str, MIN_VERSION))}",
            "upgrade bubblewrap (Debian 12 and Ubuntu 24.04 ship a recent enough one)",
            10,
            details,
        )
    for knob in (
        "kernel.unprivileged_userns_clone",
        "user.max_user_namespaces",
        "kernel.apparmor_restrict_unprivileged_userns",
    ):
        value = _sysctl(knob)
        if value is not None:
            details[knob] = value
    # The real test: start a minimal sandbox with every namespace sandlot uses.
    argv = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--disable-userns",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        *_root_args(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(1 << 20),
        "--tmpfs",
        "/tmp",
        "--",
        "/usr/bin/true",
    ]
    ids = None
    drop = None
    try:
        if os.geteuid() == 0:
            # As a uid sandboxes will run as (root gives each its own unprivileged one).
            # Without a usable range the probe still tests bwrap (as nobody) and passes:
            # bwrap works, and every start refuses with the fix (IsolationUnavailable)
            # rather than "auto" quietly picking another backend.
            try:
                id_range = _hostids.configured_range()
                details["sandbox host ids"] = f"one pair per live sandbox: {id_range.describe()}"
                ids = host_ids()
                drop = ids.pair if ids is not None else None
            except IsolationUnavailable as exc:
                details["sandbox host ids"] = f"UNAVAILABLE, sandboxes will not start: {exc}"
                drop = (PROBE_UID, PROBE_UID)
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=20,
            env={},
            preexec_fn=Enter((), drop),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        fix = HOST_FIX
        if drop is not None and isinstance(exc, subprocess.SubprocessError):
            fix = (
                f"sandlot runs as root here and starts each sandbox as a host uid of its own "
                f"(this one: {drop[0]}), but could not switch to it (is this a user namespace "
                f"without those uids mapped?); delegate ids that exist here: "
                f"{_hostids.RANGE_FIX}"
            )
        return Probe("bwrap", False, f"bwrap self-test failed: {exc}", fix, 10, details)
    finally:
        if ids is not None:
            ids.release()  # run() waited: nothing runs as it any more
    if result.returncode != 0:
        reason = result.stderr.strip() or f"exit status {result.returncode}"
        return Probe(
            "bwrap", False, f"bwrap cannot create namespaces here: {reason}", HOST_FIX, 10, details
        )
    details["namespaces"] = "user, pid, net, ipc, uts, mount: ok"
    return Probe("bwrap", True, "", "", 10, details)


def _root_args() -> list[str]:
    args: list[str] = []
    links, dirs = _root_layout()
    for path, target in sorted(links.items()):
        args += ["--symlink", target, path]
    for path in dirs:
        args += ["--ro-bind", path, path]
    return args


@functools.lru_cache(maxsize=1)
def _root_layout() -> tuple[dict[str, str], tuple[str, ...]]:
    """Which of /bin, /sbin, /lib* are symlinks into /usr (merged /usr) or real dirs."""
    links: dict[str, str] = {}
    dirs: list[str] = []
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            dirs.append(path)
    return links, tuple(dirs)


def say(line: str) -> None:
    # A first Sandbox() may build the template (about a minute); say so on stderr
    # rather than look hung.
    print(f"sandlot: {line}", file=sys.stderr, flush=True)


class StderrTail:
    """Keeps the last lines bwrap and the runner wrote to stderr, for error messages.

    Bounded in lines and in line length: code in the sandbox may be able to write to
    this pipe, and must not make the host buffer an endless line.
    """

    MAX_LINE = 1000

    def __init__(self, stream: Any) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: Any) -> None:
        partial = b""
        try:
            while chunk := stream.read1(65536):
                *complete, partial = (partial + chunk).split(b"\n")
                for line in complete:
                    self.lines.append(line[: self.MAX_LINE].decode("utf-8", "replace"))
                partial = partial[: self.MAX_LINE]
            if partial:
                self.lines.append(partial.decode("utf-8", "replace"))
        finally:
            # EOF: the sandbox is gone. Close the pipe here instead of leaving it to the
            # garbage collector, which held the fd until then and raised ResourceWarning.
            stream.close()

    def __call__(self) -> str:
        return "\n".join(self.lines)


class _Spawner:
    """Starts every bwrap process from one thread that lives as long as this process.

    ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, and Linux delivers it when the
    *thread* that forked the child exits, not the process. Popen'ed from the caller's
    thread, a sandbox created in a short-lived thread (a worker, a request handler,
    ``asyncio.to_thread``) was killed the moment that thread ended, and the next call
    silently started a new, empty one. From this thread, the sandbox still dies with
    the process (SIGKILL included), which is what --die-with-parent is for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[subprocess.Popen[bytes]], list[str], Any]]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        done: Future[subprocess.Popen[bytes]] = Future()
        with self._lock:
            # Not alive after os.fork() in a child process: start one there too.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="sandlot-bwrap-spawner", daemon=True
                )
                self._thread.start()
            self._jobs.put((done, argv, kwargs))
        return done.result()

    def _serve(self) -> None:
        while True:
            done, argv, kwargs = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)


SPAWNER = _Spawner()


def host_layout(
    template: Template,
    drop: tuple[int, int] | None,
    *,
    channel_fd: int,
    seccomp_fd: int,
    egress_socket: str | None = None,
    userns_fd: int | None = None,
) -> HostLayout:
    """The host paths a sandbox of ``template`` is built from (checked readable by the
    uid sandboxes run as, when sandlot runs as root)."""
    runtime = _runtime_dirs(drop is not None)
    if drop is not None:
        _check_reachable(drop, [template.path, template.base_prefix, *runtime])
    links, dirs = _root_layout()
    return HostLayout(
        template_dir=str(template.path),
        base_prefix=str(template.base_prefix),
        protocol_dir=str(runtime[0]),
        runner_dir=str(runtime[1]),
        generated_etc_dir=str(runtime[2]),
        root_symlinks=links,
        root_dirs=dirs,
        etc_entries=[p for p in ETC_ENTRIES if os.path.exists(p)],
        channel_fd=channel_fd,
        seccomp_fd=seccomp_fd,
        egress_socket=egress_socket,
        userns_fd=userns_fd,
    )


class _ForkedSandbox:
    """A zygote-made sandbox's pid 1, seen from the host: not our child, so it is
    watched and signalled through a pidfd (no pid-reuse race). The pidfd stays open
    until this object is collected: the handle's waiter thread and ``kill()`` may wait
    on it at the same time, and closing it under one of them could let the number be
    reused by an unrelated file."""

    is_pid_namespace_init = True
    """Its death ends every process of the sandbox (the kernel kills its pid namespace)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._exited = False
        # Not at interpreter exit: daemon threads may still be waiting on it then.
        weakref.finalize(self, os.close, self._pidfd).atexit = False

    def exit_fd(self) -> int:
        """The pidfd: readable once the sandbox's pid 1 has exited (the handle's exit is
        watched through it by the process-wide reaper, not by a thread of its own)."""
        return self._pidfd

    def kill(self) -> None:
        if not self._exited:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def running(self) -> bool:
        """Still alive (when it has exited, every process of its pid namespace has too)."""
        if not self._exited:
            self._exited = _readable(self._pidfd, 0)
        return not self._exited

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited:
            if not _readable(self._pidfd, timeout):
                raise subprocess.TimeoutExpired(f"sandbox {self.pid}", timeout or 0)
            self._exited = True
        return -signal.SIGKILL


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` becomes readable within ``timeout`` seconds (None: no limit).

    poll(), not select(): a process with a thousand sandboxes has descriptors past
    select()'s 1024, which it refuses outright."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


class BwrapHandle(ChannelHandle):
    """A bwrap sandbox: the channel, plus its cgroup (read for usage, removed at the end)
    and its host ids (given back once nothing of it runs any more)."""

    def __init__(
        self,
        sock: socket.socket,
        process: SandboxProcess,
        *,
        stderr_tail: Any,
        cgroup: _cgroups.SandboxCgroup | None,
        egress: EgressLease | None = None,
        exit_reason: Callable[[int], str] | None = None,
        resources: Resources | None = None,
        ids: _hostids.HostIds | Any | None = None,
        checkpointer: Callable[[BwrapHandle, str], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._cgroup = cgroup
        self._egress = egress
        self._host_ids = ids
        self._checkpointer = checkpointer
        self._on_release = on_release
        super().__init__(
            sock,
            process,
            stderr_tail=stderr_tail,
            on_exit=self._release,
            exit_reason=exit_reason,
            resources=resources,
        )

    def kill(self) -> None:
        # Every process of the sandbox at once: SIGKILL to pid 1 alone ends the others
        # only after pid 1 has torn down its own address space, one after the other;
        # together they exit in parallel and the reaper is done sooner. Not needed when
        # the process is the sandbox's pid 1 (a zygote's fork): its death ends every
        # process of its pid namespace, and kill() does not wait for them anyway.
        if self._cgroup is not None and self.alive and not self._process_is_init:
            self._cgroup.kill_all()
        super().kill()
        # The rest of the release waits for the reaper; the sandbox's door to the egress
        # proxy closes now, so nothing reaches the network in its name after kill().
        if self._egress is not None:
            self._egress.close()

    @property
    def _process_is_init(self) -> bool:
        return bool(getattr(self._process, "is_pid_namespace_init", False))

    @property
    def process(self) -> SandboxProcess:
        """The host process whose death ends the sandbox (bwrap, or its pid 1)."""
        return self._process

    def checkpoint(self, dest: str) -> None:
        if self._checkpointer is None:
            raise CheckpointError(
                "this sandbox cannot be checkpointed: it was not started checkpointable "
                "(Sandbox(checkpointable=True), a bubblewrap cold start as root with CRIU)"
            )
        self._checkpointer(self, dest)

    def _release(self) -> None:
        if self._on_release is not None:
            self._on_release()
        if self._egress is not None:
            self._egress.close()
        if self._cgroup is not None and not self._cgroup.destroy():
            # Processes may be left in it: keep its uid until this process exits (the
            # allocator also skips a uid that any process still runs as).
            log.error("could not remove the sandbox cgroup %s", self._cgroup.name)
            return
        if self._host_ids is not None:
            self._host_ids.release()

    def network_events(self, settle: float = 0.0) -> list[NetworkEvent] | None:
        return None if self._egress is None else self._egress.events(settle)

    def usage(self) -> ResourceUsage | None:
        return None if self._cgroup is None else self._cgroup.usage()

    def usage_counters(self) -> ResourceUsage | None:
        return None if self._cgroup is None else self._cgroup.counters()

    def recovery_token(self) -> RecoveryToken | None:
        # The host process whose death ends the sandbox (bwrap, or a zygote-made
        # sandbox's pid 1), with its start time so a reused pid is never mistaken for it.
        pid = self._process.pid
        if not isinstance(pid, int) or isinstance(pid, bool) or not self.alive:
            return None
        started = process_start_time(pid)
        return None if started is None else {"pid": pid, "start": started}


def reap(token: Mapping[str, Any]) -> bool:
    """SIGKILL the process a :meth:`BwrapHandle.recovery_token` names, if it is still
    the same process (same pid and start time); True if it was killed.

    The pid is pinned with a pidfd before its start time is compared, so the signal
    cannot reach a process that took the pid in between. Killing bwrap (or a forked
    sandbox's pid 1) ends the sandbox's pid namespace, and with it everything inside.
    """
    pid, started = token.get("pid"), token.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False
    if not isinstance(started, str):
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone (or not ours to see)
    try:
        if process_start_time(pid) != started:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def checks() -> list[Finding]:
    """``sandlot doctor``'s bubblewrap findings beyond the probe: which host uid
    sandboxes run as, and whether the syscall filter compiles (libseccomp)."""
    return [_running_as(), _seccomp_finding()]


def _running_as() -> Finding:
    if os.geteuid() != 0:
        return Finding(
            "running as",
            "info",
            f"uid {os.geteuid()}; sandboxes run as this uid, with no capabilities, and share "
            "its per-user kernel quotas (SECURITY.md)",
        )
    try:
        id_range = _hostids.configured_range()
    except IsolationUnavailable as exc:
        return Finding("running as", "missing", f"root; {exc}", _hostids.RANGE_FIX)
    return Finding(
        "running as",
        "info",
        "root; each sandbox runs as an unprivileged host uid and gid of its own, with no "
        f"capabilities ({id_range.describe()})",
    )


def _seccomp_finding() -> Finding:
    try:
        program = _seccomp.filter_program()
    except IsolationUnavailable as exc:
        return Finding("seccomp", "missing", str(exc), _seccomp.LIBSECCOMP_FIX)
    rules = len(DENIED) - len(denied_names())
    return Finding(
        "seccomp",
        "ok",
        f"libseccomp filter ({len(program) // 8} BPF instructions): {len(denied_names())} "
        f"syscalls denied outright, {rules} argument rules "
        "(namespace clone flags, raw/netlink/packet sockets, TIOCSTI, personality); "
        "installed in every sandbox",
    )


class Enter:
    """``preexec_fn``: runs in the forked child before it execs bwrap.

    1. Join the sandbox's cgroups (writing "0" to ``cgroup.procs``, or on v1 to
       ``tasks``, moves the writer: this child has one thread), so bwrap and everything
       it starts is limited from its first instruction.
    2. Set ``rlimits`` (the zygote's: room for every sandbox it forks, see
       :mod:`._zygote`); raising a hard limit works only as root.
    3. When sandlot runs as root, become the sandbox's own unprivileged uid/gid (from
       :func:`host_ids`) with no supplementary groups. bwrap then creates the user
       namespace as that uid: the sandbox's uid 1000 is that host uid, not root, and
       the kernel's per-user quotas, RLIMIT_NPROC and signal permissions apply to it
       like to any user, apart from every other sandbox's.

    Only system calls on values prepared by the parent: no allocation-heavy work
    between fork and exec.
    """

    def __init__(
        self,
        cgroup_fds: tuple[int, ...],
        drop: tuple[int, int] | None,
        rlimits: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.cgroup_fds = cgroup_fds
        self.drop = drop
        self.rlimits = rlimits

    def __call__(self) -> None:
        for fd in self.cgroup_fds:
            os.write(fd, b"0")
        for which, value in self.rlimits:
            resource.setrlimit(which, (value, value))
        if self.drop is not None:
            uid, gid = self.drop
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)


REAP_WAIT = 10.0
"""Seconds a start short of host ids waits for killed sandboxes to give theirs back."""

PROBE_UID = 65534
"""``nobody``: what the probe runs its throwaway sandbox as when no range is delegated."""


def host_ids() -> _hostids.HostIds | None:
    """The host uid and gid for one new sandbox (or zygote), held until released; None
    when sandlot is not root (sandboxes then run as this process's own uid).

    As root, every sandbox gets a pair of its own from the delegated range (see
    :mod:`sandlot.backends._hostids`): the kernel's per-user quotas (inotify, message
    queues, pending signals) are then per sandbox. No range, or none free:
    IsolationUnavailable, never a shared uid."""
    if os.geteuid() != 0:
        return None
    lock_dir = os.environ.get(_hostids.LOCK_DIR_ENV) or _hostids.DEFAULT_LOCK_DIR
    allocator = _allocator(_hostids.configured_range(), lock_dir)
    try:
        return allocator.acquire()
    except _hostids.HostIdsExhausted:
        # kill() does not wait for a sandbox to be reaped: the ids of one killed a moment
        # ago come back once the reaper is done with it (milliseconds). Wait for that
        # before refusing (no wait when nothing is being torn down).
        if not _reaper.drain(REAP_WAIT):
            raise
        return allocator.acquire()


@functools.lru_cache(maxsize=4)
def _allocator(id_range: _hostids.HostIdRange, lock_dir: str) -> _hostids.HostIdAllocator:
    return _hostids.HostIdAllocator(id_range, lock_dir)


def _runtime_dirs(stage: bool) -> tuple[Path, Path, Path]:
    """The protocol, runner and generated-/etc directories to bind into sandboxes.

    Normally the installed package's own. When sandboxes run as another uid (sandlot
    started as root), a copy in the cache: the package may sit where that uid cannot
    read it (a virtualenv under a 0700 ``/root``). The copy is keyed by content, made
    once, and made atomically (rename), so concurrent starts agree on it.
    """
    here = Path(__file__).parent
    sources = (
        Path(sandlot.protocol.__file__).parent,
        Path(sandlot.runner.__file__).parent,
        here / "etc",
    )
    if not stage:
        return sources
    digest = hashlib.sha256()
    files: list[tuple[int, Path]] = []
    for i, src in enumerate(sources):
        for path in sorted(src.iterdir()):
            if (path.is_file() and path.suffix in (".py", "")) or path.name.endswith(".conf"):
                files.append((i, path))
                digest.update(f"{i}/{path.name}\0".encode() + path.read_bytes() + b"\0")
    target = cache_dir() / "runtime" / digest.hexdigest()[:16]
    names = ("protocol", "runner", "etc")
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(target.parent, 0o755)
        staging = Path(tempfile.mkdtemp(prefix=".stage-", dir=target.parent))
        try:
            for name in names:
                (staging / name).mkdir()
            for i, path in files:
                shutil.copyfile(path, staging / names[i] / path.name)
            for path in staging.rglob("*"):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            os.chmod(staging, 0o755)
            try:
                os.rename(staging, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return (target / "protocol", target / "runner", target / "etc")


def _check_reachable(drop: tuple[int, int], paths: list[Path]) -> None:
    """Fail closed, naming the fix, if the sandbox's host uid cannot read ``paths``."""
    uid, gid = drop
    for path in paths:
        for part in [*reversed(path.parents), path]:
            st = os.stat(part)
            if st.st_uid == uid:
                bits = st.st_mode >> 6
            elif st.st_gid == gid:
                bits = st.st_mode >> 3
            else:
                bits = st.st_mode
            if not bits & 1 or (part == path and not bits & 4):
                raise IsolationUnavailable(
                    f"sandboxes run as host uid {uid} (sandlot is running as root) and that "
                    f"uid cannot read {path} (blocked at {part}). Fix: keep templates in a "
                    f"directory other users can read: unset SANDLOT_CACHE_DIR and "
                    f"XDG_CACHE_HOME to use /var/cache/sandlot, or chmod o+rx the path"
                )


def cgroup_for(spec: SandboxSpec) -> _cgroups.SandboxCgroup | None:
    """The sandbox's cgroup, or None only when the caller opted into best effort."""
    try:
        return _cgroups.SandboxCgroup.create(spec.resources)
    except IsolationUnavailable:
        if spec.unsafe_best_effort_limits:
            return None
        raise


_SWEPT = False


def sweep_once() -> None:
    """Remove cgroups left by sandlot processes that were SIGKILLed (first start only)."""
    global _SWEPT
    if not _SWEPT:
        _SWEPT = True
        with contextlib.suppress(Exception):
            _cgroups.sweep_orphans()


def cleanup_orphans() -> list[str]:
    """Remove the sandbox cgroups of sandlot processes that died without cleaning up
    (their bwrap processes died with them: ``--die-with-parent``); ``[]`` on a host
    without usable cgroups."""
    return [f"cgroup {name}" for name in _cgroups.sweep_orphans()]
