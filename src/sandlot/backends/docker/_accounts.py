"""A container's own host uid and gid, and the account files that name them ``user``.

Under runc and crun a container has no user namespace: the uid it runs as *is* a host
uid, and the kernel charges its per-user quotas (inotify instances and watches, POSIX
message queue bytes, queued signals, RLIMIT_NPROC) to that uid. Containers that all ran
as uid 1000 shared those quotas, so one could use them up for every other. So each
container runs as a host uid and gid of its own, from the range delegated to sandlot
(:mod:`sandlot.backends._hostids`, the same allocator and lock files as the bwrap
sandboxes, so a container and a bwrap sandbox never share one either), held for the
container's life.

The template image's ``/etc/passwd`` and ``/etc/group`` name uid 1000; a container gets
its own pair, generated here and bound read-only over the image's, in which ``user``
(home ``/home/user``) is the container's uid and gid, so ``whoami``, ``pwd.getpwuid``
and ``~`` work as in a bwrap sandbox. The pair lives next to the allocator's lock files
(``<lock dir>/container-etc/<uid>/``), written while the uid is held and removed before
it is given back; a crashed owner's pair is overwritten when its uid is next used.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from sandlot._exceptions import IsolationUnavailable
from sandlot.backends import _hostids

ACCOUNTS_SUBDIR = "container-etc"
ACCOUNT_FILES = ("passwd", "group")
"""Files of a container's accounts directory, bound over the image's in ``/etc``."""


def passwd_text(uid: int, gid: int) -> str:
    """The container's ``/etc/passwd``: the image's accounts, ``user`` being ``uid``."""
    return (
        "root:x:0:0:root:/root:/bin/sh\n"
        f"user:x:{uid}:{gid}:sandlot:/home/user:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )


def group_text(gid: int) -> str:
    """The container's ``/etc/group``: the image's groups, ``user`` being ``gid``."""
    return f"root:x:0:\nuser:x:{gid}:\nnogroup:x:65534:\n"


@dataclass(slots=True)
class ContainerIds:
    """One container's host ids and its account files; :meth:`release` gives both back."""

    ids: _hostids.HostIds
    accounts_dir: Path
    """Holds :data:`ACCOUNT_FILES` for this uid."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: bool = False

    @property
    def uid(self) -> int:
        return self.ids.uid

    @property
    def gid(self) -> int:
        return self.ids.gid

    def release(self) -> None:
        """Remove the account files, then give the ids back. Call once no process of the
        container is left (the allocator also never hands out a uid a process still
        runs as). Idempotent and thread-safe: a failed start and the handle's exit
        (another thread) may both call it."""
        with self._lock:
            if self._released:
                return
            self._released = True
        for name in ACCOUNT_FILES:
            with contextlib.suppress(OSError):
                (self.accounts_dir / name).unlink()
        with contextlib.suppress(OSError):
            self.accounts_dir.rmdir()
        self.ids.release()


def acquire() -> ContainerIds:
    """Host ids of a new container's own, with its account files written.

    Fails closed: IsolationUnavailable when no range is delegated to sandlot or its
    lock directory cannot be used, :class:`~sandlot.backends._hostids.HostIdsExhausted`
    when every id of the range belongs to a live sandbox; both name the fix."""
    ids = _hostids.acquire()
    lock_dir = Path(os.environ.get(_hostids.LOCK_DIR_ENV) or _hostids.DEFAULT_LOCK_DIR)
    directory = lock_dir / ACCOUNTS_SUBDIR / str(ids.uid)
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        for name, text in (
            ("passwd", passwd_text(ids.uid, ids.gid)),
            ("group", group_text(ids.gid)),
        ):
            # Atomically (rename): no container ever binds a half-written file.
            tmp = directory / f".{name}.{os.getpid()}"
            tmp.write_text(text)
            os.chmod(tmp, 0o644)
            tmp.replace(directory / name)
    except OSError as exc:
        ids.release()
        raise IsolationUnavailable(
            f"cannot write the account files of a container's host uid in {directory} "
            f"({exc}). Fix: make {lock_dir} writable for sandlot, or set "
            f"{_hostids.LOCK_DIR_ENV} to a directory that is"
        ) from exc
    return ContainerIds(ids, directory)
