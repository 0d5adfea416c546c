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

import ctypes
import os
import re
import shutil
import signal
import struct
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sandlot.backends._base import Finding

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


# --- the threads' cgroup sets in core images -----------------------------------------

_CORE_THREAD_CORE = 5
"""core_entry.thread_core (message thread_core_entry)."""
_THREAD_CG_SET = 16
"""thread_core_entry.cg_set: a thread's cgroup set, when CRIU recorded one apart from
its process's."""


def _fields(body: bytes) -> list[tuple[int, int, int, int]]:
    """``(field, wire type, start, end)`` of each field of one protobuf message, in
    order; ValueError if ``body`` is not one."""
    out = []
    at = 0
    while at < len(body):
        start = at
        key, at = _read_varint(body, at)
        wire = key & 7
        if wire == 0:
            _, at = _read_varint(body, at)
        elif wire == 1:
            at += 8
        elif wire == 2:
            length, at = _read_varint(body, at)
            at += length
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a CRIU image")
        if at > len(body):
            raise ValueError("a field runs past the end of its CRIU image entry")
        out.append((key >> 3, wire, start, at))
    return out


def drop_thread_cg_set(image: bytes) -> bytes | None:
    """A ``core-<tid>.img`` without its thread's own cgroup set (None: it has none).

    CRIU 4.1 records a separate cgroup set for every thread of a sandbox process other
    than pid 1 (it copies the cgroup namespace prefix onto the process's set only
    after the thread's set was compared with it: criu/cgroup.c dump_thread_cgroup),
    and restoring with ``--manage-cgroups=ignore`` then asks its cgroupd to move each
    such thread, which has no cgroup yard in that mode and fails ("The message from
    cgroupd is truncated"): any code context with a thread (numpy's BLAS pool, a
    ``threading.Thread``) could not be resumed. Every thread of a sandbox is in its
    process's cgroup (the sandbox's; nothing in it may move threads), so without the
    field a restored thread stays where its process is restored: the new cgroup."""
    if len(image) < _MAGIC_LEN + 4:
        raise ValueError("too short for a CRIU image")
    (size,) = struct.unpack_from("<I", image, _MAGIC_LEN)
    body = image[_MAGIC_LEN + 4 : _MAGIC_LEN + 4 + size]
    if len(body) != size or len(image) != _MAGIC_LEN + 4 + size:
        raise ValueError("a core image holds exactly one entry")
    for tag, wire, start, end in _fields(body):
        if tag != _CORE_THREAD_CORE or wire != 2:
            continue
        _, value_at = _read_varint(body, start)  # the key
        _, value_at = _read_varint(body, value_at)  # the length
        inner = body[value_at:end]
        kept = [inner[s:e] for t, _w, s, e in _fields(inner) if t != _THREAD_CG_SET]
        new_inner = b"".join(kept)
        if len(new_inner) == len(inner):
            return None
        new_body = (
            body[:start]
            + _varint(_CORE_THREAD_CORE << 3 | 2)
            + _varint(len(new_inner))
            + new_inner
            + body[end:]
        )
        return image[:_MAGIC_LEN] + struct.pack("<I", len(new_body)) + new_body
    return None


# --- a user namespace made by the host ----------------------------------------------

_CLONE_NEWUSER = 0x10000000
USER_LIMITS = ("max_inotify_instances", "max_inotify_watches", "max_user_namespaces")
"""The ``/proc/sys/user`` limits sandlot sets in a checkpointable sandbox's user
namespace (the sandbox's share of root's per-user quotas, see :func:`make_userns`)."""


def _write_user_limits(limits: Mapping[str, int]) -> None:
    """Set ``limits`` (:data:`USER_LIMITS`) in the calling process's user namespace
    (which needs CAP_SYS_RESOURCE there); each read back."""
    for name, value in limits.items():
        if name not in USER_LIMITS:
            raise ValueError(f"not a user namespace limit sandlot sets: {name}")
        path = "/proc/sys/user/" + name
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"%d\n" % value)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            if int(os.read(fd, 64)) != value:
                raise OSError(f"{path} did not take {value}")
        finally:
            os.close(fd)


class _UnshareUser:
    """``preexec_fn`` of the placeholder process: enter a new user namespace and set
    its limits (its creator holds every capability in it, before any map is written)."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.limits = dict(limits)

    def __call__(self) -> None:
        if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
        _write_user_limits(self.limits)


def make_userns(maps: UsernsMaps, limits: Mapping[str, int] | None = None) -> int:
    """A new user namespace with ``maps``, owned by root; returns a descriptor of it
    (``bwrap --userns`` takes it), which the caller closes.

    ``limits``: its ``/proc/sys/user`` limits (:data:`USER_LIMITS`). The kernel charges
    inotify instances and watches made in a user namespace to its owner in the parent
    namespace as well, and checks them against the limits of every level: in a
    namespace owned by root, against root's host-wide quota (128 inotify instances by
    default), which every checkpointable sandbox and root's own processes (CRIU among
    them) draw on. The limits of the sandbox's own namespace bound its part of it.

    Owned by root, not by the sandbox's host uid: CRIU reads a task's rlimits with
    ``prlimit``, which across users needs CAP_SYS_RESOURCE in the task's user namespace,
    and root has every capability in a namespace it owns even where the host has taken
    CAP_SYS_RESOURCE from it. Writing maps of more than one line takes CAP_SETUID and
    CAP_SETGID on the host: root only. setgroups is denied in it, as bubblewrap does for
    the namespaces it makes.

    A placeholder process (``sleep``) makes it and is gone when this returns; the
    descriptor keeps the namespace alive."""
    holder = subprocess.Popen(
        ["sleep", "30"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_UnshareUser(limits or {}),
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
        return os.open(f"{base}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


# --- the root a restored sandbox's mounts go on -------------------------------------

_MOUNT_OPTIONS = {"--ro-bind": 2, "--bind": 2, "--dev-bind": 2, "--tmpfs": 1, "--proc": 1}
_MOUNT_OPTIONS |= {"--dev": 1, "--mqueue": 1, "--dir": 1}
_SKIP_ONE = {"--perms", "--size", "--chdir", "--hostname", "--uid", "--gid", "--seccomp"}
_SKIP_ONE |= {"--userns", "--cap-drop", "--cap-add", "--remount-ro", "--chmod"}


@dataclass(frozen=True, slots=True)
class MountPoint:
    """One path of a sandbox's root: a directory, a file (a bound file) or a symlink."""

    path: str
    kind: str
    """``dir``, ``file`` or ``symlink``."""
    target: str = ""
    """The symlink's target."""


def mount_points(argv: Sequence[str]) -> tuple[MountPoint, ...]:
    """The top of a sandbox's root filesystem as its bubblewrap command line builds it:
    every mount point (a bound file's is a file) and symlink, parents first. A
    restored sandbox's mounts go on a root that holds exactly these (CRIU records the
    mounts, not the empty root tmpfs bubblewrap made them on)."""
    points: dict[str, MountPoint] = {}

    def add(path: str, kind: str, target: str = "") -> None:
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            parent = "/" + "/".join(parts[:depth])
            points.setdefault(parent, MountPoint(parent, "dir"))
        points[path] = MountPoint(path, kind, target)

    args = list(argv[1 : argv.index("--")] if "--" in argv else argv[1:])
    i = 0
    while i < len(args):
        option = args[i]
        if option == "--symlink":
            add(args[i + 2], "symlink", args[i + 1])
            i += 3
        elif option == "--setenv":
            i += 3
        elif option in _MOUNT_OPTIONS:
            count = _MOUNT_OPTIONS[option]
            dest = args[i + count]
            kind = "dir"
            if count == 2 and not os.path.isdir(args[i + 1]):
                kind = "file"
            add(dest, kind)
            i += 1 + count
        elif option in _SKIP_ONE:
            i += 2
        else:
            i += 1
    return tuple(sorted(points.values(), key=lambda p: (p.path.count("/"), p.path)))


_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MNT_DETACH = 2


def read_only_root(root: str) -> None:
    """Make ``root`` a read-only bind mount of itself: CRIU binds the restored
    sandbox's ``/`` from it and keeps its flags (not the dumped root's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    target = root.encode()
    if libc.mount(target, target, None, _MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind-mount {root}")
    flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY
    if libc.mount(None, target, None, flags, None) != 0:
        errno_ = ctypes.get_errno()
        libc.umount2(target, _MNT_DETACH)
        raise OSError(errno_, f"remount {root} read-only")


def release_root(root: str) -> None:
    """Undo :func:`read_only_root` and remove ``root`` (once its sandbox is gone)."""
    ctypes.CDLL(None, use_errno=True).umount2(root.encode(), _MNT_DETACH)
    shutil.rmtree(root, ignore_errors=True)


def build_root(points: Sequence[MountPoint], root: str) -> None:
    """Make the directories, empty files and symlinks of ``points`` under ``root``
    (owned by root, not writable by the sandbox's user)."""
    os.makedirs(root, mode=0o755, exist_ok=True)
    for point in points:
        path = os.path.join(root, point.path.lstrip("/"))
        if point.kind == "dir":
            os.makedirs(path, mode=0o755, exist_ok=True)
        elif point.kind == "file":
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(path, "a"):
                pass
        elif not os.path.lexists(path):
            os.symlink(point.target, path)


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
    action_script: str = ""
    """An executable CRIU runs at each stage of the restore (:func:`limits_script`)."""


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
    # The restored tree stays in the cgroup CRIU runs in: the new sandbox's.
    argv += ["--manage-cgroups=ignore"]
    for fd, key in plan.inherit:
        argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
    if plan.action_script:
        argv += ["--action-script", plan.action_script]
    return argv


def limits_script(limits: Mapping[str, int], python: str) -> str:
    """The text of a CRIU action script (run by ``python``) that gives the restored
    sandbox's user namespace ``limits`` (:data:`USER_LIMITS`, as :func:`make_userns`
    does for a sandbox it starts): CRIU creates that namespace anew and does not restore
    its ``/proc/sys/user`` limits, which start unlimited. It acts at the
    ``setup-namespaces`` stage, once the namespaces exist and before any of the
    sandbox's processes runs again; it enters the user namespace (root owns it, so it
    may) and writes them there. A failure fails the restore."""
    for name in limits:
        if name not in USER_LIMITS:
            raise ValueError(f"not a user namespace limit sandlot sets: {name}")
    values = {name: int(value) for name, value in limits.items()}
    return (
        f"#!{python} -I\n"
        "import ctypes, os, sys\n"
        "if os.environ.get('CRTOOLS_SCRIPT_ACTION') != 'setup-namespaces':\n"
        "    sys.exit(0)\n"
        "ns = os.open('/proc/%s/ns/user' % int(os.environ['CRTOOLS_INIT_PID']), os.O_RDONLY)\n"
        f"if ctypes.CDLL(None, use_errno=True).setns(ns, {_CLONE_NEWUSER:#x}) != 0:\n"
        "    sys.exit('setns: ' + os.strerror(ctypes.get_errno()))\n"
        f"for name, value in {values!r}.items():\n"
        "    path = '/proc/sys/user/' + name\n"
        "    with open(path, 'w') as f:\n"
        "        f.write('%d\\n' % value)\n"
        "    with open(path) as f:\n"
        "        if int(f.read()) != value:\n"
        "            sys.exit(path + ' did not take the limit')\n"
    )


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
