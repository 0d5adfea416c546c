"""The container backends: Docker and Podman, hardened, behind the same seam as bwrap.

Both engines speak the Docker Engine API (Podman through ``podman system service``),
so one piece of glue serves both; what differs is an :class:`EngineKind`. The
isolation decisions live in the pure :func:`._compile.build_create_body`; the
seccomp profile comes from :mod:`sandlot.seccomp` through :mod:`._seccomp`.

The sandbox is the same runner as under bubblewrap, speaking the same protocol, so
every SDK behaviour is identical. The protocol travels on the supervisor's
stdin/stdout through the engine's attach stream (no host socket, no network).

* ``Sandbox(backend="docker")``: dockerd with its default runtime (runc).
* ``Sandbox(backend=DockerBackend(runtime="runsc"))``: gVisor (or ``kata-runtime``).
* ``Sandbox(backend="podman")``: Podman (rootful), through its API socket.
* Each container runs as a host uid and gid of its own from the range delegated to
  sandlot (:mod:`._accounts`), held for its life: the kernel's per-user quotas are per
  container. No range, or none free: the start is refused (IsolationUnavailable).
* :func:`cleanup_orphans`: remove sandlot containers whose creator is gone (servers
  call each backend's :meth:`~sandlot.backends.Backend.cleanup_orphans`, which does
  this for its engine, at start-up). ``Sandbox(backend=..., pool=sandlot.Pool(...))`` keeps warm
  containers: started, runner up, data stack imported.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import sandlot.protocol
import sandlot.runner
from sandlot._exceptions import (
    BackendUnavailable,
    IsolationUnavailable,
    SandboxStartError,
    TemplateError,
)
from sandlot._models import NetworkEvent, ResourceUsage
from sandlot.backends import _hostids
from sandlot.backends._base import Backend, Finding, Probe, SandboxHandle, owner_alive
from sandlot.backends._channel import ChannelHandle
from sandlot.backends.docker import _accounts
from sandlot.backends.docker._compile import (
    LABEL,
    LABEL_OWNER,
    RUNNER_MEMORY_HEADROOM_MB,
    ContainerLayout,
    build_create_body,
    runner_config,
)
from sandlot.backends.docker._engine import (
    DOCKER,
    PODMAN,
    AttachPump,
    ContainerProcess,
    Engine,
    EngineKind,
    engine_url,
)
from sandlot.backends.docker._image import build_image, image_current, image_name
from sandlot.backends.docker._seccomp import profile_json
from sandlot.egress import EgressLease, EgressProxy, default_proxy
from sandlot.policy import SandboxSpec
from sandlot.protocol import encode
from sandlot.templates import cache_dir

__all__ = [
    "DockerBackend",
    "PodmanBackend",
    "build_template_image",
    "cleanup_orphans",
    "container_backend_problem",
    "host_ids_finding",
    "owner_tag",
]

START_TIMEOUT = 120.0
"""Seconds for a container to come up with its runner ready (gVisor's ptrace
platform on a busy two-core host needs far more than runc)."""


def owner_tag(pid: int | None = None) -> str:
    """``<hostname>:<pid>``: the label value naming a container's creating process."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


_ENGINES: dict[tuple[str, str], Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_for(kind: EngineKind) -> Engine:
    url = engine_url(kind)
    if url is None:
        raise BackendUnavailable(f"no {kind.name} API socket found. Fix: {kind.fix}")
    with _ENGINES_LOCK:
        engine = _ENGINES.get((kind.name, url))
        if engine is None:
            engine = _ENGINES[(kind.name, url)] = Engine(kind, url)
        return engine


def _unix_unreachable(path: str) -> str | None:
    """Why nothing answers on the unix socket ``path``, or None if something listens."""
    if not os.path.exists(path):
        return "no socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(5)
        probe.connect(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        probe.close()
    return None


def _probe(kind: EngineKind, runtime: str | None, name: str, strength: int) -> Probe:
    return _probe_at(kind, runtime, name, strength, engine_url(kind))


@functools.lru_cache(maxsize=16)
def _probe_at(
    kind: EngineKind, runtime: str | None, name: str, strength: int, url: str | None
) -> Probe:
    """Probe once per endpoint (DOCKER_HOST may change between calls, e.g. in tests)."""
    details: dict[str, str] = {}
    try:
        import docker  # noqa: F401
    except ImportError:
        return Probe(
            name, False, "the docker Python package (the engine's API client) is not installed",
            "pip install 'sandlot[docker]'", strength, details,
        )  # fmt: skip
    if url is None:
        return Probe(name, False, f"no {kind.name} API socket found", kind.fix, strength, details)
    details["endpoint"] = url
    if url.startswith("unix://"):
        # Checked here, with a socket that is closed either way: the SDK leaks the
        # socket of a failed unix connect (no file, or a stale one nobody listens on).
        problem = _unix_unreachable(url[len("unix://") :])
        if problem is not None:
            return Probe(
                name, False, f"the {kind.name} engine does not answer: {problem} at {url}",
                kind.fix, strength, details,
            )  # fmt: skip
    try:
        engine = _engine_for(kind)
        info = engine.info()
        version = engine.version()
    except Exception as exc:  # any failure to talk to the engine means "unavailable"
        return Probe(
            name, False, f"the {kind.name} engine at {url} does not answer: {exc}", kind.fix,
            strength, details,
        )  # fmt: skip
    details["engine"] = (
        f"{kind.name} {version.get('Version', '?')} (API {version.get('ApiVersion', '?')})"
    )
    details["cgroup driver"] = (
        f"{info.get('CgroupDriver', '?')}, cgroup v{info.get('CgroupVersion', '?')}"
    )
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    details["runtimes"] = ", ".join(runtimes) or "?"
    details["default runtime"] = str(info.get("DefaultRuntime", "?"))
    details["runtime"] = runtime or f"{info.get('DefaultRuntime', '?')} (default)"
    if runtime is not None and runtimes and runtime not in runtimes:
        return Probe(
            name, False,
            f"OCI runtime {runtime!r} is not registered with {kind.name} "
            f"(it has: {', '.join(runtimes)})",
            f"register it, e.g. in /etc/docker/daemon.json: "
            f'{{"runtimes": {{"{runtime}": {{"path": "/usr/bin/{runtime}"}}}}}} and reload dockerd',
            strength, details,
        )  # fmt: skip
    for template in ("python-data",):
        details[f"image {template}"] = (
            "built" if image_current(engine, template) else
            f"not built (sandlot template build --backend {kind.name})"
        )  # fmt: skip
    return Probe(name, True, "", "", strength, details)


class _ContainerBackend(Backend):
    """Shared glue for engines that speak the Docker Engine API."""

    kind: ClassVar[EngineKind] = DOCKER
    strength: ClassVar[int] = 5

    def __init__(
        self,
        *,
        runtime: str | None = None,
        cpus: float | None = 1.0,
        base_image: str | None = None,
        egress: EgressProxy | None = None,
    ) -> None:
        """``runtime``: an OCI runtime registered with the engine (``runsc`` for gVisor,
        ``kata-runtime``), default the engine's. ``cpus``: CPUs the sandbox may use at
        once. ``base_image``: used only when the template's image must be built.
        ``egress``: the proxy for sandboxes with a network policy (default: the
        process-wide :func:`sandlot.egress.default_proxy`)."""
        self.egress = egress
        self.runtime = runtime if runtime is not None else os.environ.get(self._runtime_env())
        self.cpus = cpus
        self.base_image = base_image
        self._seccomp_path: str | None = None

    @classmethod
    def _runtime_env(cls) -> str:
        return f"SANDLOT_{cls.kind.name.upper()}_RUNTIME"

    @classmethod
    def probe(cls) -> Probe:
        return _probe(cls.kind, os.environ.get(cls._runtime_env()) or None, cls.name, cls.strength)

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        return _remove_orphans(cls.kind)

    @classmethod
    def checks(cls) -> list[Finding]:
        # Only where an engine is configured: without one the probe says what is missing.
        return [host_ids_finding()] if engine_url(cls.kind) is not None else []

    def probe_instance(self) -> Probe:
        """Like :meth:`probe`, for this instance's runtime."""
        return _probe(self.kind, self.runtime, self.name, self.strength)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(runtime={self.runtime!r})"

    def pool_key(self) -> tuple[object, ...]:
        return (self.name, self.runtime, self.cpus, engine_url(self.kind))

    # --- images -----------------------------------------------------------------------
    def ensure_image(self, template: str) -> str:
        engine = _engine_for(self.kind)
        if image_current(engine, template):
            return image_name(template)
        return build_image(engine, template, base=self.base_image, progress=_say)

    def _seccomp(self) -> str:
        profile = profile_json()
        if self.kind.seccomp_inline:
            return profile
        # Podman reads the profile from a file on its host.
        if self._seccomp_path is None:
            directory = cache_dir() / "seccomp"
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"profile-{hashlib.sha256(profile.encode()).hexdigest()[:16]}.json"
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(profile)
                tmp.replace(path)
            self._seccomp_path = str(path)
        return self._seccomp_path

    # --- start ------------------------------------------------------------------------
    def start(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.network.enabled:
            self._check_egress_possible()
        probe = self.probe_instance()
        if not probe.available:
            raise BackendUnavailable(
                f"{self.name} backend unavailable: {probe.reason}. Fix: {probe.fix}"
            )
        # The container's own host uid and gid, held until it is gone (given back by the
        # handle's exit, or here if the start fails). Fail closed: no range, none free.
        ids = _accounts.acquire()
        try:
            if not spec.network.enabled:
                return self._start(spec, None, ids)
            # The sandbox's own socket on the egress proxy, for the container to mount
            # read-only, given to the container's uid; it goes with the container.
            proxy = self.egress or default_proxy()
            lease = proxy.open(spec.sandbox_id or "sandbox", spec.network, (ids.uid, ids.gid))
            try:
                return self._start(spec, lease, ids)
            except BaseException:
                lease.close()
                raise
        except BaseException:
            # _start removed its container, if it made one. Should a process of it still
            # run as the uid, the allocator skips the uid until none does.
            ids.release()
            raise

    def _check_egress_possible(self) -> None:
        """Refuse a network policy where the egress socket cannot work, before touching
        the engine or the proxy. The container keeps ``NetworkMode: none``; the socket is
        its only way out. Fail closed for runtimes that do not pass a host unix socket
        through (gVisor without ``--host-uds``, VMs), and for a host user that cannot
        give the socket to the container's uid."""
        if self.runtime not in (None, "runc", "crun"):
            raise IsolationUnavailable(
                f"the {self.name} backend applies a network policy only with the engine's "
                f"default runtime (runc/crun), not {self.runtime!r}, whose sandboxes cannot "
                "reach the host's egress socket; use backend='bwrap' or runc for allow_out"
            )
        if os.geteuid() != 0:
            raise IsolationUnavailable(
                f"a network policy with the {self.name} backend needs sandlot to run as root "
                "(to give the egress socket to the container's own host uid)"
            )

    def _start(
        self, spec: SandboxSpec, lease: EgressLease | None, ids: _accounts.ContainerIds
    ) -> SandboxHandle:
        engine = _engine_for(self.kind)
        try:
            image = self.ensure_image(spec.template)
        except TemplateError:
            raise
        sandbox_id = uuid.uuid4().hex[:16]
        layout = ContainerLayout(
            image=image,
            protocol_dir=str(Path(sandlot.protocol.__file__).parent),
            runner_dir=str(Path(sandlot.runner.__file__).parent),
            seccomp=self._seccomp(),
            sandbox_id=sandbox_id,
            owner=owner_tag(),
            runtime=self.runtime,
            cpus=self.cpus,
            engine=self.kind.name,
            labels={"org.sandlot.template": spec.template},
            egress_socket=None if lease is None else lease.socket_path,
            uid=ids.uid,
            gid=ids.gid,
            accounts_dir=str(ids.accounts_dir),
        )
        body = build_create_body(spec, layout)
        cid = engine.create(body, name=f"sandlot-{sandbox_id}")
        try:
            remote, holder = engine.attach(cid)
        except BaseException:
            engine.kill_and_remove(cid)
            raise
        host_sock, pump_sock = socket.socketpair()
        tail = _StderrTail()
        pump = AttachPump(remote, pump_sock, tail.feed)
        process = ContainerProcess(engine, cid, pump, holder)
        try:
            engine.start(cid)
            process.watch_cgroup()
        except SandboxStartError:
            process.kill()
            with contextlib.suppress(Exception):
                process.wait(timeout=30)
            host_sock.close()
            raise
        config = runner_config(spec, self.runtime)
        configure = {"type": "configure", "id": "configure", "config": config}
        with contextlib.suppress(OSError):  # reported by wait_ready with stderr
            host_sock.sendall(encode(configure))
        memory = spec.resources.memory_mb
        handle = ContainerHandle(
            host_sock,
            process,
            stderr_tail=tail,
            exit_reason=lambda code: process.describe_exit(
                code, None if memory is None else memory + RUNNER_MEMORY_HEADROOM_MB
            ),
            egress=lease,
            ids=ids,
            resources=spec.resources,
        )
        # A runner that cannot apply its limits says so ("fatal"): IsolationUnavailable.
        handle.wait_ready(START_TIMEOUT)
        return handle


class ContainerHandle(ChannelHandle):
    """A container sandbox: the channel, plus the container's cgroup counters. Its
    egress socket and host ids go with the container (``on_exit``: once the engine
    reports it gone)."""

    limits_fix = "Lower the limits in Resources."

    def __init__(
        self,
        sock: socket.socket,
        process: ContainerProcess,
        *,
        egress: EgressLease | None = None,
        ids: _accounts.ContainerIds | None = None,
        **kwargs: Any,
    ) -> None:
        self.container = process
        self._egress = egress
        self.host_ids = ids
        super().__init__(sock, process, on_exit=self._release, **kwargs)

    def kill(self) -> None:
        super().kill()
        # As for bwrap: the door to the egress proxy closes when kill() returns, not when
        # the container's end has been seen.
        if self._egress is not None:
            self._egress.close()

    def _release(self) -> None:
        if self._egress is not None:
            self._egress.close()
        if self.host_ids is not None:
            self.host_ids.release()

    def usage(self) -> ResourceUsage | None:
        return self.container.usage()

    def network_events(self, settle: float = 0.0) -> list[NetworkEvent] | None:
        return None if self._egress is None else self._egress.events(settle)


class DockerBackend(_ContainerBackend):
    """Each sandbox is a hardened container of dockerd (runc, or ``runtime="runsc"``)."""

    name = "docker"
    kind = DOCKER
    strength = 5


class PodmanBackend(_ContainerBackend):
    """Each sandbox is a hardened container of (rootful) Podman, via its API service."""

    name = "podman"
    kind = PODMAN
    strength = 4


def container_backend_problem(
    backend: _ContainerBackend, template: str = "python-data"
) -> str | None:
    """Why ``backend`` cannot start ``template`` sandboxes now (None: it can). For
    tests and ``sandlot doctor``: the engine must answer, the runtime be registered
    and the template's image be built."""
    probe = backend.probe_instance()
    if not probe.available:
        return f"{probe.name}: {probe.reason} (fix: {probe.fix})"
    ids = host_ids_finding()
    if ids.status == "missing":
        return f"{probe.name}: {ids.detail} (fix: {ids.fix})"
    if not image_current(_engine_for(backend.kind), template):
        return (
            f"the {template} image is not built for {backend.kind.name} "
            f"(run scripts/setup-docker.sh, or sandlot template build --backend "
            f"{backend.kind.name} --base IMAGE)"
        )
    return None


HOST_IDS_CHECK = "container host ids"


def host_ids_finding() -> Finding:
    """``sandlot doctor``'s word on the host ids containers run as (one pair each, from
    the delegated range): ``missing``, with the fix, when containers would be refused."""
    try:
        id_range = _hostids.configured_range()
    except IsolationUnavailable as exc:
        return Finding(
            HOST_IDS_CHECK, "missing", f"Docker/Podman sandboxes will not start: {exc}",
            _hostids.RANGE_FIX,
        )  # fmt: skip
    lock_dir = Path(os.environ.get(_hostids.LOCK_DIR_ENV) or _hostids.DEFAULT_LOCK_DIR)
    existing = next(p for p in (lock_dir, *lock_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return Finding(
            HOST_IDS_CHECK, "missing",
            f"Docker/Podman sandboxes will not start: sandlot cannot write {lock_dir}, "
            "where it records which host uids its sandboxes hold",
            f"run sandlot as root, or set {_hostids.LOCK_DIR_ENV} to a directory it can write",
        )  # fmt: skip
    return Finding(
        HOST_IDS_CHECK,
        "ok",
        "each Docker/Podman container runs as an unprivileged host uid and gid of its own "
        f"({id_range.describe()}), so the kernel's per-user quotas are its own",
    )


def build_template_image(
    engine: str,
    template: str,
    *,
    base: str | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Build ``template`` as an image of ``engine`` (``docker`` or ``podman``); its name.

    Raises :class:`BackendUnavailable` if the engine does not answer and
    :class:`TemplateError` if the build fails."""
    kind = {"docker": DOCKER, "podman": PODMAN}[engine]
    return build_image(_engine_for(kind), template, base=base, force=force, progress=progress)


def cleanup_orphans(kinds: tuple[EngineKind, ...] = (DOCKER, PODMAN)) -> int:
    """Remove sandlot containers whose creating process is gone; returns how many.

    Containers are found by the :data:`LABEL` label; one is an orphan when its
    :data:`LABEL_OWNER` names this host and a pid that no longer runs. A container
    of a live owner is never touched, whatever its state: one that is still being
    created is not running yet, and removing it killed another process's sandbox
    mid-start. Containers of other hosts sharing the engine are removed only once
    they stopped. Engines that are absent are skipped.
    """
    return sum(len(_remove_orphans(kind)) for kind in kinds)


def _remove_orphans(kind: EngineKind) -> list[str]:
    """:func:`cleanup_orphans` for one engine: the containers removed (``[]`` when the
    engine, or the ``docker`` client library, is absent)."""
    if engine_url(kind) is None:
        return []
    try:
        engine = _engine_for(kind)
        found = engine.containers([LABEL])
    except Exception:
        return []
    removed = []
    host = socket.gethostname()
    for container in found:
        labels = container.get("Labels") or {}
        owner = str(labels.get(LABEL_OWNER, ""))
        owner_host, _, pid = owner.rpartition(":")
        running = container.get("State") == "running"
        if owner_host == host and pid.isdigit() and owner_alive(int(pid)):
            continue
        if owner_host != host and running:
            continue
        engine.kill_and_remove(str(container["Id"]))
        removed.append(f"{kind.name} container {str(container['Id'])[:12]}")
    return removed


def _say(line: str) -> None:
    print(f"sandlot: {line}", file=sys.stderr, flush=True)


class _StderrTail:
    """The last lines the supervisor wrote to stderr, bounded (for error messages)."""

    MAX_LINE = 1000

    def __init__(self) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self._partial = b""
        self._lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self._lock:
            *complete, partial = (self._partial + data).split(b"\n")
            for line in complete:
                self.lines.append(line[: self.MAX_LINE].decode("utf-8", "replace"))
            self._partial = partial[: self.MAX_LINE]

    def __call__(self) -> str:
        with self._lock:
            extra = [self._partial.decode("utf-8", "replace")] if self._partial else []
            return "\n".join([*self.lines, *extra])
