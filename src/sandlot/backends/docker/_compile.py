"""Policy -> container settings: one pure function for Docker and Podman, golden-tested.

:func:`build_create_body` takes the sandbox spec and a :class:`ContainerLayout`
(the image, the host paths of the runner, the engine's quirks) and returns the
body of the Engine API's ``POST /containers/create``, which dockerd and Podman's
Docker-compatible service both accept. It reads no files and starts nothing, so
every isolation decision below is visible in one place and checked by
``tests/unit/test_docker_compile.py``.

What the container gets (see SECURITY.md and docs/docker.md for what it does *not*):

* no network at all (``NetworkMode: none``: not even the engine's bridge); with a
  network policy still none, and the sandbox's own socket to the host's egress proxy
  bind-mounted read-only (the runner's forwarder serves ``127.0.0.1:3128`` from it);
* a read-only root (the template image); writable, size-capped tmpfs at
  ``/home/user`` (the working directory) and ``/tmp``; ``/dev/shm`` capped too;
* a host uid and gid of the container's own (:mod:`._accounts`: per-user kernel quotas
  are per container), named ``user`` by its own ``/etc/passwd`` and ``/etc/group``;
  every capability dropped, ``no-new-privileges``;
* a seccomp profile compiled from sandlot's deny policy (:mod:`._seccomp`), which
  also forbids new user namespaces and every mount call (Podman's default allows them);
* whole-sandbox cgroup limits: memory (swap off), pids and CPU; plus the runner's
  per-process rlimits, the same as under bubblewrap;
* no host mounts but the runner and protocol packages, read-only, sandlot's own
  neutral ``/etc/hosts`` and (empty) ``/etc/resolv.conf`` in place of the engine's,
  which copy the host's name servers, and the container's account files;
* an empty, read-only ``/sys`` (bubblewrap mounts none): neither the host's devices
  nor the cgroup tree are readable. The template image has no ``/root``, ``/var`` or
  ``/run`` and no setuid bit (:mod:`._image_build`); what Podman mounts there anyway
  is masked;
* the supervisor as pid 1: it reaps orphans like an init, and, being the pid
  namespace's init, cannot be signalled by the code it supervises. An engine init
  (``--init``, tini) would make the supervisor pid 2, which user code running as
  the same uid could SIGKILL; so ``Init`` is off on purpose;
* the protocol channel on the supervisor's stdin/stdout, which the host reaches
  through the engine's attach stream. User code never sees those descriptors: its
  stdout/stderr are pipes the supervisor reads, and the supervisor is non-dumpable;
* no container log (``LogConfig: none``): the protocol stream is not copied to the
  engine's disk;
* an optional OCI runtime passed through (``runsc`` for gVisor, ``kata-runtime``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandlot.backends._runner_config import egress_env
from sandlot.backends._runner_config import runner_config as shared_runner_config
from sandlot.policy import MiB, SandboxSpec
from sandlot.protocol.layout import (
    EGRESS_SOCKET_GUEST,
    GUEST_PATH,
    GUEST_PYTHON,
    HOME,
    LIB_GUEST,
)
from sandlot.runner import BOOTSTRAP

LABEL = "org.sandlot.sandbox"
"""Every container sandlot creates carries this label (value: the sandbox id)."""
LABEL_OWNER = "org.sandlot.owner"
"""``<host>:<pid>`` of the process that created the container, for orphan cleanup."""
"""Set on containers started ahead of time by a warm pool."""

ETC_DIR = str(Path(__file__).parent / "etc")
"""sandlot's own ``/etc`` files for containers, shipped in this package."""
ETC_FILES = ("hosts", "resolv.conf")
"""Files of ``ContainerLayout.etc_dir`` bound over the engine's own in ``/etc``: the
engine's resolv.conf lists the host's name servers, and code needs to learn nothing
of them (there is no network to use them on)."""
SYS_TMPFS = "ro,nosuid,nodev,noexec,mode=0555,size=4096"
"""Docker: an empty read-only tmpfs in place of sysfs at ``/sys`` (a user mount there
replaces the engine's sysfs, under runc and runsc alike; the cgroup mounts runc still
makes below it stay hidden under the tmpfs)."""
PODMAN_MASKED = ("/sys", "/run", "/var")
"""Podman: masked with empty read-only tmpfs (``mask=`` in ``SecurityOpt``; its API
ignores ``Tmpfs`` ordering and ``MaskedPaths``): sysfs, and the writable tmpfs it mounts
on ``/run`` and ``/var/tmp`` for a read-only root."""

RUNNER_MEMORY_HEADROOM_MB = 256
"""Added to ``memory_mb`` for the container's cgroup: the supervisor, the page cache
of the template and small tmpfs files live there too. A single process still gets
``MemoryError`` at ``memory_mb`` (its rlimit); the cgroup bounds the whole sandbox."""
RUNNER_PIDS_HEADROOM = 0
"""Added to ``pids`` for the cgroup. None: as under bwrap, ``pids`` bounds the whole
sandbox, the supervisor's threads included."""
GVISOR = "runsc"
GVISOR_HOST_TASKS_BASE = 128
GVISOR_HOST_TASKS_PER_PID = 10
"""Under gVisor the cgroup's ``pids.max`` counts the runsc Sentry's host tasks, not the
sandbox's: about 60 when idle, and about 8 more per sandbox process on the ptrace
platform (its stub). A bound of ``base + per_pid * pids`` keeps the host safe; the
sandbox's own limit is RLIMIT_NPROC (see :func:`runner_config`). A bomb that met the
host bound first would end the whole sandbox (the Go runtime cannot start a thread)."""
DEFAULT_NPROC_HARD = 4096
"""RLIMIT_NPROC the container starts with. Engines otherwise copy the daemon's
(often unlimited) value, which Podman cannot set without CAP_SYS_RESOURCE. It counts
the processes of the container's own host uid, so it is a per-container ceiling; the
per-sandbox process limit is the cgroup's ``pids.max``."""
ACCOUNT_FILES = ("passwd", "group")
"""Files of ``ContainerLayout.accounts_dir`` bound over the image's in ``/etc``: they
name the container's own uid and gid ``user`` (the image's name uid 1000)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerLayout:
    """What the host provides for one container (found by the backend, passed in here)."""

    image: str
    """The template image (``sandlot template build --backend docker``)."""
    protocol_dir: str
    """Host directory of :mod:`sandlot.protocol`, mounted read-only."""
    runner_dir: str
    """Host directory of :mod:`sandlot.runner`, mounted read-only."""
    etc_dir: str = ETC_DIR
    """Host directory holding the neutral ``hosts`` and ``resolv.conf`` (:data:`ETC_FILES`)."""
    seccomp: str
    """The seccomp profile: JSON text (Docker) or a host path (Podman), as the engine
    expects it after ``seccomp=`` in ``SecurityOpt``."""
    sandbox_id: str
    owner: str
    """``<host>:<pid>`` of the creating process (label for orphan cleanup)."""
    runtime: str | None = None
    """OCI runtime name registered with the engine (``runsc``, ``kata-runtime``);
    None: the engine's default (runc/crun)."""
    cpus: float | None = 1.0
    """CPUs the sandbox may use at once (cgroup CPU quota); None: unlimited."""
    uid: int
    gid: int
    """The container's own host uid and gid (:mod:`._accounts`): what it runs as, and
    the owner of its ``/home/user``."""
    accounts_dir: str
    """Host directory holding the container's ``passwd`` and ``group``
    (:data:`ACCOUNT_FILES`), which name ``uid`` and ``gid`` ``user``."""
    engine: str = "docker"
    """``docker`` or ``podman``: they spell a tmpfs's owner differently."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels (e.g. the template name)."""
    egress_socket: str | None = None
    """Host path of this sandbox's own socket to the egress proxy; required when the
    spec has a network policy, mounted read-only at ``EGRESS_SOCKET_GUEST``."""


def runner_config(spec: SandboxSpec, runtime: str | None = None) -> dict[str, object]:
    """The runner's ``configure`` message body: the same limits as under bubblewrap,
    except RLIMIT_NPROC, which the cgroup's ``pids.max`` replaces (see
    :data:`DEFAULT_NPROC_HARD`).

    Under gVisor (``runtime="runsc"``) it is the other way round: the sandbox runs on
    gVisor's own kernel, where the sandbox's uid has no processes but its own, so
    RLIMIT_NPROC = ``pids`` is the exact per-sandbox limit (enforced by gVisor), and
    the cgroup bounds only the Sentry's host tasks (:data:`GVISOR_HOST_TASKS_PER_PID`)."""
    # The caller's envs win over the proxy settings (their choice to break them).
    envs = {**egress_env(spec), **spec.envs}
    config = shared_runner_config(spec, channel_fd=0, cgroup_limits=True, envs=envs)
    if runtime == GVISOR:
        rlimits = config["rlimits"]
        assert isinstance(rlimits, dict)
        rlimits["nproc"] = spec.resources.pids
    return config


def guest_env() -> list[str]:
    """The container's environment. The caller's ``envs`` are not here: they travel in
    the runner's configuration, so neither ``docker inspect`` nor ``/proc/1/environ``
    shows them."""
    return [f"PATH={GUEST_PATH}", f"HOME={HOME}", "LANG=C.UTF-8"]


def runner_command() -> list[str]:
    """The supervisor, speaking the protocol on its stdin/stdout, in exactly the
    environment of :func:`guest_env` (``env -i``: nothing the engine adds, such as
    ``HOSTNAME``, nor the image's own ``ENV`` lines reach the sandbox; as bwrap's
    ``--clearenv``)."""
    return [
        "/usr/bin/env",
        "-i",
        *guest_env(),
        GUEST_PYTHON,
        "-I",
        "-B",
        "-c",
        BOOTSTRAP,
        LIB_GUEST,
        "supervisor",
        "--stdio",
    ]


def build_create_body(spec: SandboxSpec, layout: ContainerLayout) -> dict[str, Any]:
    """Return the Engine API ``/containers/create`` body that starts the runner for ``spec``."""
    r = spec.resources
    if layout.uid <= 0 or layout.gid <= 0:
        raise ValueError("a container never runs as host root (uid or gid 0)")
    labels = {
        **layout.labels,
        LABEL: layout.sandbox_id,
        LABEL_OWNER: layout.owner,
    }
    host: dict[str, Any] = {
        "NetworkMode": "none",
        "ReadonlyRootfs": True,
        "CapDrop": ["ALL"],
        "CapAdd": [],
        "Privileged": False,
        "SecurityOpt": ["no-new-privileges", f"seccomp={layout.seccomp}"],
        "IpcMode": "private",
        "Init": False,
        "Tmpfs": {
            "/tmp": _tmpfs(r.tmp_mb, "1777"),
            HOME: _tmpfs(r.disk_mb, "0755", owner=layout),
        },
        "ShmSize": (r.tmp_mb or 64) * MiB,
        "Mounts": [
            _ro_bind(layout.protocol_dir, f"{LIB_GUEST}/sandlot/protocol"),
            _ro_bind(layout.runner_dir, f"{LIB_GUEST}/sandlot/runner"),
            *(_ro_bind(f"{layout.etc_dir}/{name}", f"/etc/{name}") for name in ETC_FILES),
            *(_ro_bind(f"{layout.accounts_dir}/{n}", f"/etc/{n}") for n in ACCOUNT_FILES),
        ],
        "Ulimits": _ulimits(r.open_files),
        "LogConfig": {"Type": "none", "Config": {}},
        "RestartPolicy": {"Name": "no"},
        # The container is removed by the engine as soon as it exits, so a client
        # killed with SIGKILL leaves nothing behind: its attach stream closes, the
        # supervisor reads EOF on stdin and exits, and the engine removes the rest.
        "AutoRemove": True,
    }
    if layout.engine == "podman":
        host["SecurityOpt"].append("mask=" + ":".join(PODMAN_MASKED))
    else:
        host["Tmpfs"]["/sys"] = SYS_TMPFS
    if r.memory_mb is not None:
        memory = (r.memory_mb + RUNNER_MEMORY_HEADROOM_MB) * MiB
        host["Memory"] = memory
        host["MemorySwap"] = memory  # equal to Memory: no swap
    if r.pids is not None and layout.runtime == GVISOR:
        host["PidsLimit"] = GVISOR_HOST_TASKS_BASE + GVISOR_HOST_TASKS_PER_PID * r.pids
    elif r.pids is not None:
        host["PidsLimit"] = r.pids + RUNNER_PIDS_HEADROOM
    if layout.cpus is not None:
        host["NanoCpus"] = int(layout.cpus * 1e9)
    if layout.runtime is not None:
        host["Runtime"] = layout.runtime
    if spec.network.enabled:
        if layout.egress_socket is None:
            raise ValueError("a sandbox with a network policy needs its egress socket")
        host["Mounts"].append(_ro_bind(layout.egress_socket, EGRESS_SOCKET_GUEST))
    return {
        "Image": layout.image,
        "Entrypoint": runner_command(),
        "Cmd": [],
        "User": f"{layout.uid}:{layout.gid}",
        "WorkingDir": HOME,
        "Env": guest_env(),
        "Hostname": "sandlot",
        "NetworkDisabled": True,
        "Labels": labels,
        # stdin stays open until the host's attach stream closes it (StdinOnce):
        # that EOF is how the supervisor learns its host is gone.
        "OpenStdin": True,
        "StdinOnce": True,
        "AttachStdin": True,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": False,
        "StopSignal": "SIGKILL",
        "HostConfig": host,
    }


def _tmpfs(size_mb: int | None, mode: str, *, owner: ContainerLayout | None = None) -> str:
    # exec: as under bubblewrap, scripts written to the workspace can be run.
    options = ["rw", "exec", "nosuid", "nodev", f"mode={mode}"]
    if size_mb is not None:
        options.append(f"size={size_mb * MiB}")
    if owner is not None and owner.engine == "podman":
        options.append("U")  # chown to the container's user (Podman has no uid=/gid=)
    elif owner is not None:
        options += [f"uid={owner.uid}", f"gid={owner.gid}"]
    return ",".join(options)


def _ro_bind(source: str, target: str) -> dict[str, Any]:
    return {"Type": "bind", "Source": source, "Target": target, "ReadOnly": True}


def _ulimits(open_files: int | None) -> list[dict[str, Any]]:
    nofile = open_files or 1024
    return [
        {"Name": "nofile", "Soft": nofile, "Hard": nofile},
        {"Name": "nproc", "Soft": DEFAULT_NPROC_HARD, "Hard": DEFAULT_NPROC_HARD},
        {"Name": "core", "Soft": 0, "Hard": 0},
    ]


def label_filter(labels: Sequence[str]) -> dict[str, list[str]]:
    """Engine API ``filters`` selecting containers by label."""
    return {"label": list(labels)}
