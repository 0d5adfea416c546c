"""The SDK <-> backend seam.

A backend knows how to start an isolated sandbox running the sandlot runner and to
hand back a :class:`SandboxHandle`: one object with one verb, :meth:`request`,
that sends a protocol request and returns the stream of events answering it.

::

    backend = get_backend("bwrap")
    handle = backend.start(SandboxSpec(...))          # SandboxStartError, IsolationUnavailable
    stream = handle.request({"type": "execute", ...})
    while (event := stream.next(timeout=1.0)) ...      # ends with an "exit" or "reply" event
    handle.kill()

Who calls it: only :mod:`sandlot._sandbox` (``Sandbox``/``AsyncSandbox``) and the
tests. A fake for unit tests ships in :mod:`sandlot.testing`.

Besides starting sandboxes, a backend answers for its host-side housekeeping through
classmethods the CLI and the server call by registry name, without knowing which
backend it is (:mod:`sandlot.backends` runs them for every declared backend):

* :meth:`Backend.probe` and :meth:`Backend.checks`: what ``sandlot doctor`` shows;
* :meth:`Backend.cleanup_orphans`: what ``sandlot serve`` removes at start-up;
* :meth:`Backend.reap` with a :meth:`SandboxHandle.recovery_token`: how a restarted
  server destroys a sandbox its crashed predecessor left running.

Checkpoints (pause, snapshots, fork): :meth:`SandboxHandle.checkpoint` writes the
sandbox's whole state to a directory and ends it; :meth:`Backend.restore` starts a
new sandbox from such a directory, as many times as asked. Both default to a
:class:`~sandlot.CheckpointError` (the backend cannot).

Each has a safe default (nothing to check, nothing to clean, nothing to reap), so a
backend implements only what its technology leaves behind.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sandlot._models import NetworkEvent, ResourceUsage
from sandlot.policy import SandboxSpec

if TYPE_CHECKING:
    from sandlot.egress import EgressProxy

Event = dict[str, Any]
"""One decoded, validated protocol message from the runner."""

RecoveryToken = dict[str, Any]
"""A JSON object a backend can destroy a sandbox from, in another process, after the
process that started it died (see :meth:`SandboxHandle.recovery_token`)."""

FINDING_STATUSES = ("ok", "missing", "warn", "info")


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of ``sandlot doctor``: what a check found on this host, and the fix.

    ``status``: ``ok`` (the layer works), ``missing`` (it does not: sandboxes that need
    it are refused), ``warn`` (works, with a gap worth fixing) or ``info`` (a fact).
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in FINDING_STATUSES:
            raise ValueError(f"Finding.status must be one of {FINDING_STATUSES}: {self.status!r}")

    def as_dict(self) -> dict[str, str]:
        """``{"name", "status", "detail", "fix"}``, as ``sandlot doctor --json`` prints it."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Probe:
    """Whether a backend can run on this host, and if not, why and how to fix it."""

    name: str
    available: bool
    reason: str = ""
    fix: str = ""
    strength: int = 0
    """Higher is stronger isolation; ``Sandbox(backend="auto")`` picks the strongest
    (then starts it through its :attr:`Backend.fast_path`, if any)."""
    details: dict[str, str] = field(default_factory=dict)
    """Per-layer findings for ``sandlot doctor`` (layer -> what was found)."""


class EventStream(ABC):
    """The events answering one request, in order, ending with a terminal event."""

    @abstractmethod
    def next(self, timeout: float | None) -> Event | None:
        """Return the next event, or None if none arrived within ``timeout`` seconds.

        Raises :class:`sandlot.SandboxLost` if the sandbox died before the terminal
        event (the exception's message says why).
        """

    @abstractmethod
    def close(self) -> None:
        """Stop listening (events still arriving for this request are dropped)."""


class SandboxHandle(ABC):
    """A running sandbox."""

    @abstractmethod
    def request(self, message: dict[str, Any]) -> EventStream:
        """Send one protocol request (``message["id"]`` is set by the caller)."""

    @abstractmethod
    def kill(self) -> None:
        """Destroy the sandbox and everything in it. Idempotent; never raises."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once the sandbox has exited or been killed."""

    @property
    def death_reason(self) -> str:
        """Why the sandbox is gone ("" while alive)."""
        return ""

    def usage(self) -> ResourceUsage | None:
        """The whole sandbox's resource use so far, or None if this backend cannot tell."""
        return None

    def usage_counters(self) -> ResourceUsage | None:
        """What a cell's use is measured from, read before every cell: ``oom_kills`` and
        ``cpu_seconds`` as :meth:`usage` has them; the other fields may be None (a
        backend may read less than all of :meth:`usage` for it)."""
        return self.usage()

    def network_events(self, settle: float = 0.0) -> list[NetworkEvent] | None:
        """Records of egress connections that ended since the last call (waiting up to
        ``settle`` seconds for open ones to end); None when the sandbox has no network."""
        return None

    def recovery_token(self) -> RecoveryToken | None:
        """What another process needs to destroy this sandbox should this one die first.

        A server stores it with the sandbox and, after a crash, hands it to
        :meth:`Backend.reap` of the same backend. It must be JSON-serialisable and name
        the sandbox unambiguously (a pid with its start time, not a pid alone: pids are
        reused). None (the default): nothing to record, because the sandbox cannot
        outlive this process or :meth:`Backend.cleanup_orphans` finds it anyway.
        """
        return None

    def checkpoint(self, dest: str) -> None:
        """Write this sandbox's whole state (processes, memory, files) into the empty
        directory ``dest`` and end the sandbox; :meth:`Backend.restore` brings it back.
        Only between calls (nothing in flight). CheckpointError if it cannot be (the
        sandbox is then left running when it can be, ended when not: the message
        says). Default: cannot."""
        from sandlot._exceptions import CheckpointError

        raise CheckpointError(f"{type(self).__name__} sandboxes cannot be checkpointed")


class Backend(ABC):
    """Starts sandboxes of one isolation technology."""

    name: str = ""

    by_name_only: ClassVar[bool] = False
    """True: ``"auto"`` never picks this backend, whatever its probe says; a user asks for
    it by name (a virtual machine that takes seconds to start is no default)."""

    fast_path: ClassVar[str] = ""
    """The name of the backend that ``"auto"`` starts this one's sandboxes through when
    it picks this one and that backend's probe passes: the same isolation technology,
    started faster (bubblewrap's is ``"zygote"``). Named here, on the backend being
    sped up, so that no installed package can redirect ``"auto"``. Empty: none."""

    @classmethod
    def for_auto(cls, egress: EgressProxy | None = None) -> Backend:
        """The instance ``"auto"`` uses when it picks this backend (directly or as
        another's :attr:`fast_path`); a backend named explicitly is constructed as
        ``cls(egress=egress)``. Default: the same; a backend may tune it for callers
        that named no backend (the zygote's first sandbox starts cold, not waiting
        for the zygote)."""
        return construct(cls, egress)

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Check this host without side effects beyond a short self-test."""

    @abstractmethod
    def start(self, spec: SandboxSpec) -> SandboxHandle:
        """Start a sandbox for ``spec`` and wait until its runner is ready."""

    @classmethod
    def checks(cls) -> list[Finding]:
        """Host checks of the layers this backend applies beyond what :meth:`probe`
        tests, for ``sandlot doctor``. No side effects. Backends that share a layer may
        return the same finding; the doctor shows it once. Default: none."""
        return []

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        """Remove what sandboxes of this backend left behind when the process that
        started them died without cleaning up (SIGKILL, a crash); return a short
        description of each thing removed.

        ``sandlot serve`` calls it for every declared backend at start-up, so it must
        never touch what a live process owns, and must return ``[]`` rather than raise
        where its technology is absent (no engine installed, no cgroups). Default:
        nothing to clean."""
        return []

    @classmethod
    def reap(cls, token: Mapping[str, Any]) -> bool:
        """Destroy the sandbox a :meth:`SandboxHandle.recovery_token` of this backend
        describes, if it still runs; True if something was destroyed.

        The token comes back from a database, possibly from an older version: check its
        shape, return False for anything unexpected, and make sure it still names the
        same sandbox before killing anything. Never raises. Default: nothing to do."""
        return False

    def restore(self, source: str, spec: SandboxSpec) -> SandboxHandle:
        """A new sandbox from the checkpoint in ``source`` (written by
        :meth:`SandboxHandle.checkpoint` of this backend's sandbox), with isolation
        layers of its own (namespaces, host ids, cgroup with ``spec``'s limits); the
        directory is left as it was, so it can be restored again. Default: cannot."""
        from sandlot._exceptions import CheckpointError

        raise CheckpointError(f"the {self.name} backend cannot restore checkpoints")

    def pool_key(self) -> tuple[object, ...]:
        """What, besides the spec, decides the sandbox this backend starts: a warm pool
        hands a ready sandbox only to a caller whose backend has an equal key (so a
        gVisor container never goes to someone who asked for runc). Default: the name."""
        return (self.name,)


def construct(cls: type[Backend], egress: EgressProxy | None) -> Backend:
    """``cls(egress=egress)``, or ``cls()`` without a proxy: how a backend named
    explicitly is made, and what :meth:`Backend.for_auto` does by default."""
    factory: Any = cls  # every built-in backend takes ``egress=``; the ABC does not say so
    backend: Backend = factory() if egress is None else factory(egress=egress)
    return backend


def owner_alive(pid: int) -> bool:
    """Whether the process ``pid`` (the host process that owns some sandbox, for
    :meth:`Backend.cleanup_orphans`) still exists; one of another user counts."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
