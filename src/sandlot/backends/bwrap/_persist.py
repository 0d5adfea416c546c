"""Checkpoint and restore of bubblewrap sandboxes (pause, snapshots, fork).

A checkpointable sandbox (``SandboxSpec.checkpointable``) starts in the namespace
layout CRIU can checkpoint (:mod:`sandlot.backends._checkpoint`): one root-owned
user namespace made by the host, three host ids of its own. A checkpoint is a
directory: CRIU's images plus ``sandlot.json`` (what a restore needs besides them:
the sandbox's mount points, and which dumped descriptors were the host's channel and
stderr pipe, which each restored copy is handed anew).

A restored sandbox is new in every layer the host gives it: host ids (the checkpoint's
user namespace image rewritten per copy), cgroup with the spec's limits, channel,
stderr pipe, root directory; its namespaces are made by CRIU, its syscall filter and
capabilities come back from the images (as the kernel reported them at the dump).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandlot._exceptions import CheckpointError, IsolationUnavailable
from sandlot.backends import _cgroups, _checkpoint
from sandlot.backends._checkpoint import DumpPlan, MountPoint, RestorePlan
from sandlot.backends.bwrap._host import (
    SPAWNER,
    START_TIMEOUT,
    BwrapHandle,
    Enter,
    StderrTail,
    _ForkedSandbox,
    cgroup_for,
    host_ids,
)
from sandlot.backends.bwrap._quotas import RLIMIT_BY_NAME, shares
from sandlot.policy import SandboxSpec
from sandlot.protocol import encode

META = "sandlot.json"
"""The file of a checkpoint directory that is sandlot's, not CRIU's."""
META_VERSION = 1
ROOTS_DIR = "/run/sandlot/roots"
"""Where restored sandboxes' root directories live (root only), one per sandbox, named
``<owner pid>.<owner start time>.<random>`` like their cgroups, so that the roots of an
owner that died without cleaning up are found (:func:`sweep_orphan_roots`)."""
CRIU_TIMEOUT = 120.0
INHERIT_FD_BASE = 1000
PREPARE_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What a checkpointable sandbox's handle keeps for :func:`dump`."""

    mounts: tuple[MountPoint, ...]
    channel_fd: int
    """The runner's channel descriptor, as numbered in the sandbox."""


def info_from_argv(argv: list[str], channel_fd: int) -> CheckpointInfo:
    return CheckpointInfo(_checkpoint.mount_points(argv), channel_fd)


class IdGroup:
    """A checkpointable sandbox's three host id pairs (for its uid/gid 0, 1 and its
    user), held and given back together."""

    def __init__(self, held: list[Any]) -> None:
        self._held = held

    @property
    def pair(self) -> tuple[int, int]:
        """The sandbox user's host (uid, gid)."""
        pair: tuple[int, int] = self._held[2].pair
        return pair

    @property
    def root_pair(self) -> tuple[int, int]:
        """The host (uid, gid) of the sandbox's uid 0 (which nothing runs as, once the
        sandbox runs)."""
        pair: tuple[int, int] = self._held[0].pair
        return pair

    def maps(self) -> _checkpoint.UsernsMaps:
        root, one, user = (held.pair for held in self._held)
        return _checkpoint.sandbox_maps(root, one, user)

    def release(self) -> None:
        for held in self._held:
            held.release()


def _criu() -> str:
    if os.geteuid() != 0:
        raise CheckpointError(
            "checkpointable sandboxes need sandlot to run as root (CRIU checkpoints "
            "processes of other users)"
        )
    criu = _checkpoint.criu_path()
    version = None if criu is None else _checkpoint.criu_version(criu)
    if criu is None or version is None or version < _checkpoint.MIN_VERSION:
        raise CheckpointError(f"no usable CRIU 4.x on this host. Fix: {_checkpoint.CRIU_FIX}")
    return criu


def quota_share() -> tuple[dict[str, int], tuple[tuple[int, int], ...]]:
    """A checkpointable sandbox's share of root's per-user quotas: its user namespace's
    ``/proc/sys/user`` limits and its ``(RLIMIT_*, value)`` rlimits.

    Its user namespace is owned by root (CRIU needs that, see
    :func:`sandlot.backends._checkpoint.make_userns`; a restored one is made by CRIU,
    as root), and the kernel charges inotify instances and watches, message queue bytes
    and queued signals made in a namespace to its owner too: every checkpointable
    sandbox draws on root's host-wide quotas, which root's own processes (CRIU, sandlot)
    need as well. Without a share, one sandbox could take all of them. The shares are
    the zygote's (:func:`._quotas.shares`): 8 inotify instances of 128 by default, a
    sixteenth of the message queue bytes and queued signals."""
    share = shares(raise_limits=False)
    rlimits = tuple((RLIMIT_BY_NAME[name], value) for name, value in share.rlimits.items())
    return dict(share.user), rlimits


def checkpointable_ids() -> tuple[IdGroup, int]:
    """Three host id pairs and a user namespace mapping 0, 1 and 1000 to them, with the
    sandbox's share of root's quotas as its limits (its descriptor, for ``bwrap
    --userns``; the caller closes it)."""
    _criu()
    group = _three_host_ids()
    try:
        return group, _checkpoint.make_userns(group.maps(), quota_share()[0])
    except BaseException:
        group.release()
        raise


def _three_host_ids() -> IdGroup:
    """Three host id pairs of a checkpointable sandbox's own (for its uid/gid 0, 1 and
    its user); all or none are held."""
    held: list[Any] = []
    try:
        for _ in range(3):
            one = host_ids()
            if one is None:  # not root: _criu() refused already
                raise IsolationUnavailable("no host ids for a checkpointable sandbox")
            held.append(one)
    except BaseException:
        for one in held:
            one.release()
        raise
    return IdGroup(held)


def _pid1(handle: BwrapHandle) -> int:
    """The host pid of the sandbox's pid 1: bwrap's child, or the restored process."""
    process = handle.process
    if getattr(process, "is_pid_namespace_init", False):
        return int(process.pid)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    if len(children) != 1:
        raise CheckpointError("the sandbox's first process is gone")
    return int(children[0])


def _fd_key(pid: int, fd: int) -> str:
    """``socket:[inode]`` / ``pipe:[inode]``: how CRIU names what descriptor ``fd`` of
    ``pid`` holds (the key ``--inherit-fd`` replaces)."""
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def dump(handle: BwrapHandle, info: CheckpointInfo, dest: str) -> None:
    """Checkpoint ``handle``'s sandbox into the empty directory ``dest`` and end it."""
    criu = _criu()
    if os.listdir(dest):
        raise CheckpointError(f"{dest} is not empty")
    if isinstance(handle.process, _Restored):
        # Refused before anything is let go of, so the sandbox runs on: CRIU's dump
        # checks that it can enter the sandbox's namespaces from its user namespace by
        # opening /proc/<pid 1>/ns/*, which for the non-dumpable supervisor needs
        # CAP_SYS_PTRACE in the user namespace its memory belongs to; a restored
        # supervisor's memory was set up by CRIU, in the host's user namespace, so the
        # check fails ("One or more namespaces doesn't belong to the target user
        # namespace") and the dump would end the sandbox.
        raise CheckpointError(
            "this sandbox was restored from a checkpoint, and a restored sandbox cannot be "
            "checkpointed again yet (docs/persistence.md); it runs on"
        )
    pid1 = _pid1(handle)
    try:
        handle.prepare_checkpoint(PREPARE_TIMEOUT)
    except RuntimeError as exc:
        # Nothing was let go of unless the runner answered: the sandbox runs on when a
        # call was in flight; when the runner did not answer, it is ended (it may have).
        if "still running" not in str(exc):
            handle.kill()
        raise CheckpointError(f"cannot checkpoint the sandbox now: {exc}") from exc
    try:
        meta = {
            "version": META_VERSION,
            "backend": "bwrap",
            "channel": _fd_key(pid1, info.channel_fd),
            "channel_fd": info.channel_fd,
            "stderr": _fd_key(pid1, 2),
            "mounts": [[p.path, p.kind, p.target] for p in info.mounts],
        }
        plan = DumpPlan(pid=pid1, images_dir=dest)
        done = subprocess.run(
            _checkpoint.dump_argv(plan, criu=criu),
            capture_output=True,
            timeout=CRIU_TIMEOUT,
            check=False,
        )
        if done.returncode != 0:
            said = _log_tail(dest, "dump.log")
            raise CheckpointError(f"CRIU could not checkpoint the sandbox, which was ended: {said}")
        with open(os.path.join(dest, META), "w") as f:
            json.dump(meta, f)
    except BaseException:
        handle.kill()
        raise
    # CRIU ended the sandbox's processes; bwrap follows its child. kill() closes the
    # host's end of the channel; the handle gives its cgroup and host ids back.
    with contextlib.suppress(subprocess.TimeoutExpired):
        handle.process.wait(timeout=10)
    handle.kill()


def _log_tail(images: str, name: str) -> str:
    try:
        lines = Path(images, name).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in lines if "Error" in line]
    return " | ".join((errors or lines)[-4:])


class _Restored(_ForkedSandbox):
    """A restored sandbox's pid 1: this process's child (CRIU's --restore-sibling), so
    it is reaped here once it has exited."""

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)
        return code


def _stage(source: str, work: str, ids: IdGroup) -> None:
    """``work``: the checkpoint's images, hard-linked (not copied), the user namespace
    image written anew with ``ids``, and the core image of each thread CRIU gave a
    cgroup set of its own written without it (:func:`_checkpoint.drop_thread_cg_set`)."""
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if name == META or not os.path.isfile(path) or name.endswith(".log"):
            continue
        if name.startswith("core-") and name.endswith(".img"):
            with open(path, "rb") as f:
                try:
                    changed = _checkpoint.drop_thread_cg_set(f.read())
                except ValueError as exc:
                    raise CheckpointError(f"{path} is not a core image: {exc}") from exc
            if changed is not None:
                target = os.path.join(work, name)
                with open(target, "wb") as f:
                    f.write(changed)
                os.chmod(target, os.stat(path).st_mode & 0o777)
                continue
        try:
            os.link(path, os.path.join(work, name))
        except OSError:
            shutil.copy2(path, os.path.join(work, name))
    for name in os.listdir(work):
        if name.startswith("userns-"):
            os.unlink(os.path.join(work, name))
            shutil.copy2(os.path.join(source, name), os.path.join(work, name))
    _checkpoint.rewrite_userns(work, ids.maps())


def _staging(source: str) -> str:
    """A directory beside ``source`` (same filesystem: its images are hard-linked into
    it) that the restored sandbox's ids can read: CRIU's restored processes open some
    images after they have taken their ids in the new user namespace. It is reachable
    (mode 0711) but not listable, in a parent that is not listable either, under a
    random 128-bit name, and removed when the restore is done."""
    parent = os.path.dirname(os.path.abspath(source))
    for part in [*reversed(Path(parent).parents), Path(parent)]:
        if not os.stat(part).st_mode & 0o001:
            raise CheckpointError(
                f"restoring needs {parent} reachable by every user (o+x on it and its "
                f"parents; {part} is not): the restored sandbox opens its images as its "
                "own host ids"
            )
    hidden = os.path.join(parent, ".sandlot-restore")
    with contextlib.suppress(FileExistsError):
        os.mkdir(hidden, 0o711)
    st = os.lstat(hidden)
    if st.st_uid != 0 or st.st_mode & 0o7777 != 0o711 or not os.path.isdir(hidden):
        raise CheckpointError(f"{hidden} must be a directory of root's with mode 0711")
    work = os.path.join(hidden, secrets.token_hex(16))
    os.mkdir(work, 0o711)
    os.chmod(work, 0o711)  # whatever the umask
    return work


def restore(source: str, spec: SandboxSpec) -> BwrapHandle:
    """A new sandbox from the checkpoint in ``source`` (left as it was)."""
    criu = _criu()
    try:
        with open(os.path.join(source, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{source} holds no sandlot checkpoint: {exc}") from exc
    if meta.get("version") != META_VERSION or meta.get("backend") != "bwrap":
        raise CheckpointError(f"{source} is not a checkpoint this sandlot can restore")
    mounts = tuple(MountPoint(*m) for m in meta["mounts"])
    with contextlib.ExitStack() as cleanup:
        ids = _three_host_ids()
        failed = cleanup.enter_context(contextlib.ExitStack())
        failed.callback(ids.release)
        group = cgroup_for(spec)
        if group is not None:
            cleanup.callback(group.close_fds)
            failed.callback(group.destroy)
        os.makedirs(ROOTS_DIR, mode=0o700, exist_ok=True)
        _sweep_roots_once()
        root = os.path.join(ROOTS_DIR, _cgroups.owner_name(8))
        _checkpoint.build_root(mounts, root)
        _checkpoint.read_only_root(root)
        failed.callback(_checkpoint.release_root, root)
        work = _staging(source)
        cleanup.callback(shutil.rmtree, work, True)
        _stage(source, work, ids)
        # CRIU makes the user namespace anew, without its limits: the script sets them
        # before the sandbox runs. Its rlimits come back from the images.
        script = os.path.join(work, "limits.py")
        fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(_checkpoint.limits_script(quota_share()[0], sys.executable))
        host_sock, guest_sock = socket.socketpair()
        failed.callback(host_sock.close)
        err_r, err_pipe = os.pipe()
        failed.callback(os.close, err_r)
        # CRIU's restored tasks start as forks of it, with its descriptors: the ones it
        # hands over sit where no task's own descriptor (nor one CRIU adds while it
        # rebuilds socket pairs) would land on them.
        guest = fcntl.fcntl(guest_sock.fileno(), fcntl.F_DUPFD, INHERIT_FD_BASE)
        guest_sock.close()
        cleanup.callback(os.close, guest)
        err_w = fcntl.fcntl(err_pipe, fcntl.F_DUPFD, INHERIT_FD_BASE)
        os.close(err_pipe)
        cleanup.callback(os.close, err_w)
        plan = RestorePlan(
            images_dir=work,
            root=root,
            inherit=((guest, meta["channel"]), (err_w, meta["stderr"])),
            pidfile=os.path.join(work, "restored.pid"),
            action_script=script,
        )
        # --restore-sibling: the restored pid 1 becomes this process's child (CRIU's would
        # leave with CRIU, and the sandbox dies with its parent: --die-with-parent is
        # restored too). Started from the spawner thread, like every bwrap.
        argv = [*_checkpoint.restore_argv(plan, criu=criu), "--restore-sibling"]
        criu_run = SPAWNER.popen(
            argv,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(guest, err_w),
            close_fds=True,
            # CRIU runs in the new sandbox's cgroup: what it restores starts there.
            preexec_fn=Enter(group.attach_fds if group else (), None),
        )
        try:
            code = criu_run.wait(timeout=CRIU_TIMEOUT)
        except subprocess.TimeoutExpired:
            criu_run.kill()
            criu_run.wait()
            code = -signal.SIGKILL
        if code != 0:
            raise CheckpointError(
                f"CRIU could not restore the sandbox: {_log_tail(work, 'restore.log')}"
            )
        pid = int(Path(plan.pidfile).read_text())
        process = _Restored(pid)
        failed.callback(process.kill)
        tail = StderrTail(os.fdopen(err_r, "rb"))
        with contextlib.suppress(OSError):
            host_sock.sendall(encode({"type": "resumed", "id": "resumed"}))
        handle = BwrapHandle(
            host_sock,
            process,
            stderr_tail=tail,
            cgroup=group,
            resources=spec.resources,
            ids=ids,
            checkpointer=checkpointer(CheckpointInfo(mounts, int(meta["channel_fd"]))),
            on_release=lambda: _checkpoint.release_root(root),
        )
        failed.pop_all()
    handle.wait_ready(START_TIMEOUT)
    return handle


def sweep_orphan_roots() -> list[str]:
    """Unmount and remove the root directories of restored sandboxes whose owning
    process is gone (SIGKILLed before it could release them; its sandboxes died with
    it). Returns the names removed. Never touches a live owner's."""
    try:
        names = os.listdir(ROOTS_DIR)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if _cgroups.owner_gone(name):
            _checkpoint.release_root(os.path.join(ROOTS_DIR, name))
            removed.append(name)
    return removed


@functools.cache
def _sweep_roots_once() -> None:
    """:func:`sweep_orphan_roots`, at a process's first restore only."""
    with contextlib.suppress(OSError):
        sweep_orphan_roots()


def checkpointer(info: CheckpointInfo) -> Callable[[BwrapHandle, str], None]:
    """What a checkpointable sandbox's handle calls to checkpoint it."""
    return lambda handle, dest: dump(handle, info, dest)
