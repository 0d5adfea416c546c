"""Host uids and gids for sandboxes: one pair per live sandbox, from a delegated range.

Why: the kernel keeps some quotas per *user*, not per process or cgroup: inotify
instances and watches, POSIX message queue bytes (``RLIMIT_MSGQUEUE``), pending
signals, ``RLIMIT_NPROC``. Sandboxes that share a host uid share those quotas, so one
that holds 127 inotify instances makes ``inotify_init`` fail in every other. When
sandlot runs as root, each sandbox therefore starts as a host uid (and gid) of its own,
taken from a range the operator delegated to sandlot and given back when it ends.

The range (:func:`configured_range`), in this order:

* ``$SANDLOT_HOST_IDS`` = ``FIRST-LAST`` (uids and gids FIRST..LAST); or
* root's entries in ``/etc/subuid`` and ``/etc/subgid`` (``usermod --add-subuids
  100000-165535 --add-subgids 100000-165535 root``), uid ``u0 + i`` paired with gid
  ``g0 + i``.

Neither: :class:`~sandlot.IsolationUnavailable` naming both fixes. A range that
contains uid 0, or the uid of any account in the password database, is refused: an
escaped sandbox would land as that account.

Allocation state survives the process that allocated (:class:`HostIdAllocator`): one
lock file per uid in ``$SANDLOT_HOST_IDS_DIR`` (``/run/sandlot/host-ids``, root only,
emptied by a reboot like the processes it describes). Holding ``flock`` on it is
owning the uid; the file says who (pid and process start time) for people reading it.
The kernel drops the lock when its holder dies, SIGKILL included, so the uid of a
crashed owner is free again without a sweep. A uid some process still runs as (a
sandbox that outlived its owner by a moment) is skipped even when its lock is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import itertools
import os
import pwd
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot._exceptions import IsolationUnavailable

RANGE_ENV = "SANDLOT_HOST_IDS"
LOCK_DIR_ENV = "SANDLOT_HOST_IDS_DIR"
DEFAULT_LOCK_DIR = "/run/sandlot/host-ids"
LEGACY_ENV = "SANDLOT_HOST_UID"
"""Before per-sandbox uids: one host uid for every sandbox. Refused now (it is the
shared-quota problem this module exists to fix), with a message naming the new knob."""
SUBUID = "/etc/subuid"
SUBGID = "/etc/subgid"
MIN_COUNT = 2

RANGE_FIX = (
    f"delegate a range of host uids and gids to sandlot, one per live sandbox: "
    f"`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 root` (or the line "
    f"`root:100000:65536` in both {SUBUID} and {SUBGID}), or set "
    f"{RANGE_ENV}=FIRST-LAST to ids no account or group uses"
)


class HostIdsExhausted(IsolationUnavailable):
    """Every uid of the range belongs to a live sandbox: refuse rather than share one."""


@dataclass(frozen=True, slots=True)
class HostIdRange:
    """uids ``first_uid .. first_uid + count - 1``, paired with gids from ``first_gid``."""

    first_uid: int
    first_gid: int
    count: int
    source: str

    def describe(self) -> str:
        uids = f"{self.first_uid}-{self.first_uid + self.count - 1}"
        if self.first_gid == self.first_uid:
            return f"uids and gids {uids} ({self.source})"
        gids = f"{self.first_gid}-{self.first_gid + self.count - 1}"
        return f"uids {uids}, gids {gids} ({self.source})"


def configured_range(
    env: dict[str, str] | None = None, subuid: str = SUBUID, subgid: str = SUBGID
) -> HostIdRange:
    """The delegated range (see the module docstring), checked; or IsolationUnavailable."""
    env = dict(os.environ) if env is None else env
    if env.get(LEGACY_ENV, "").strip():
        raise IsolationUnavailable(
            f"{LEGACY_ENV} gives every sandbox the same host uid, so sandboxes would share "
            f"the kernel's per-user quotas (inotify, message queues); sandlot now gives each "
            f"sandbox its own. Fix: unset {LEGACY_ENV} and {RANGE_FIX}"
        )
    value = env.get(RANGE_ENV, "").strip()
    if value:
        first, sep, last = value.partition("-")
        if not (sep and first.strip().isdigit() and last.strip().isdigit()):
            raise IsolationUnavailable(
                f"{RANGE_ENV}={value!r} is not FIRST-LAST (e.g. 100000-165535)"
            )
        lo, hi = int(first), int(last)
        id_range = HostIdRange(lo, lo, hi - lo + 1, RANGE_ENV)
    else:
        uids, gids = _sub_entry(subuid), _sub_entry(subgid)
        if uids is None or gids is None:
            raise IsolationUnavailable(
                f"sandlot runs as root and starts every sandbox as a host uid of its own, but "
                f"no range is delegated to it (no root entry in {SUBUID} and {SUBGID}, and "
                f"{RANGE_ENV} is unset). Fix: {RANGE_FIX}"
            )
        id_range = HostIdRange(
            uids[0], gids[0], min(uids[1], gids[1]), f"root in {SUBUID}, {SUBGID}"
        )
    _check(id_range)
    return id_range


def _sub_entry(path: str) -> tuple[int, int] | None:
    """root's first ``name:first:count`` line in /etc/subuid or /etc/subgid."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    names = {"0", "root"}
    with contextlib.suppress(KeyError):
        names.add(pwd.getpwuid(0).pw_name)
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in names and parts[1].isdigit() and parts[2].isdigit():
            return int(parts[1]), int(parts[2])
    return None


@functools.lru_cache(maxsize=8)
def _check(id_range: HostIdRange) -> None:
    """Refuse a range that contains id 0 or an account's or group's id. Once per range
    and process: enumerating accounts can be slow (directory services), and this runs
    before every sandbox start."""
    where = id_range.source
    if id_range.count < MIN_COUNT:
        raise IsolationUnavailable(
            f"the host id range from {where} has {id_range.count} id(s); sandlot needs one per "
            f"live sandbox (at least {MIN_COUNT}). Fix: {RANGE_FIX}"
        )
    for first in (id_range.first_uid, id_range.first_gid):
        if first <= 0 or first + id_range.count - 1 >= 2**32 - 1:
            raise IsolationUnavailable(
                f"the host id range from {where} includes id 0 or the invalid id 2^32-1. "
                f"Fix: {RANGE_FIX}"
            )
    last = id_range.first_uid + id_range.count - 1
    for entry in pwd.getpwall():
        if id_range.first_uid <= entry.pw_uid <= last:
            raise IsolationUnavailable(
                f"the host id range from {where} contains uid {entry.pw_uid}, which account "
                f"{entry.pw_name!r} uses: an escaped sandbox would land as that account. "
                f"Fix: {RANGE_FIX}"
            )
    last = id_range.first_gid + id_range.count - 1
    for group in grp.getgrall():
        if id_range.first_gid <= group.gr_gid <= last:
            raise IsolationUnavailable(
                f"the host id range from {where} contains gid {group.gr_gid}, which group "
                f"{group.gr_name!r} uses: an escaped sandbox would have its access. "
                f"Fix: {RANGE_FIX}"
            )


@dataclass(slots=True)
class HostIds:
    """One sandbox's host uid and gid, held until :meth:`release` (or this process dies)."""

    uid: int
    gid: int
    _fd: int | None
    _owner: int = field(default_factory=os.getpid)

    @property
    def pair(self) -> tuple[int, int]:
        return self.uid, self.gid

    def release(self) -> None:
        """Give the ids back. Call only when no process of the sandbox is left.
        Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() == self._owner:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            # Explicitly: a child forked from this process shares the lock (one open
            # file description) and would otherwise keep the uid held while it lives.
            fcntl.flock(fd, fcntl.LOCK_UN)
        # In a forked child (atexit handlers, finalizers): only our copy of the
        # descriptor goes; the lock stays with the process that owns the sandbox.
        os.close(fd)


class HostIdAllocator:
    """Hands out the ids of ``id_range``, each to one holder at a time, across processes.

    ``in_use``: the uids some process runs as now (default: read from ``/proc``);
    a parameter so unit tests can say which ones without starting processes as them.
    """

    def __init__(
        self,
        id_range: HostIdRange,
        lock_dir: str | os.PathLike[str] | None = None,
        *,
        in_use: Callable[[], set[int]] | None = None,
    ) -> None:
        self.range = id_range
        self.lock_dir = Path(lock_dir or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
        self._in_use = in_use or uids_in_use
        self._lock = threading.Lock()
        self._next = 0

    def acquire(self) -> HostIds:
        """The ids of a uid nobody holds and no process runs as; HostIdsExhausted if none."""
        self._prepare_dir()
        with self._lock:
            start = self._next
        count = self.range.count
        for offset in itertools.chain(range(start, count), range(start)):
            uid = self.range.first_uid + offset
            fd = self._try_lock(uid)
            if fd is None:
                continue
            # Read after taking the lock: a process still running as the uid (its owner
            # died, its sandbox is still being torn down) can only be older than that.
            if uid in self._in_use():
                os.close(fd)
                continue
            with self._lock:
                self._next = (offset + 1) % count
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {_start_time(os.getpid())}\n".encode(), 0)
            return HostIds(uid, self.range.first_gid + offset, fd)
        raise HostIdsExhausted(
            f"all {count} host uids of {self.range.describe()} belong to live sandboxes "
            f"(or to processes still running as them), and sandlot never lets two sandboxes "
            f"share one. Fix: end some sandboxes, or delegate a larger range: {RANGE_FIX}"
        )

    def _prepare_dir(self) -> None:
        try:
            self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise IsolationUnavailable(
                f"cannot create {self.lock_dir}, where sandlot records which host uids its "
                f"sandboxes hold ({exc}). Fix: make it writable for sandlot, or set "
                f"{LOCK_DIR_ENV} to a directory that is"
            ) from exc

    def _try_lock(self, uid: int) -> int | None:
        path = self.lock_dir / str(uid)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise IsolationUnavailable(f"cannot open {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise IsolationUnavailable(f"cannot lock {path}: {exc}") from exc
        return fd

    def holders(self) -> dict[int, str]:
        """uid -> the ``pid start-time`` record of its holder, for uids held right now
        (diagnostics: ``sandlot doctor``, tests). Briefly takes a shared lock on each
        file, which makes a concurrent :meth:`acquire` skip that uid, nothing worse."""
        held: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for path in self.lock_dir.iterdir():
                if not path.name.isdigit():
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    held[int(path.name)] = os.pread(fd, 64, 0).decode(errors="replace").strip()
                finally:
                    os.close(fd)
        return held


def acquire() -> HostIds:
    """The host uid and gid for one new sandbox, from :func:`configured_range`, held
    until :meth:`HostIds.release`: IsolationUnavailable if no range is delegated,
    :class:`HostIdsExhausted` if every id of it is held. Every caller in a process shares
    one allocator per (range, lock directory); across processes the lock files decide."""
    lock_dir = os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR
    return _shared_allocator(configured_range(), lock_dir).acquire()


@functools.lru_cache(maxsize=4)
def _shared_allocator(id_range: HostIdRange, lock_dir: str) -> HostIdAllocator:
    return HostIdAllocator(id_range, lock_dir)


def uids_in_use() -> set[int]:
    """Every real, effective, saved and file-system uid of every live process on the host.

    Zombies are left out: they run nothing and hold no descriptors, and an init that
    reaps slowly (some container inits never do) would otherwise pin their uids."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status", "rb") as handle:
                    uids: list[int] = []
                    for line in handle:
                        if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                            break
                        if line.startswith(b"Uid:"):
                            uids = [int(x) for x in line.split()[1:]]
                            break
                    found.update(uids)
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    return found


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]
