"""Policy -> bubblewrap argv: a pure function, golden-tested without privileges.

:func:`build_argv` takes the sandbox spec and a :class:`HostLayout` (every host
path the sandbox may see, discovered by the backend) and returns the complete
``bwrap`` command line. It reads no files and starts nothing, so every isolation
decision below is visible in one place and checked by ``tests/unit``.

What the argv sets up (see SECURITY.md for what it does *not* guarantee):

* new user, pid, network, ipc, uts and cgroup namespaces; nested user namespaces
  disabled (``--disable-userns``); a new session (no TIOCSTI into the caller's tty);
  the sandbox dies with its parent;
* uid/gid 1000 inside, no capabilities (bwrap drops them for the command);
* a read-only root built from scratch: ``/usr`` (and the merged-/usr symlinks),
  the few ``/etc`` files programs need, generated ``passwd``/``group``/``hosts``,
  the template (``/opt/sandlot/template``) and the runner (``/opt/sandlot/lib``);
  nothing else of the host: no ``/root``, ``/home``, ``/tmp``, ``/sys``, ``/var``,
  ``/run``, no project directory;
* writable, size-capped tmpfs at ``/home/user`` (the working directory), ``/tmp`` and
  ``/dev/shm``; a private ``/proc`` and a minimal, read-only ``/dev``;
* an environment of only ``PATH``, ``HOME``, ``LANG`` and the caller's ``envs``
  (``--clearenv``; the backend also starts bwrap itself with an empty environment,
  so ``/proc/1/environ`` inside holds nothing of the host).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from sandlot.backends._runner_config import egress_env
from sandlot.backends._runner_config import runner_config as shared_runner_config
from sandlot.policy import MiB, SandboxSpec
from sandlot.protocol.layout import EGRESS_PORT as EGRESS_PORT  # re-exported
from sandlot.protocol.layout import (
    EGRESS_SOCKET_GUEST,
    GUEST_PATH,
    GUEST_PYTHON,
    HOME,
    LIB_GUEST,
    SANDBOX_GID,
    SANDBOX_UID,
    TEMPLATE_GUEST,
)
from sandlot.runner import BOOTSTRAP

# Host /etc entries programs in the sandbox legitimately need. Nothing with secrets:
# no shadow, no ssh keys, no machine-id, no resolv.conf (names are never resolved
# inside: with a network policy, the host's egress proxy resolves them).
ETC_ENTRIES: tuple[str, ...] = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/fonts",
    "/etc/ssl/certs",
    "/etc/ca-certificates.conf",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/os-release",
)
GENERATED_ETC: tuple[str, ...] = ("passwd", "group", "hosts", "nsswitch.conf", "hostname")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLayout:
    """Host paths the sandbox is built from (found by the backend, passed in here)."""

    template_dir: str
    """The built template directory, mounted read-only at ``/opt/sandlot/template``."""
    base_prefix: str
    """Prefix of the template's base interpreter; bound read-only at the same path
    when it is outside ``/usr`` (e.g. a pyenv build)."""
    protocol_dir: str
    runner_dir: str
    generated_etc_dir: str
    """Directory holding sandlot's own passwd, group, hosts, nsswitch.conf, hostname."""
    root_symlinks: Mapping[str, str] = field(default_factory=dict)
    """Top-level host paths that are symlinks (merged /usr): ``{"/bin": "usr/bin"}``."""
    root_dirs: Sequence[str] = ()
    """Top-level library/binary dirs that are real directories: ``["/lib64"]``."""
    etc_entries: Sequence[str] = ()
    """The subset of :data:`ETC_ENTRIES` that exists on this host."""
    channel_fd: int = 3
    """The runner's end of the protocol socket, as numbered in the sandbox."""
    disable_userns: bool = True
    """bwrap >= 0.8 can forbid nested user namespaces; the backend refuses older ones."""
    seccomp_fd: int = 4
    """A file descriptor holding the BPF program of :mod:`sandlot.seccomp` (always on)."""
    egress_socket: str | None = None
    """Host path of this sandbox's own socket to the egress proxy; required when the
    spec has a network policy, mounted at :data:`EGRESS_SOCKET_GUEST`."""
    userns_fd: int | None = None
    """A user namespace the host made for a checkpointable sandbox
    (:func:`sandlot.backends._checkpoint.make_userns`): bwrap joins it instead of making
    its own, nested one, which CRIU cannot checkpoint."""


def runner_config(
    spec: SandboxSpec, channel_fd: int, cgroup_limits: bool = True
) -> dict[str, object]:
    """The runner's configuration: limits it applies to itself and enforces per cell.

    ``cgroup_limits``: the whole-sandbox cgroup limits are in place (False only in the
    caller's explicit best-effort mode)."""
    # The caller's envs win over the proxy settings (their choice to break them).
    envs = {**egress_env(spec), **spec.envs}
    return shared_runner_config(spec, channel_fd=channel_fd, cgroup_limits=cgroup_limits, envs=envs)


def guest_env(spec: SandboxSpec) -> dict[str, str]:
    """The environment bwrap gives the runner. The caller's ``envs`` are not here: they
    travel in the runner's configuration, so no command line ever carries them."""
    return {"PATH": GUEST_PATH, "HOME": HOME, "LANG": "C.UTF-8"}


def build_argv(spec: SandboxSpec, layout: HostLayout, bwrap: str = "bwrap") -> list[str]:
    """Return the full bubblewrap command line that starts the runner for ``spec``."""
    r = spec.resources
    argv: list[str] = [bwrap]
    # Namespaces. --unshare-user (not -try): without a user namespace bwrap would need
    # setuid, and we never run it that way. A checkpointable sandbox joins the one the
    # host made instead (bwrap then runs as root and makes the others inside it): one
    # user namespace, not nested, which CRIU can checkpoint. Its nested namespaces are
    # refused by the syscall filter, as for every sandbox; and it drops every capability,
    # bounding set included, which bwrap run as root would otherwise keep there.
    if layout.userns_fd is None:
        argv.append("--unshare-user")
    else:
        argv += ["--userns", str(layout.userns_fd), "--cap-drop", "ALL"]
    argv += [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    if layout.disable_userns and layout.userns_fd is None:
        argv.append("--disable-userns")
    # The syscall filter (sandlot.seccomp), installed by bwrap with no_new_privs just
    # before it execs the runner: every process in the sandbox inherits it.
    argv += ["--seccomp", str(layout.seccomp_fd)]
    # --as-pid-1: the supervisor is the sandbox's init. Signals from inside the pid
    # namespace without a handler (SIGKILL, SIGSTOP included) never reach it, so user
    # code cannot kill or freeze it; bwrap keeps no process inside holding the channel.
    argv += ["--as-pid-1", "--die-with-parent", "--new-session"]
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", "sandlot"]

    # Environment: nothing from the host.
    argv.append("--clearenv")
    for key, value in guest_env(spec).items():
        argv += ["--setenv", key, value]

    # Read-only system view.
    argv += ["--ro-bind", "/usr", "/usr"]
    for path, target in sorted(layout.root_symlinks.items()):
        argv += ["--symlink", target, path]
    for path in layout.root_dirs:
        argv += ["--ro-bind", path, path]
    for path in layout.etc_entries:
        argv += ["--ro-bind", path, path]
    for name in GENERATED_ETC:
        argv += ["--ro-bind", f"{layout.generated_etc_dir}/{name}", f"/etc/{name}"]
    if not _under(layout.base_prefix, "/usr"):
        argv += ["--ro-bind", layout.base_prefix, layout.base_prefix]
    argv += ["--ro-bind", layout.template_dir, TEMPLATE_GUEST]
    argv += ["--ro-bind", layout.protocol_dir, f"{LIB_GUEST}/sandlot/protocol"]
    argv += ["--ro-bind", layout.runner_dir, f"{LIB_GUEST}/sandlot/runner"]
    if spec.network.enabled:
        # The network namespace stays unshared (loopback only): the sandbox's one way
        # out is its own socket to the host's egress proxy, which decides per request.
        if layout.egress_socket is None:
            raise ValueError("a sandbox with a network policy needs its egress socket")
        argv += ["--ro-bind", layout.egress_socket, EGRESS_SOCKET_GUEST]

    # Kernel filesystems.
    argv += ["--proc", "/proc", "--dev", "/dev"]

    # Writable, size-capped scratch space.
    argv += _tmpfs("/tmp", r.tmp_mb, "1777")
    argv += _tmpfs("/dev/shm", r.tmp_mb, "1777")
    argv += _tmpfs(HOME, r.disk_mb, "0755")
    argv += ["--chdir", HOME]
    # Nothing can be created in /dev either: bwrap's --dev is a tmpfs with no size
    # option (the kernel default, half the host's RAM), writable by the sandbox user,
    # which bypassed disk_mb and tmp_mb. A remount is not recursive: the device nodes,
    # /dev/pts and the capped /dev/shm (mounted above) stay writable.
    argv += ["--remount-ro", "/dev"]
    # Nothing can be created at the top level once the mounts are in place.
    argv += ["--remount-ro", "/"]

    argv += [
        "--",
        GUEST_PYTHON,
        "-I",
        "-B",
        "-c",
        BOOTSTRAP,
        LIB_GUEST,
        "supervisor",
        "--fd",
        str(layout.channel_fd),
    ]
    return argv


ZYGOTE_CAPS: tuple[str, ...] = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP")
"""What the zygote keeps, inside its own user namespace only (host: none): new
namespaces and mounts for each sandbox it forks (SYS_ADMIN), their loopback up
(NET_ADMIN), and dropping every capability from their bounding set (SETPCAP)."""


def build_zygote_argv(
    spec: SandboxSpec, layout: HostLayout, children_filter_fd: int, bwrap: str = "bwrap"
) -> list[str]:
    """The zygote's bubblewrap command line: the boundary :func:`build_argv` draws for
    ``spec`` (its template, no network), plus :data:`ZYGOTE_CAPS`, running the zygote
    role. ``layout.seccomp_fd`` holds the zygote's own filter
    (:func:`sandlot.seccomp.zygote_denials`), ``children_filter_fd`` the full one every
    sandbox it forks installs before it runs anything.

    Without ``--disable-userns``: the zygote gives each sandbox it forks a user
    namespace of its own (where that sandbox's share of the per-user kernel quotas is
    set); each sets its own ``user.max_user_namespaces`` to 0, and the full filter
    refuses new namespaces anyway."""
    if spec.network.enabled:
        raise ValueError("a zygote has no network; sandboxes with a policy start cold")
    argv = build_argv(spec, replace(layout, disable_userns=False), bwrap)
    boundary = argv[: argv.index("--")]
    caps = [arg for cap in ZYGOTE_CAPS for arg in ("--cap-add", cap)]
    command = [GUEST_PYTHON, "-I", "-B", "-c", BOOTSTRAP, LIB_GUEST, "zygote"]
    fds = ["--fd", str(layout.channel_fd), "--filter-fd", str(children_filter_fd)]
    return [*boundary, *caps, "--", *command, *fds]


def _tmpfs(path: str, size_mb: int | None, perms: str) -> list[str]:
    args = ["--perms", perms]
    if size_mb is not None:
        args += ["--size", str(size_mb * MiB)]
    return [*args, "--tmpfs", path]


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")
