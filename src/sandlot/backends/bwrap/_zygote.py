"""The zygote backend: bubblewrap sandboxes forked from a process that has the data
stack imported, instead of started cold.

One zygote per (template, preload list, host uid) lives as long as this process (see
:mod:`sandlot.runner._zygote` for what runs inside it and what each fork sets up).
The host's side of a spawn:

1. hand the zygote one end of a new socketpair; it forks the sandbox's pid 1 in
   fresh namespaces;
2. meanwhile, create the sandbox's cgroup, exactly as for a cold sandbox (same limits);
3. read that process's SCM_CREDENTIALS from the socket: the kernel translates its pid
   into ours, so we know which process it is without trusting anything it says;
4. move it into the cgroup (cgroup v2), or send it the cgroup's ``tasks`` files with
   the configuration so that it moves itself in as a thread, which skips the kernel's
   global lock and its RCU grace period (v1); then the runner's ``configure`` message
   as for a cold sandbox. The runner answers ``ready`` once its kernel (a fork of
   itself) runs, and on v1 the host checks the move before it hands the sandbox out.

From there the handle is an ordinary :class:`BwrapHandle`: the same channel, cgroup
usage, OOM reports and teardown (the cgroup is emptied and removed).

Sandboxes with a network policy start cold (the zygote cannot mount their egress
socket), as does a spec in ``unsafe_best_effort_limits`` mode (the zygote needs a
cgroup to move each sandbox into). They get the same boundary, only slower.

Per-user kernel quotas (inotify instances and watches, message queue bytes, pending
signals) are charged to the host uid that created the zygote's user namespace, for
every sandbox it forks, whatever uid they run as (see :mod:`sandlot.runner._zygote`).
So a zygote runs as a host uid of its own (as root, from the same allocator as cold
sandboxes), splits that uid's quotas into :func:`shares`, gives each sandbox one in
its own user namespace, and forks at most as many live sandboxes as there are shares;
the next ones start cold, each as a uid of its own.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

from sandlot._exceptions import BackendUnavailable, SandboxStartError
from sandlot.backends import _cgroups, _hostids
from sandlot.backends._base import Backend, Finding, Probe, SandboxHandle
from sandlot.backends.bwrap import BwrapBackend, _host, _seccomp
from sandlot.backends.bwrap._compile import build_zygote_argv, runner_config
from sandlot.backends.bwrap._host import (
    SPAWNER,
    START_TIMEOUT,
    BwrapHandle,
    Enter,
    StderrTail,
    _ForkedSandbox,
    _readable,
    bwrap_path,
    cgroup_for,
    host_ids,
    host_layout,
    probe_host,
    say,
    sweep_once,
)
from sandlot.backends.bwrap._quotas import can_raise_limits, shares
from sandlot.egress import EgressProxy
from sandlot.policy import DATA_STACK, MiB, Resources, SandboxSpec
from sandlot.protocol import PROTOCOL_VERSION, encode
from sandlot.protocol.layout import HOME
from sandlot.templates import ensure_template

log = logging.getLogger("sandlot.backend")

ZYGOTE_START_TIMEOUT = 120.0
"""Seconds a zygote may take to import its preload modules (cold caches, busy host)."""
ZYGOTE_RESOURCES = Resources(memory_mb=1024, pids=64, cpus=None, disk_mb=32, tmp_mb=1)
"""The zygote's own cgroup and scratch space: it imports modules and forks, nothing
else; each sandbox leaves this cgroup for its own before it is configured."""
ZYGOTE_MIN_ROOM = 16 * MiB
"""Memory the zygote's cgroup must have left (at least this, or a sixteenth of its
limit) before it forks another sandbox. Every live sandbox keeps a few MiB charged
there (pages its first process and the zygote copied before it moved to its own
cgroup), and at the limit the kernel's OOM killer would pick the zygote, killing every
sandbox it made; short of room, sandboxes start cold instead."""
KERNEL_HEADROOM = 128 * MiB
"""Address space a forked kernel needs beyond the zygote's to run cells at all: a
sandbox whose ``memory_mb`` (its per-process RLIMIT_AS) leaves less starts cold."""
_UCRED = struct.Struct("iII")


class _ZygoteFull(Exception):
    """The zygote's cgroup has no room for another sandbox's first process, every share
    of its uid's quotas is taken, or the sandbox's memory limit leaves its forked
    processes no room: start it cold (or in another zygote, unless ``any_zygote``)."""

    def __init__(self, any_zygote: bool = False) -> None:
        super().__init__()
        self.any_zygote = any_zygote
        """True when no zygote could fork this sandbox (its own memory limit is the
        reason), so trying or starting another zygote is pointless."""


class Zygote:
    """One fork server: its bwrap process, control socket and cgroup."""

    def __init__(self, template: str, preload: tuple[str, ...]) -> None:
        self.template = template
        self.preload = preload
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        """A pidfd of :attr:`_process`: whether it runs is read from it without reaping it."""
        self._reap_lock = threading.Lock()
        """Held while :attr:`_process` is reaped (only :meth:`_stop` reaps it) and while
        its pid is written to a ``cgroup.procs`` file (:meth:`_prime_cgroup_move`): the
        pid cannot be reaped, and so cannot be another process's, in the meantime."""
        self._control: socket.socket | None = None
        self._cgroup: _cgroups.SandboxCgroup | None = None
        self._tail: StderrTail | None = None
        self._host_ids: _hostids.HostIds | None = None
        self._shares = shares(can_raise_limits())
        self._forks: list[_ForkedSandbox] = []
        self._pending = 0
        """Forks requested whose process is not in :attr:`_forks` yet (each holds a share)."""
        self._abandoned: set[str] = set()
        """Ids of spawn requests whose replies have not been read (given up on after
        the control socket's timeout): skipped when they come."""
        self._closed = False
        self._retired = False
        self._last_spawn = time.monotonic()
        self._starting: socket.socket | None = None
        """The control socket while :meth:`_start` waits for the zygote's ``ready``
        (so that :meth:`close` can cut the wait short)."""
        self.vm_bytes = 0
        """The zygote's address space size, which each forked process starts with."""

    @property
    def alive(self) -> bool:
        # Not Popen.poll(): that would reap it, which only _stop() does (_reap_lock).
        pidfd = self._pidfd
        return self._process is not None and pidfd is not None and not _readable(pidfd, 0)

    @property
    def closed(self) -> bool:
        """True once ``close(final=True)`` ran: the zygote will not start again."""
        return self._closed

    def start(self) -> None:
        """Start the zygote now, if it is not running (:meth:`spawn` does so on first
        use)."""
        with self._lock:
            if not self.alive:
                self._stop()
                self._start()

    def _start(self) -> None:
        if self._closed:
            raise SandboxStartError("the zygote was stopped (sandlot is shutting down)")
        bwrap = bwrap_path()
        assert bwrap is not None
        template = ensure_template(self.template, progress=say)
        sweep_once()
        self._abandoned.clear()  # a new zygote: no reply of the last one will come
        spec = SandboxSpec(template=self.template, resources=ZYGOTE_RESOURCES)
        # The zygote's own host ids, for its whole life: its sandboxes' quotas are
        # charged to them (module docstring), so they are shared with nothing else.
        ids = host_ids()
        drop = ids.pair if ids is not None else None
        with contextlib.ExitStack() as cleanup:
            failed = cleanup.enter_context(contextlib.ExitStack())
            if ids is not None:
                failed.callback(ids.release)  # last: once nothing runs in its cgroup
            group = _cgroups.SandboxCgroup.create(spec.resources)
            failed.callback(group.destroy)
            cleanup.callback(group.close_fds)
            own_filter = _seccomp.program_fd(zygote=True)
            cleanup.callback(os.close, own_filter)
            children_filter = _seccomp.program_fd()
            cleanup.callback(os.close, children_filter)
            control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cleanup.callback(theirs.close)
            failed.callback(control.close)
            layout = host_layout(template, drop, channel_fd=theirs.fileno(), seccomp_fd=own_filter)
            argv = build_zygote_argv(spec, layout, children_filter, bwrap=bwrap)
            try:
                process = SPAWNER.popen(
                    argv,
                    env={},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(theirs.fileno(), own_filter, children_filter),
                    close_fds=True,
                    preexec_fn=Enter(group.attach_fds, drop, self._shares.zygote_rlimits),
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxStartError(f"could not start the zygote: {exc}") from exc
            failed.callback(process.wait)
            failed.callback(process.kill)
            pidfd = os.pidfd_open(process.pid)  # not reaped yet: it is this process
            failed.callback(os.close, pidfd)
            assert process.stderr is not None
            tail = StderrTail(process.stderr)
            control.settimeout(ZYGOTE_START_TIMEOUT)
            self._starting = control
            try:
                if self._closed:  # close(final=True) ran before it could see the socket
                    raise OSError("stopped while starting")
                control.send(json.dumps({"type": "configure", "preload": self.preload}).encode())
                ready = json.loads(control.recv(65536) or b"{}")
            except (OSError, ValueError) as exc:
                raise SandboxStartError(
                    f"the zygote did not become ready ({exc}): {tail()}"
                ) from exc
            finally:
                self._starting = None
            self.vm_bytes = int(ready.get("vm_bytes") or 0)
            if ready.get("type") != "ready" or ready.get("version") != PROTOCOL_VERSION:
                raise SandboxStartError(f"the zygote did not start: {ready!r} {tail()}")
            control.settimeout(START_TIMEOUT)
            failed.pop_all()
        self._process, self._control, self._cgroup, self._tail = process, control, group, tail
        self._host_ids = ids
        self._pidfd = pidfd

    def spawn(self, spec: SandboxSpec) -> SandboxHandle:
        with contextlib.ExitStack() as failed:
            host_sock, child_sock = socket.socketpair()
            # Closed on failure: a sandbox forked meanwhile then reads the end of its
            # channel instead of a configuration, and exits.
            failed.callback(host_sock.close)
            with child_sock:
                host_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                # The sandbox's settings go on its own channel, read by the fork: the
                # zygote never holds them, so no later sandbox inherits a copy.
                host_sock.sendall(self._setup_frame(spec))
                self._request_fork(spec, child_sock.fileno())  # reserves a share
            try:
                # While the zygote forks: the sandbox's cgroup, then (where we move the
                # sandbox, v2) the no-op move (after the mkdir, which would wait for the
                # kernel's cgroup mutex the move holds while it waits).
                group = cgroup_for(spec)
                assert group is not None  # best-effort specs start cold (the backend)
                failed.callback(group.destroy)
                tasks = group.open_thread_attach()
                if tasks is not None:
                    failed.callback(_close_all, tasks)
                elif self.alive:
                    _PRIMER.poke(self)
                pid = _sandbox_pid(host_sock)
                process = _ForkedSandbox(pid)
            finally:
                with self._lock:
                    self._pending -= 1
            with self._lock:
                self._forks.append(process)  # holds its share until it exits
            try:
                failed.callback(process.wait, 10)
                failed.callback(process.kill)
                # The pidfd pins the process; it must still be the zygote's fresh child,
                # in the zygote's cgroup (not a process that took a dead one's pid).
                if pid not in self._cgroup_pids():
                    raise ProcessLookupError(pid)
                configure = encode(
                    {"type": "configure", "id": "configure", "config": runner_config(spec, 0)}
                )
                if tasks is None:  # v2: moved by us, then the configuration
                    for fd in group.attach_fds:
                        os.write(fd, str(pid).encode())
                    host_sock.sendall(MOVED + configure)
                else:  # v1: it moves itself (no global lock), then reads the configuration
                    rights = array.array("i", tasks).tobytes()
                    host_sock.sendmsg(
                        [MOVE_YOURSELF + configure],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)],
                    )
                group.close_fds()
            except OSError as exc:
                raise SandboxStartError(
                    f"the zygote's sandbox died while starting ({exc})"
                ) from exc
            handle = BwrapHandle(
                host_sock,
                process,
                stderr_tail=lambda: "",
                cgroup=group,
                exit_reason=lambda code: "the sandbox exited",
                resources=spec.resources,
            )
            if tasks is not None:
                _close_all(tasks)
            failed.pop_all()
        handle.wait_ready(START_TIMEOUT)
        if tasks is not None and not group.holds(pid):
            # It says ready only once it moved itself; no user code has run yet. A
            # sandbox outside its own cgroup would be outside its limits: refuse it.
            handle.kill()
            raise SandboxStartError(
                "the zygote's sandbox is not in its own cgroup after starting; refused"
            )
        return handle

    def _setup_frame(self, spec: SandboxSpec) -> bytes:
        """The new sandbox's settings as ``runner/_zygote.py``'s ``read_setup`` reads them."""
        r = spec.resources
        setup = {
            "mounts": [
                ["/tmp", _bytes(r.tmp_mb), "1777"],
                ["/dev/shm", _bytes(r.tmp_mb), "1777"],
                [HOME, _bytes(r.disk_mb), "0755"],
            ],
            "hostname": "sandlot",
            "quotas": self._shares.request(),
        }
        body = json.dumps(setup).encode()
        return struct.pack(">I", len(body)) + body

    def _request_fork(self, spec: SandboxSpec, fd: int) -> None:
        r = spec.resources
        with self._lock:
            if self._retired:
                raise _ZygoteFull  # retired meanwhile (idle): another one, or cold
            if not self.alive:
                self._stop()
                self._start()
            assert self._control is not None and self._cgroup is not None
            if r.memory_mb is not None and r.memory_mb * MiB < self.vm_bytes + KERNEL_HEADROOM:
                raise _ZygoteFull(any_zygote=True)
            self._forks = [fork for fork in self._forks if fork.running()]
            if len(self._forks) + self._pending >= self._shares.sandboxes:
                raise _ZygoteFull  # every share of its uid's quotas is taken
            memory = _cgroups.memory_use(self._cgroup.host.version, self._cgroup.paths)
            if memory is not None:
                used, limit = memory
                if limit - used < max(ZYGOTE_MIN_ROOM, limit // 16):
                    raise _ZygoteFull
            self._pending += 1  # spawn() gives it back once the fork is counted or failed
            # Random, not a count: the zygote's memory (which the next fork inherits)
            # then says nothing of how many sandboxes it made before.
            rid = secrets.token_hex(8)
            self._abandoned.add(rid)  # until its reply is read
            self._last_spawn = time.monotonic()
            request = {"type": "spawn", "id": rid}
            fds = array.array("i", [fd])
            try:
                self._control.sendmsg(
                    [json.dumps(request).encode()],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())],
                )
                reply = json.loads(self._control.recv(65536) or b"{}")
                # Replies to requests given up on earlier (the zygote answered after the
                # timeout) come first; their sandboxes found their channel closed and exited.
                while reply.get("id") != rid and reply.get("id") in self._abandoned:
                    self._abandoned.discard(reply["id"])
                    reply = json.loads(self._control.recv(65536) or b"{}")
                self._abandoned.discard(rid)
            except (OSError, ValueError) as exc:
                self._pending -= 1
                raise SandboxStartError(f"the zygote failed ({exc}): {self._stderr()}") from exc
            if reply.get("type") != "spawned" or reply.get("id") != rid:
                self._pending -= 1
                raise SandboxStartError(
                    f"the zygote could not fork a sandbox: {reply.get('message')}"
                )

    def _prime_cgroup_move(self) -> None:
        """Make the kernel wait now, while a sandbox is being made, for what the new
        sandbox's move into its cgroup would otherwise wait for afterwards.

        A process's first move between cgroups after a quiet spell waits for an RCU
        grace period (the kernel's cgroup-migration lock switching to its slow mode,
        about 6 ms here, more on a loaded host), and for about one more after the last
        move it does not. Moving the zygote into the cgroup it is already in is a no-op
        that takes that wait; run by :data:`_PRIMER` once :meth:`spawn` has asked for
        the fork and made the sandbox's cgroup, it overlaps the fork and the new
        sandbox's namespaces and holds no lock of ours that a spawn needs (it holds the
        kernel's cgroup mutex), so the sandbox's own move finds the lock ready. An
        optimisation only: if the write fails, the move waits as before."""
        if not self._reap_lock.acquire(blocking=False):
            return  # being stopped (or primed already)
        try:
            process, group = self._process, self._cgroup
            if process is None or group is None or process.returncode is not None:
                return  # not running; else not reaped: its pid cannot be another process's
            for path in group.paths.values():
                with contextlib.suppress(OSError):
                    fd = os.open(f"{path}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        os.write(fd, str(process.pid).encode())
                    finally:
                        os.close(fd)
                return  # the lock is global: one hierarchy is enough
        finally:
            self._reap_lock.release()

    def _cgroup_pids(self) -> set[int]:
        return set() if self._cgroup is None else set(self._cgroup.pids())

    def _stderr(self) -> str:
        return self._tail() if self._tail is not None else ""

    def _stop(self) -> None:
        if self._control is not None:
            self._control.close()
        with self._reap_lock:  # a prime under way ends first (it writes the pid)
            self._stop_process()

    def _stop_process(self) -> None:
        if self._process is not None:
            with contextlib.suppress(OSError):
                self._process.kill()
            self._process.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._cgroup is not None:
            self._cgroup.destroy()
        if self._host_ids is not None:
            # Its sandboxes may still be exiting (they die with its pid namespace); the
            # allocator skips a uid while any process runs as it.
            self._host_ids.release()
        self._process = self._control = self._cgroup = self._tail = None
        self._host_ids = None
        self._forks = []

    def retire_if_idle(self, idle_for: float) -> bool:
        """Stop this zygote if none of its sandboxes runs, none is being forked, and it
        forked none for ``idle_for`` seconds; True if it was stopped. A spawn that
        finds it retired moves on to another zygote (or starts cold)."""
        if not self._lock.acquire(blocking=False):
            return False  # forking right now: not idle (and no caller should wait here)
        try:
            if self._retired:
                return True
            if self._pending or time.monotonic() - self._last_spawn < idle_for:
                return False
            self._forks = [fork for fork in self._forks if fork.running()]
            if self._forks:
                return False
            self._retired = True
            self._stop()
        finally:
            self._lock.release()
        return True

    def close(self, *, final: bool = False) -> None:
        """Kill the zygote, and with it every sandbox it made (they live in its pid
        namespace). The next spawn starts it again, unless ``final`` (the process is
        exiting: a background start that has not begun must not begin).

        A start under way (a zygote importing the data stack in the background) is cut
        short rather than waited for, so a process exits promptly."""
        if final:
            self._closed = True
        starting = self._starting
        if starting is not None:
            with contextlib.suppress(OSError):
                starting.shutdown(socket.SHUT_RDWR)  # its recv() returns; _start cleans up
        with self._lock:
            self._stop()


class _MovePrimer:
    """One background thread per process that runs :meth:`Zygote._prime_cgroup_move`
    when a spawn asks (:meth:`poke`); pokes that come while it runs are one (the
    kernel's lock is global).

    Only once per spawn, not over and over to keep the lock warm through a burst of
    starts: with several starts at once their own moves keep it warm, and a thread
    waking every few milliseconds cost more (the host's interpreter lock, the kernel's
    cgroup mutex, forks held up while each move waited) than it saved."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._zygote: Zygote | None = None
        self._thread: threading.Thread | None = None

    def poke(self, zygote: Zygote) -> None:
        with self._lock:
            self._zygote = zygote
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sandlot-cgroup-primer", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                zygote, self._zygote = self._zygote, None  # not kept alive by us
            if zygote is not None:
                zygote._prime_cgroup_move()


_PRIMER = _MovePrimer()


MOVED = b"\0"
"""The byte before a forked sandbox's configuration when the host has moved it into its
cgroup (v2)."""
MOVE_YOURSELF = b"\1"
"""The byte before a forked sandbox's configuration that carries its cgroup's ``tasks``
files (v1): it moves itself in before it reads on (``runner/_zygote.py``)."""


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _bytes(size_mb: int | None) -> int | None:
    return None if size_mb is None else size_mb * MiB


def _sandbox_pid(sock: socket.socket) -> int:
    """The host pid of the process that sent the first byte on ``sock`` (SO_PASSCRED)."""
    sock.settimeout(START_TIMEOUT)
    try:
        data, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(_UCRED.size))
    except OSError as exc:
        raise SandboxStartError(f"the zygote's sandbox did not start ({exc})") from exc
    finally:
        sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = _UCRED.unpack(payload[: _UCRED.size])
            if data == b"\0" and pid > 0:
                return int(pid)
    raise SandboxStartError(
        "the zygote's sandbox exited before it started (see the host's log for the "
        "zygote's messages)"
    )


MAX_ZYGOTES = 96
"""Zygotes per template and preload in one process. Each forks at most its
:func:`shares` of live sandboxes (its own host uid's per-user quotas, split), so a
process that keeps more sandboxes alive gets another zygote, with a uid of its own,
rather than cold starts: 96 zygotes of 15 shares is 1,440 fast sandboxes at once. Each
costs about 60 MiB (its imported data stack); all but the first of a key are stopped
once idle for :data:`RETIRE_AFTER` seconds."""

RETIRE_AFTER = 120.0
"""Seconds a zygote other than its key's first may go without sandboxes (none running,
none forked) before it is stopped; the next peak grows the key again."""

_ZYGOTES: dict[tuple[Any, ...], list[Zygote]] = {}
_GROWING: set[tuple[Any, ...]] = set()
"""Keys whose next zygote is starting in the background."""
_STARTING: set[Zygote] = set()
"""Zygotes being started in the background for :class:`ZygoteBackend` ``wait=False``."""
_FAILED_AT: dict[tuple[Any, ...], float] = {}
"""When a background start for a key last failed (``time.monotonic()``)."""
RETRY_AFTER = 60.0
"""Seconds after a failed background start before the next sandbox tries again (each
try costs a second of CPU; sandboxes start cold meanwhile, behind the same boundary)."""
_ZYGOTES_LOCK = threading.Lock()


def zygote_for(template: str, preload: tuple[str, ...]) -> Zygote:
    """The process-wide first zygote for ``template`` and ``preload`` (started on first
    use)."""
    return zygotes_for(template, preload)[0]


def zygotes_for(template: str, preload: tuple[str, ...]) -> list[Zygote]:
    """The zygotes for ``template`` and ``preload``, oldest first (at least one)."""
    key = (template, preload)
    with _ZYGOTES_LOCK:
        zygotes = _ZYGOTES.setdefault(key, [])
        if not zygotes:
            zygotes.append(Zygote(template, preload))
        return list(zygotes)


def _grow(template: str, preload: tuple[str, ...]) -> None:
    """Start one more zygote for the key in the background, unless one is starting or
    the key has :data:`MAX_ZYGOTES`; it joins the list once it is up. The caller starts
    its sandbox cold meanwhile (a zygote takes about a second to import the data stack,
    a cold sandbox without it well under that)."""
    key = (template, preload)
    with _ZYGOTES_LOCK:
        if key in _GROWING or len(_ZYGOTES.get(key, ())) >= MAX_ZYGOTES:
            return
        _GROWING.add(key)

    def start() -> None:
        zygote = Zygote(template, preload)
        try:
            zygote.start()
        except Exception:
            log.warning("could not start another zygote for %s", template, exc_info=True)
            zygote.close()
            return
        finally:
            with _ZYGOTES_LOCK:
                _GROWING.discard(key)
        with _ZYGOTES_LOCK:
            zygotes = _ZYGOTES.get(key)
            if zygotes is not None and len(zygotes) < MAX_ZYGOTES:
                zygotes.append(zygote)
                return
        zygote.close()  # close_all() ran meanwhile, or the key filled up

    threading.Thread(target=start, name="sandlot-zygote-grow", daemon=True).start()


def _retire_idle(template: str, preload: tuple[str, ...]) -> None:
    """Stop the key's extra zygotes that have been idle for :data:`RETIRE_AFTER`."""
    key = (template, preload)
    with _ZYGOTES_LOCK:
        extra = list(_ZYGOTES.get(key, [])[1:])
    retired = [zygote for zygote in extra if zygote.retire_if_idle(RETIRE_AFTER)]
    if retired:
        with _ZYGOTES_LOCK:
            group = _ZYGOTES.get(key)
            if group is not None:
                group[:] = [zygote for zygote in group if zygote not in retired]


def _start_soon(zygote: Zygote) -> None:
    """Start ``zygote`` in the background, unless it is starting already or a start for
    its key failed less than :data:`RETRY_AFTER` seconds ago."""
    key = (zygote.template, zygote.preload)
    with _ZYGOTES_LOCK:
        failed_at = _FAILED_AT.get(key)
        if zygote in _STARTING or (
            failed_at is not None and time.monotonic() - failed_at < RETRY_AFTER
        ):
            return
        _STARTING.add(zygote)

    def start() -> None:
        try:
            zygote.start()
        except Exception:
            if not zygote.closed:
                log.warning("could not start the zygote for %s", zygote.template, exc_info=True)
                with _ZYGOTES_LOCK:
                    _FAILED_AT[key] = time.monotonic()
        finally:
            with _ZYGOTES_LOCK:
                _STARTING.discard(zygote)

    threading.Thread(target=start, name="sandlot-zygote-start", daemon=True).start()


@atexit.register
def close_all() -> None:
    """Stop every zygote of this process (and so every sandbox they made)."""
    with _ZYGOTES_LOCK:
        zygotes = [zygote for group in _ZYGOTES.values() for zygote in group]
        _ZYGOTES.clear()
    for zygote in zygotes:
        zygote.close(final=True)


class ZygoteBackend(Backend):
    """bubblewrap sandboxes forked from a per-template zygote with the data stack
    imported: the cold start's boundary in milliseconds instead of a second."""

    name = "zygote"

    def __init__(
        self,
        *,
        preload: tuple[str, ...] = DATA_STACK,
        egress: EgressProxy | None = None,
        wait: bool = True,
    ) -> None:
        """``preload``: what the zygote imports for every sandbox (when the spec names
        none of its own). ``egress``: the proxy of sandboxes with a network policy (they
        start cold; default: the process-wide one). ``wait``: while no zygote for the
        template runs yet, wait for one to start (about a second: it imports the data
        stack), or, if False, start one in the background and start this sandbox cold
        (what ``"auto"`` does: a process's first sandbox is no slower than a cold one)."""
        self.preload = tuple(preload)
        self.wait = wait
        self._cold = BwrapBackend(egress=egress)

    @classmethod
    def for_auto(cls, egress: EgressProxy | None = None) -> Backend:
        return cls(egress=egress, wait=False)

    @classmethod
    def probe(cls) -> Probe:
        probe = probe_host()
        # Weaker than cold bwrap by design (SECURITY.md: siblings share the zygote's
        # host uid, address-space layout and stack canary), so "auto" never picks it
        # over bwrap on strength; bwrap names it as its fast path instead.
        return Probe("zygote", probe.available, probe.reason, probe.fix, 9, probe.details)

    # The same host layers and leftovers as a cold bwrap sandbox: its cgroups, and a
    # recovery token naming the forked sandbox's pid 1.
    @classmethod
    def checks(cls) -> list[Finding]:
        return _host.checks()

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        return _host.cleanup_orphans()

    @classmethod
    def reap(cls, token: Mapping[str, Any]) -> bool:
        return _host.reap(token)

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        probe = self.probe()
        if not probe.available:
            raise BackendUnavailable(
                f"zygote backend unavailable: {probe.reason}. Fix: {probe.fix}"
            )
        if spec.network.enabled or spec.unsafe_best_effort_limits:
            return self._cold.start(spec)
        preload = tuple(spec.preload) or self.preload
        _retire_idle(spec.template, preload)
        zygotes = zygotes_for(spec.template, preload)
        if not self.wait:
            running = [zygote for zygote in zygotes if zygote.alive]
            if not running:
                # Cold now, and the zygote for the next ones after that: started
                # together they would share the CPU and both be late.
                handle = self._cold.start(spec)
                _start_soon(zygotes[0])
                return handle
            zygotes = running
        for zygote in zygotes:
            try:
                return zygote.spawn(spec)
            except _ZygoteFull as full:
                if full.any_zygote:
                    return self._cold.start(spec)
        _grow(spec.template, preload)  # every zygote is full: the next sandboxes get one
        return self._cold.start(spec)
