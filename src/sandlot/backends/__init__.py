"""Isolation backends behind one seam (:mod:`sandlot.backends._base`).

Backends are found by name in :data:`BACKENDS`. ``"auto"`` picks the strongest
backend whose probe passes and never falls back to running code unsandboxed: if
none is available, :class:`sandlot.BackendUnavailable` lists each reason and fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandlot._exceptions import BackendUnavailable, InvalidArgumentError
from sandlot.backends._base import Backend, Event, EventStream, Probe, SandboxHandle
from sandlot.backends.bwrap import BwrapBackend
from sandlot.backends.bwrap._zygote import ZygoteBackend
from sandlot.backends.docker import DockerBackend, PodmanBackend

if TYPE_CHECKING:
    from sandlot.egress import EgressProxy

BACKENDS: dict[str, type[Backend]] = {
    "bwrap": BwrapBackend,
    "docker": DockerBackend,
    "podman": PodmanBackend,
    "zygote": ZygoteBackend,
}

__all__ = [
    "BACKENDS",
    "Backend",
    "Event",
    "EventStream",
    "Probe",
    "SandboxHandle",
    "get_backend",
    "probe_all",
]


def probe_all() -> list[Probe]:
    """Probe every known backend (what ``sandlot doctor`` shows)."""
    return [cls.probe() for cls in BACKENDS.values()]


def get_backend(name: str | Backend = "auto", *, egress: EgressProxy | None = None) -> Backend:
    """Return a backend instance by name, ``"auto"`` for the strongest available.

    ``egress``: the proxy the backend's sandboxes with a network policy use (default:
    the process-wide one); ignored when ``name`` is already a backend instance.
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        probes = sorted(probe_all(), key=lambda p: p.strength, reverse=True)
        for probe in probes:
            if probe.available:
                return _make(BACKENDS[probe.name], egress)
        reasons = "; ".join(f"{p.name}: {p.reason} (fix: {p.fix})" for p in probes)
        raise BackendUnavailable(
            f"no isolation backend is available on this host, and sandlot never runs code "
            f"unsandboxed. {reasons}. Run `sandlot doctor` for details."
        )
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    backend = _make(BACKENDS[name], egress)
    probe = backend.probe()
    if not probe.available:
        raise BackendUnavailable(f"{name} backend unavailable: {probe.reason}. Fix: {probe.fix}")
    return backend


def _make(cls: type[Backend], egress: EgressProxy | None) -> Backend:
    factory: Any = cls  # every built-in backend takes ``egress=``; the ABC does not say so
    backend: Backend = factory() if egress is None else factory(egress=egress)
    return backend
