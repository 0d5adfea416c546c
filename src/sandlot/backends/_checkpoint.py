"""Checkpoint and restore of a sandbox's process tree with CRIU: the host-side layer
that pause, resume, snapshots and fork are built on (docs/persistence.md).

Split like the rest of sandlot:

* :func:`dump_argv` and :func:`restore_argv` are pure: a :class:`DumpPlan` or
  :class:`RestorePlan` -> the ``criu`` command line. Golden-tested without privileges.
* :func:`encode_userns` / :func:`decode_userns` read and write the one CRIU image
  sandlot changes between dump and restore: the user namespace's id maps. Each copy
  restored from one checkpoint gets host ids of its own that way (a copy is a new
  sandbox, not a second tenant of the first one's host uid).
* :func:`criu_path` and :func:`finding` find the binary and say, for ``sandlot
  doctor``, whether checkpoint/restore works on this host.

What CRIU can checkpoint decides the sandbox's namespace layout (measured, see
docs/persistence.md): one user namespace that every other namespace belongs to (CRIU
refuses nested ones), with uid and gid 0 and 1 mapped besides the sandbox user (CRIU
enters the namespace as its uid 0; the network namespace's ``ping_group_range``,
restored as written, names gids 0 and 1). No process of the sandbox runs as 0 or 1:
they are mapped to unprivileged host ids of the sandbox's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sandlot.backends._base import Finding

T = TypeVar("T")

CRIU_FIX = "run `sudo scripts/setup-criu.sh` (builds CRIU 4.x from Debian's source package)"
"""How to fix a host without a working CRIU (``sandlot doctor`` and refusals say it)."""

_PLACES = ("/usr/local/sbin/criu", "/usr/sbin/criu")
MIN_VERSION = (4, 0)
"""CRIU 3.x (Debian 12's) fails ``criu check`` on current kernels (the vDSO)."""

# A CRIU image: the image magic pair (8 bytes), then entries, each a little-endian u32
# length and one protobuf message.
_MAGIC_LEN = 8
_VERSION = re.compile(r"^Version:\s*(\d+)\.(\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class IdExtent:
    """One line of a ``uid_map``/``gid_map``: ``first`` inside maps to ``lower`` on the
    host, for ``count`` ids."""

    first: int
    lower: int
    count: int


@dataclass(frozen=True, slots=True)
class UsernsMaps:
    """A user namespace's id maps, as CRIU stores them (``userns-<id>.img``)."""

    uid: tuple[IdExtent, ...]
    gid: tuple[IdExtent, ...]


def sandbox_maps(
    root: tuple[int, int], one: tuple[int, int], user: tuple[int, int], user_id: int = 1000
) -> UsernsMaps:
    """The maps of a checkpointable sandbox, given three host (uid, gid) pairs of its
    own: 0 -> ``root`` and 1 -> ``one`` (CRIU needs them mapped; nothing runs as them),
    ``user_id`` (the sandbox's only user) -> ``user``."""
    return UsernsMaps(
        uid=(IdExtent(0, root[0], 1), IdExtent(1, one[0], 1), IdExtent(user_id, user[0], 1)),
        gid=(IdExtent(0, root[1], 1), IdExtent(1, one[1], 1), IdExtent(user_id, user[1], 1)),
    )


def map_text(extents: Sequence[IdExtent]) -> str:
    """``extents`` as ``/proc/<pid>/uid_map`` takes them."""
    return "".join(f"{e.first} {e.lower} {e.count}\n" for e in extents)


# --- the userns image ---------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint in a CRIU image")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _extent(e: IdExtent) -> bytes:
    # message uid_gid_extent { uint32 first = 1; uint32 lower_first = 2; uint32 count = 3; }
    return b"".join(
        _varint(tag << 3) + _varint(v) for tag, v in ((1, e.first), (2, e.lower), (3, e.count))
    )


def encode_userns(magic: bytes, maps: UsernsMaps) -> bytes:
    """A ``userns-<id>.img`` with ``magic`` (the first 8 bytes of the image it replaces)
    holding ``maps`` (message userns_entry: uid_map = 1, gid_map = 2, repeated)."""
    if len(magic) != _MAGIC_LEN:
        raise ValueError("a CRIU image starts with 8 bytes of magic")
    body = b""
    for tag, extents in ((1, maps.uid), (2, maps.gid)):
        for e in extents:
            item = _extent(e)
            body += _varint(tag << 3 | 2) + _varint(len(item)) + item
    return magic + struct.pack("<I", len(body)) + body


def decode_userns(image: bytes) -> tuple[bytes, UsernsMaps]:
    """``(magic, maps)`` of a ``userns-<id>.img``; ValueError if it is not one."""
    if len(image) < _MAGIC_LEN + 4:
        raise ValueError("too short for a CRIU image")
    magic = image[:_MAGIC_LEN]
    (size,) = struct.unpack_from("<I", image, _MAGIC_LEN)
    body = image[_MAGIC_LEN + 4 : _MAGIC_LEN + 4 + size]
    if len(body) != size or len(image) != _MAGIC_LEN + 4 + size:
        raise ValueError("a userns image holds exactly one entry")
    maps: dict[int, list[IdExtent]] = {1: [], 2: []}
    at = 0
    while at < len(body):
        key, at = _read_varint(body, at)
        length, at = _read_varint(body, at)
        if key not in (1 << 3 | 2, 2 << 3 | 2) or at + length > len(body):
            raise ValueError(f"unexpected field {key >> 3} in a userns image")
        item, at = body[at : at + length], at + length
        values: dict[int, int] = {}
        pos = 0
        while pos < len(item):
            tag, pos = _read_varint(item, pos)
            if tag & 7 != 0:
                raise ValueError("unexpected wire type in an id extent")
            values[tag >> 3], pos = _read_varint(item, pos)
        if set(values) != {1, 2, 3}:
            raise ValueError("an id extent needs first, lower_first and count")
        maps[key >> 3].append(IdExtent(values[1], values[2], values[3]))
    return magic, UsernsMaps(uid=tuple(maps[1]), gid=tuple(maps[2]))


def rewrite_userns(images_dir: str, maps: UsernsMaps) -> None:
    """Give the (one) user namespace in a checkpoint ``maps``: the copy restored from
    ``images_dir`` runs as those host ids."""
    names = [n for n in os.listdir(images_dir) if n.startswith("userns-") and n.endswith(".img")]
    if len(names) != 1:
        raise ValueError(f"a sandbox checkpoint holds one user namespace, found {len(names)}")
    path = os.path.join(images_dir, names[0])
    with open(path, "rb") as f:
        magic, _ = decode_userns(f.read())
    data = encode_userns(magic, maps)
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# --- a user namespace made by the host ----------------------------------------------

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


class _Unshare:
    """``preexec_fn`` of the placeholder process: become ``owner`` (uid, gid), then
    enter a new user namespace, which ``owner`` therefore owns, and a network namespace
    that belongs to it."""

    def __init__(self, owner: tuple[int, int]) -> None:
        self._owner = owner
        self._libc = ctypes.CDLL(None, use_errno=True)

    def __call__(self) -> None:
        uid, gid = self._owner
        if os.getuid() != uid:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        if self._libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET)")


@dataclass(slots=True)
class Namespaces:
    """Descriptors of a checkpointable sandbox's user namespace and the network
    namespace that belongs to it (loopback up); :meth:`close` when the sandbox runs."""

    user: int
    net: int

    def close(self) -> None:
        for fd in (self.user, self.net):
            with contextlib.suppress(OSError):
                os.close(fd)


def make_namespaces(maps: UsernsMaps, owner: tuple[int, int]) -> Namespaces:
    """A new user namespace with ``maps``, owned by host ``owner`` (uid, gid), and a
    network namespace of it with loopback up.

    Owned by ``owner``: bubblewrap runs as that uid and needs CAP_SYS_ADMIN in the
    namespace to join it (``--userns``), which from outside only its owner (or root)
    has. Writing maps of more than one line takes CAP_SETUID/CAP_SETGID on the host:
    root only. setgroups is denied in it, as bubblewrap does for the namespaces it
    makes. The network namespace is made here, not by bubblewrap, so that the host's
    channel socket can be created inside it (:func:`in_netns`): CRIU checkpoints only
    sockets of the namespaces it dumps.

    A placeholder process (``sleep``) makes them and is gone when this returns; the
    descriptors keep the namespaces alive."""
    holder = subprocess.Popen(
        ["sleep", "30"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_Unshare(owner),
        close_fds=True,
        env={},
    )
    try:
        base = f"/proc/{holder.pid}"
        with open(f"{base}/uid_map", "w") as f:
            f.write(map_text(maps.uid))
        with open(f"{base}/setgroups", "w") as f:
            f.write("deny")
        with open(f"{base}/gid_map", "w") as f:
            f.write(map_text(maps.gid))
        user = os.open(f"{base}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open(f"{base}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    spaces = Namespaces(user, net)
    try:
        in_netns(net, _loopback_up)
    except BaseException:
        spaces.close()
        raise
    return spaces


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def in_netns(netns_fd: int, fn: Callable[[], T]) -> T:
    """``fn()`` run in the network namespace ``netns_fd``: in a thread of its own that
    joins it (a network namespace is per thread; this process's other threads and the
    thread itself, which ends, are not moved). Sockets it creates belong there."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if _LIBC.setns(netns_fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")
            result.append(fn())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="sandlot-netns")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


_LIBC = ctypes.CDLL(None, use_errno=True)


# --- command lines ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DumpPlan:
    """What to checkpoint: the tree under ``pid`` (host pid of the sandbox's pid 1)."""

    pid: int
    images_dir: str
    leave_running: bool = False
    """Snapshot and fork keep the sandbox running; pause does not."""
    external_unix: tuple[int, ...] = ()
    """Inodes of sockets whose peer is the host (the channel): not dumped, handed a new
    descriptor at restore."""
    log_file: str = "dump.log"


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What to restore, into which root and with which inherited descriptors."""

    images_dir: str
    root: str
    """A directory holding the sandbox's mount points (its read-only root)."""
    inherit: tuple[tuple[int, str], ...] = field(default_factory=tuple)
    """``(fd, key)``: descriptor ``fd`` of criu's stands for the dumped resource ``key``
    (``socket:[<inode>]`` for the channel)."""
    pidfile: str = "restored.pid"
    log_file: str = "restore.log"


_COMMON = ("--shell-job", "-v4")
"""--shell-job: the sandbox runs in a session of its own (bwrap --new-session) whose
leader is its pid 1; without it CRIU wants a controlling terminal's session."""


def dump_argv(plan: DumpPlan, criu: str = "criu") -> list[str]:
    """``criu dump`` for ``plan``.

    --network-lock skip: the sandbox's network namespace has only loopback and is
    frozen with it; there is nothing outside to lock out (CRIU's default runs
    iptables). --external mnt[]: the read-only binds of the host's /usr and the
    template are recorded by path, not copied; tmpfs mounts (home, /tmp) are.
    """
    argv = [criu, "dump", "-t", str(plan.pid), "-D", plan.images_dir, "-o", plan.log_file]
    argv += [*_COMMON, "--network-lock", "skip", "--external", "mnt[]"]
    for inode in plan.external_unix:
        argv += ["--external", f"unix[{inode}]"]
    if plan.leave_running:
        argv.append("--leave-running")
    return argv


def restore_argv(plan: RestorePlan, criu: str = "criu") -> list[str]:
    """``criu restore`` for ``plan``: detached (-d), its pid written to ``pidfile``,
    the external mounts found again by path (--ext-mount-map auto)."""
    argv = [criu, "restore", "-D", plan.images_dir, "-o", plan.log_file, *_COMMON]
    argv += ["-d", "--pidfile", plan.pidfile, "--root", plan.root, "--ext-mount-map", "auto"]
    for fd, key in plan.inherit:
        argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
    return argv


# --- the host -----------------------------------------------------------------------


def criu_path() -> str | None:
    """The ``criu`` binary sandlot uses: ``$SANDLOT_CRIU``, else the places
    scripts/setup-criu.sh and distributions install it, else ``PATH``."""
    env = os.environ.get("SANDLOT_CRIU")
    if env:
        return env if os.access(env, os.X_OK) else None
    for place in _PLACES:
        if os.access(place, os.X_OK):
            return place
    return shutil.which("criu")


def criu_version(criu: str) -> tuple[int, int] | None:
    """``(major, minor)`` that ``criu --version`` prints, None if it does not run."""
    try:
        out = subprocess.run(
            [criu, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION.search(out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def finding() -> Finding:
    """``sandlot doctor``'s line on checkpoint/restore."""
    criu = criu_path()
    if criu is None:
        return Finding(
            "checkpoint",
            "warn",
            "no CRIU: sandboxes cannot be paused, snapshotted or forked",
            CRIU_FIX,
        )
    version = criu_version(criu)
    if version is None or version < MIN_VERSION:
        shown = "does not run" if version is None else f"is {version[0]}.{version[1]}"
        return Finding(
            "checkpoint",
            "warn",
            f"{criu} {shown}; sandlot needs CRIU {MIN_VERSION[0]}.x (3.x fails on current kernels)",
            CRIU_FIX,
        )
    if os.geteuid() != 0:
        return Finding(
            "checkpoint",
            "info",
            f"CRIU {version[0]}.{version[1]} at {criu}; checkpointing sandboxes needs root",
        )
    try:
        check = subprocess.run(
            [criu, "check"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Finding("checkpoint", "warn", f"`{criu} check` could not run: {exc}", CRIU_FIX)
    if check.returncode != 0:
        said = (check.stdout + check.stderr).strip().splitlines()
        return Finding(
            "checkpoint",
            "warn",
            f"`{criu} check` fails on this kernel: {said[-1] if said else check.returncode}",
            "a kernel with CONFIG_CHECKPOINT_RESTORE (every mainstream distribution has it)",
        )
    return Finding(
        "checkpoint",
        "ok",
        f"CRIU {version[0]}.{version[1]} at {criu}; `criu check` passes on this kernel",
    )
