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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from sandlot._models import NetworkEvent, ResourceUsage
from sandlot.policy import SandboxSpec

Event = dict[str, Any]
"""One decoded, validated protocol message from the runner."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Whether a backend can run on this host, and if not, why and how to fix it."""

    name: str
    available: bool
    reason: str = ""
    fix: str = ""
    strength: int = 0
    """Higher is stronger isolation; ``Sandbox(backend="auto")`` picks the strongest."""
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

    def network_events(self, settle: float = 0.0) -> list[NetworkEvent] | None:
        """Records of egress connections that ended since the last call (waiting up to
        ``settle`` seconds for open ones to end); None when the sandbox has no network."""
        return None


class Backend(ABC):
    """Starts sandboxes of one isolation technology."""

    name: str = ""

    @classmethod
    @abstractmethod
    def probe(cls) -> Probe:
        """Check this host without side effects beyond a short self-test."""

    @abstractmethod
    def start(self, spec: SandboxSpec) -> SandboxHandle:
        """Start a sandbox for ``spec`` and wait until its runner is ready."""

    def pool_key(self) -> tuple[object, ...]:
        """What, besides the spec, decides the sandbox this backend starts: a warm pool
        hands a ready sandbox only to a caller whose backend has an equal key (so a
        gVisor container never goes to someone who asked for runc). Default: the name."""
        return (self.name,)
