"""Whole-sandbox resource limits with cgroups, v2 and v1.

rlimits bound one process; a cgroup bounds the sandbox: every process it starts
shares one memory limit (swap off), one pids limit and one CPU quota, and the
kernel counts out-of-memory kills and peaks for it.

Split like the rest of sandlot:

* :func:`plan` is pure: :class:`~sandlot.policy.Resources` -> the files to write per
  controller, for one cgroup version. Unit-tested without privileges.
* :func:`detect` reads ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` to find
  which version the host runs and where sandlot may create cgroups.
* :class:`SandboxCgroup` creates, fills, reads, empties and removes one sandbox's
  cgroup(s). The backend moves the sandbox's first process in before it execs
  (``attach_fds`` written from ``preexec_fn``), so nothing runs outside it.

Where sandbox cgroups live (``$SANDLOT_CGROUP_ROOT`` overrides, see SECURITY.md):

* v2: ``/sys/fs/cgroup/sandlot`` (root only; a user needs a delegated subtree);
* v1: ``<controller mount>/<this process's cgroup>/sandlot``, so sandboxes stay inside
  whatever limits the host already puts on the process that starts them.

Each sandbox's cgroup is named ``<owner pid>.<owner start time>.<random>`` so that
:func:`sweep_orphans` can remove cgroups whose owner died without cleaning up
(SIGKILL), without touching those of live processes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandlot._exceptions import IsolationUnavailable
from sandlot._models import ResourceUsage
from sandlot.policy import MiB, Resources

Version = Literal[1, 2]
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu")
SANDBOXES_CPU_SHARES = 1024 * 32
"""v1 ``cpu.shares`` of the parent of all sandboxes: as much as 32 ordinary processes."""
ROOT_ENV = "SANDLOT_CGROUP_ROOT"

CGROUP_FIX = (
    "run sandlot as root, or give it a cgroup subtree it may write: on cgroup v2, "
    "`systemd-run --user --scope -p Delegate=yes ...` or "
    "`sudo mkdir /sys/fs/cgroup/sandlot-$USER && sudo chown -R $USER /sys/fs/cgroup/sandlot-$USER` "
    "with the memory, pids and cpu controllers enabled in its parent's "
    "cgroup.subtree_control; on cgroup v1, create and chown <mount>/sandlot-$USER under each "
    "of the memory, pids and cpu mounts; then export SANDLOT_CGROUP_ROOT=sandlot-$USER "
    "(or the absolute v2 path). To run without whole-sandbox limits anyway (rlimits only), "
    "pass unsafe_best_effort_limits=True"
)


# --- pure: policy -> files ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """Files to write, per controller (v2 has one pseudo-controller, ``""``), in order."""

    files: Mapping[str, tuple[tuple[str, str], ...]]

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(self.files)


def plan(resources: Resources, version: Version, *, swap_files: bool = True) -> Plan:
    """The cgroup settings for ``resources``. ``swap_files``: the host accounts swap
    (v2 ``memory.swap.max`` / v1 ``memory.memsw.*`` exist)."""
    memory = None if resources.memory_mb is None else resources.memory_mb * MiB
    cpu_quota = None if resources.cpus is None else max(1000, round(resources.cpus * CPU_PERIOD_US))
    if version == 2:
        files: list[tuple[str, str]] = []
        if memory is not None:
            files.append(("memory.max", str(memory)))
            if swap_files:
                files.append(("memory.swap.max", "0"))
        if resources.pids is not None:
            files.append(("pids.max", str(resources.pids)))
        if cpu_quota is not None:
            files.append(("cpu.max", f"{cpu_quota} {CPU_PERIOD_US}"))
        return Plan({"": tuple(files)})
    v1: dict[str, tuple[tuple[str, str], ...]] = {}
    if memory is not None:
        mem = [("memory.limit_in_bytes", str(memory))]
        # memsw (memory + swap) equal to the memory limit means no swap at all. Without
        # swap accounting, swappiness 0 keeps the cgroup's anonymous memory out of swap.
        mem.append(
            ("memory.memsw.limit_in_bytes", str(memory))
            if swap_files
            else ("memory.swappiness", "0")
        )
        v1["memory"] = tuple(mem)
    if resources.pids is not None:
        v1["pids"] = (("pids.max", str(resources.pids)),)
    if cpu_quota is not None:
        v1["cpu"] = (
            ("cpu.cfs_period_us", str(CPU_PERIOD_US)),
            ("cpu.cfs_quota_us", str(cpu_quota)),
        )
    return Plan(v1)


# --- the host ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Host:
    """Where this host lets sandlot create sandbox cgroups."""

    version: Version
    bases: Mapping[str, Path]
    """Controller -> directory holding sandbox cgroups (v2: ``{"": path}``)."""
    swap_accounting: bool


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, superopts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(superopts.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path (v2 under key "")."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _swap_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def detect() -> Host:
    """Find the host's cgroup version and sandlot's base directories.

    Raises :class:`IsolationUnavailable` (naming the fix) when no usable, writable
    hierarchy with the memory, pids and cpu controllers exists.
    """
    mounts = _mounts()
    own = _own_paths()
    configured = os.environ.get(ROOT_ENV, "").strip()
    v1 = {
        ctrl: Path(point)
        for point, fstype, opts in mounts
        if fstype == "cgroup"
        for ctrl in (*V1_CONTROLLERS, "cpuacct")
        if ctrl in opts
    }
    if all(ctrl in v1 for ctrl in V1_CONTROLLERS):
        bases: dict[str, Path] = {}
        # cpuacct only measures (CPU time for Execution.usage); joined when mounted.
        for ctrl in (*V1_CONTROLLERS, *(["cpuacct"] if "cpuacct" in v1 else [])):
            if configured:
                bases[ctrl] = v1[ctrl] / configured.strip("/")
            else:
                bases[ctrl] = v1[ctrl] / own.get(ctrl, "/").strip("/") / "sandlot"
        swap = (v1["memory"] / "memory.memsw.limit_in_bytes").exists()
        host = Host(1, bases, swap)
    else:
        unified = next((Path(p) for p, fstype, _ in mounts if fstype == "cgroup2"), None)
        if unified is None:
            raise IsolationUnavailable(
                "no cgroup file system is mounted, so sandlot cannot limit a sandbox's memory, "
                f"processes and CPU as a whole. Fix: mount cgroup2 at /sys/fs/cgroup. {CGROUP_FIX}"
            )
        if configured:
            base = Path(configured) if configured.startswith("/") else unified / configured
        else:
            base = unified / "sandlot"
        host = Host(2, {"": base}, True)
    _prepare(host)
    if host.version == 2:
        swap = (host.bases[""] / "memory.swap.max").exists() or (
            next(iter(host.bases.values())) / "memory.swap.current"
        ).exists()
        host = Host(2, host.bases, swap)
    if not host.swap_accounting and host.version == 2 and _swap_total() > 0:
        raise IsolationUnavailable(
            "this host has swap but its kernel does not account it per cgroup, so sandlot "
            "cannot keep a sandbox out of swap (its memory limit would not be exact). Fix: "
            "boot with swapaccount=1 / CONFIG_MEMCG_SWAP, or turn swap off (swapoff -a)"
        )
    return host


def _prepare(host: Host) -> None:
    """Create the base directories and (v2) enable the controllers below them."""
    for base in host.bases.values():
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IsolationUnavailable(
                f"sandlot cannot create its cgroup directory {base} ({exc.strerror}). "
                f"Fix: {CGROUP_FIX}"
            ) from exc
        if not os.access(base, os.W_OK):
            raise IsolationUnavailable(
                f"the cgroup directory {base} is not writable. Fix: {CGROUP_FIX}"
            )
    if host.version == 1 and "cpu" in host.bases:
        # On v1 the common parent competes with every other process at its level as ONE
        # task of weight 1024: under host load all sandboxes together would get one
        # process's share and each start would crawl. Weigh the parent like many
        # processes; each sandbox is still held to its own quota (Resources.cpus).
        with contextlib.suppress(OSError):
            (host.bases["cpu"] / "cpu.shares").write_text(str(SANDBOXES_CPU_SHARES))
    if host.version == 2:
        base = host.bases[""]
        available = set((base / "cgroup.controllers").read_text().split())
        missing = {"memory", "pids", "cpu"} - available
        if missing and os.environ.get(ROOT_ENV) is None and os.geteuid() == 0:
            # Our own base: enable the controllers from the root down to it.
            with contextlib.suppress(OSError):
                (base.parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            available = set((base / "cgroup.controllers").read_text().split())
            missing = {"memory", "pids", "cpu"} - available
        if missing:
            raise IsolationUnavailable(
                f"the cgroup v2 controllers {sorted(missing)} are not available in {base}. "
                f"Fix: {CGROUP_FIX}"
            )
        control = base / "cgroup.subtree_control"
        enabled = set(control.read_text().split())
        if {"memory", "pids", "cpu"} - enabled:
            try:
                control.write_text("+memory +pids +cpu")
            except OSError as exc:
                raise IsolationUnavailable(
                    f"cannot enable the memory, pids and cpu controllers in {control} "
                    f"({exc.strerror}; on v2 the directory must hold no processes itself). "
                    f"Fix: {CGROUP_FIX}"
                ) from exc


_HOST: Host | None = None


def host() -> Host:
    """:func:`detect`, once per process (the answer does not change while we run)."""
    global _HOST
    if _HOST is None:
        _HOST = detect()
    return _HOST


# --- one sandbox ----------------------------------------------------------------------------
def process_start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot, field 22 of ``/proc/PID/stat``), to
    tell a process from a later one that got the same pid; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class SandboxCgroup:
    """The cgroup(s) of one sandbox. Create with :meth:`create`; always :meth:`destroy`."""

    def __init__(self, host: Host, name: str) -> None:
        self.host = host
        self.name = name
        self.paths = {ctrl: base / name for ctrl, base in host.bases.items()}
        self._attach: list[int] = []
        self._stats = UsageFiles()

    @classmethod
    def create(cls, resources: Resources) -> SandboxCgroup:
        h = host()
        name = owner_name(4)
        group = cls(h, name)
        try:
            group._make(plan(resources, h.version, swap_files=h.swap_accounting))
        except BaseException:
            group.destroy()
            raise
        return group

    def _make(self, settings: Plan) -> None:
        for ctrl, path in self.paths.items():
            try:
                path.mkdir()
            except OSError as exc:
                raise IsolationUnavailable(
                    f"cannot create the sandbox's cgroup {path} ({exc.strerror}). Fix: {CGROUP_FIX}"
                ) from exc
            for name, value in settings.files.get(ctrl, ()):
                try:
                    (path / name).write_text(value)
                except OSError as exc:
                    raise IsolationUnavailable(
                        f"cannot set {name}={value} in {path} ({exc.strerror}), so the limit "
                        f"would not hold. Fix: {CGROUP_FIX}"
                    ) from exc
            # v1: the writer moves as a thread (``tasks``), which a single-threaded child
            # is whole; that skips the global lock a process move waits for (an RCU
            # grace period, see open_thread_attach). v2 moves processes only.
            attach = "tasks" if self.host.version == 1 else "cgroup.procs"
            self._attach.append(os.open(path / attach, os.O_WRONLY | os.O_CLOEXEC))

    @property
    def attach_fds(self) -> tuple[int, ...]:
        """Open ``cgroup.procs`` (v2) or ``tasks`` (v1) files. A single-threaded child
        writes ``b"0"`` to each (before exec) to move itself in; the fds are
        close-on-exec and closed by :meth:`close_fds`."""
        return tuple(self._attach)

    def open_thread_attach(self) -> list[int] | None:
        """cgroup v1: each hierarchy's ``tasks`` file, opened for writing (the caller
        closes them; the ones :attr:`attach_fds` held are handed over); None on v2.

        A single-threaded process that writes ``b"0"`` to each moves itself in as a
        thread. The kernel takes its global threadgroup lock, and with it an RCU grace
        period after a quiet spell (milliseconds, more on a busy host), only to move a
        whole process or another thread, not the writer itself. v2 has no such file: a
        thread cannot leave its process's domain there."""
        if self.host.version != 1:
            return None
        if len(self._attach) == len(self.paths):  # opened by _make: tasks files on v1
            fds, self._attach = self._attach, []
            return fds
        fds = []
        try:
            for path in self.paths.values():
                fds.append(os.open(path / "tasks", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def holds(self, pid: int) -> bool:
        """Whether ``pid``'s main thread is in this cgroup in every hierarchy
        (``/proc/<pid>/cgroup``)."""
        try:
            with open(f"/proc/{pid}/cgroup") as handle:
                lines = handle.read().splitlines()
        except OSError:
            return False
        found: dict[str, str] = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for ctrl in controllers.split(",") if self.host.version == 1 else [""]:
                found[ctrl] = path
        return all(found.get(ctrl, "").rsplit("/", 1)[-1] == self.name for ctrl in self.paths)

    def close_fds(self) -> None:
        for fd in self._attach:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._attach.clear()

    def _read(self, ctrl: str, name: str) -> str | None:
        try:
            return (self.paths[ctrl] / name).read_text()
        except (OSError, KeyError):
            return None

    def usage(self) -> ResourceUsage:
        """Peak memory, limit, OOM kills so far, CPU time and current process count."""
        return read_usage(self.host.version, self.paths, self._stats)

    def counters(self) -> ResourceUsage:
        """OOM kills so far and CPU time only (two files of :meth:`usage`'s five)."""
        return read_usage(self.host.version, self.paths, self._stats, counters_only=True)

    def _cpuacct_rel(self) -> str:
        # The sandbox is not placed in cpuacct; its CPU time is read from the first
        # process's cpuacct group, which is the caller's. Only used when co-mounted.
        return ""

    def pids(self) -> list[int]:
        ctrl = "" if self.host.version == 2 else "pids"
        text = self._read(ctrl, "cgroup.procs") or ""
        return [int(p) for p in text.split()]

    def kill_all(self) -> None:
        """SIGKILL every process in the sandbox's cgroup (v2: ``cgroup.kill``)."""
        if self.host.version == 2 and (self.paths[""] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.paths[""] / "cgroup.kill").write_text("1")
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def destroy(self, timeout: float = 10.0) -> bool:
        """Kill what is left and remove the cgroup(s). True when nothing remains."""
        self.close_fds()
        self._stats.close()
        deadline = time.monotonic() + timeout
        remaining = dict(self.paths)
        while remaining:
            for ctrl, path in list(remaining.items()):
                try:
                    path.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        return False
                    self.kill_all()
                    continue
                del remaining[ctrl]
            if remaining:
                time.sleep(0.01)
        return True


class UsageFiles:
    """The usage files of one cgroup, opened once and re-read in place (``pread`` at
    offset 0 makes the kernel render them afresh): usage is read twice a cell, and
    opening and closing five files each time cost about 40 microseconds of it.

    Thread-safe; after :meth:`close` every read opens and closes its file again, so
    a read racing with close never reads a descriptor number reused meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[tuple[str, str], int] = {}
        self._kept: dict[tuple[str, str], str] = {}
        self._closed = False

    def read(
        self, paths: Mapping[str, Path], ctrl: str, name: str, constant: bool = False
    ) -> str | None:
        """The file's text now. ``constant``: a file that does not change once read
        (the memory limit sandlot set when it made the cgroup): read once, then kept."""
        if constant:
            kept = self._kept.get((ctrl, name))
            if kept is not None:
                return kept
            text = self.read(paths, ctrl, name)
            if text is not None:
                self._kept[(ctrl, name)] = text
            return text
        with self._lock:
            if self._closed:
                return _read_file(paths, ctrl, name)
            fd = self._fds.get((ctrl, name))
            if fd is None:
                try:
                    fd = os.open(f"{paths[ctrl]}/{name}", os.O_RDONLY | os.O_CLOEXEC)
                except (OSError, KeyError):
                    return None
                self._fds[(ctrl, name)] = fd
            try:
                return os.pread(fd, 65536, 0).decode()
            except OSError:
                return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def read_usage(
    version: Version,
    paths: Mapping[str, Path],
    files: UsageFiles | None = None,
    counters_only: bool = False,
) -> ResourceUsage:
    """A cgroup's usage: peak memory, limit, OOM kills so far, CPU time, process count.

    ``paths``: the cgroup's directory per controller (``""`` on v2; ``memory``,
    ``pids`` and optionally ``cpuacct`` on v1). Also used for containers, whose
    cgroups the engine creates. ``files``: keep the files open there between calls.
    ``counters_only``: OOM kills and CPU time only (what a cell is measured from, read
    before each one); the other fields are None."""

    def read(ctrl: str, name: str, constant: bool = False) -> str | None:
        if files is not None:
            return files.read(paths, ctrl, name, constant)
        return _read_file(paths, ctrl, name)

    if version == 2:
        oom_kills = _key(read("", "memory.events"), "oom_kill") or 0
        if counters_only:
            cpu = _key(read("", "cpu.stat"), "usage_usec")
            return ResourceUsage(None, None, oom_kills, _seconds(cpu, 1e6))
        peak = read("", "memory.peak") or read("", "memory.current")
        limit = read("", "memory.max", constant=True)
        cpu = _key(read("", "cpu.stat"), "usage_usec")
        pids = read("", "pids.current")
        return ResourceUsage(
            _int(peak),
            _int(limit),
            oom_kills,
            None if cpu is None else cpu / 1e6,
            _int(pids),
        )
    oom = _key(read("memory", "memory.oom_control"), "oom_kill") or 0
    cpu_ns = _int(read("cpuacct", "cpuacct.usage"))
    if counters_only:
        return ResourceUsage(None, None, oom, _seconds(cpu_ns, 1e9))
    return ResourceUsage(
        _int(read("memory", "memory.max_usage_in_bytes")),
        _int(read("memory", "memory.limit_in_bytes", constant=True)),
        oom,
        None if cpu_ns is None else cpu_ns / 1e9,
        _int(read("pids", "pids.current")),
    )


def _seconds(count: int | None, per_second: float) -> float | None:
    return None if count is None else count / per_second


def memory_use(version: Version, paths: Mapping[str, Path]) -> tuple[int, int] | None:
    """A cgroup's memory charged now and its limit, in bytes; None when it has no
    limit or the files cannot be read."""
    ctrl, used_file, limit_file = (
        ("", "memory.current", "memory.max")
        if version == 2
        else ("memory", "memory.usage_in_bytes", "memory.limit_in_bytes")
    )
    used = _int(_read_file(paths, ctrl, used_file))
    limit = _int(_read_file(paths, ctrl, limit_file))
    return None if used is None or limit is None else (used, limit)


def _read_file(paths: Mapping[str, Path], ctrl: str, name: str) -> str | None:
    """One cgroup file's text, or None if the controller or file is missing.

    os-level calls on a str path: usage is read twice per cell, and pathlib's
    read_text cost ten times as much (about 1.5 ms a cell in all)."""
    try:
        fd = os.open(f"{paths[ctrl]}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, KeyError):
        return None
    try:
        return os.read(fd, 65536).decode()
    except OSError:
        return None
    finally:
        os.close(fd)


def _key(text: str | None, key: str) -> int | None:
    """The value of ``key`` in a keyed file's text (``key value`` lines), or None.
    Found, not split into lines: these files are read twice a cell."""
    if not text:
        return None
    at = text.find(key + " ")
    while at > 0 and text[at - 1] != "\n":  # (a longer key that ends in this one)
        at = text.find(key + " ", at + 1)
    if at < 0:
        return None
    end = text.find("\n", at)
    try:
        return int(text[at + len(key) + 1 : None if end < 0 else end])
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def sweep_orphans() -> list[str]:
    """Remove sandbox cgroups whose owning process is gone (it was SIGKILLed before it
    could clean up). Returns the names removed. Never touches a live owner's cgroups."""
    try:
        h = host()
    except IsolationUnavailable:
        return []
    removed = []
    names: set[str] = set()
    for base in h.bases.values():
        with contextlib.suppress(OSError):
            names.update(p.name for p in base.iterdir() if p.is_dir())
    for name in sorted(names):
        if owner_gone(name) and SandboxCgroup(h, name).destroy(timeout=2.0):
            removed.append(name)
    return removed


def owner_name(random_bytes: int) -> str:
    """``<this process's pid>.<its start time>.<random hex>``: how sandlot names what a
    process leaves on the host, so that :func:`owner_gone` can tell once it is gone."""
    pid = os.getpid()
    return f"{pid}.{process_start_time(pid)}.{secrets.token_hex(random_bytes)}"


def owner_gone(name: str) -> bool:
    """Whether ``name`` (``<owner pid>.<owner start time>.<random>``, how sandlot names
    what a process leaves on the host: cgroups, restored sandboxes' roots) belongs to a
    process that is gone. False for a name of another shape: never sandlot's to remove."""
    parts = name.split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    return process_start_time(int(parts[0])) != parts[1]
