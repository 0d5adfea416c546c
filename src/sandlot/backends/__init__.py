"""Isolation backends behind one seam (:mod:`sandlot.backends._base`).

Backends are found by name in :data:`BACKENDS`. ``"auto"`` picks the strongest
backend whose probe passes and never falls back to running code unsandboxed: if
none is available, :class:`sandlot.BackendUnavailable` lists each reason and fix.
"""

from __future__ import annotations

from sandlot._exceptions import BackendUnavailable, InvalidArgumentError
from sandlot.backends._base import Backend, Event, EventStream, Probe, SandboxHandle
from sandlot.backends._pool import WarmPool
from sandlot.backends.bwrap import BwrapBackend
from sandlot.backends.bwrap._zygote import ZygoteBackend
from sandlot.backends.docker import DockerBackend, PodmanBackend

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
    "WarmPool",
    "get_backend",
    "probe_all",
]


def probe_all() -> list[Probe]:
    """Probe every known backend (what ``sandlot doctor`` shows)."""
    return [cls.probe() for cls in BACKENDS.values()]


def get_backend(name: str | Backend = "auto") -> Backend:
    """Return a backend instance by name, ``"auto"`` for the strongest available."""
    if isinstance(name, Backend):
        return name
    if name == "auto":
        probes = sorted(probe_all(), key=lambda p: p.strength, reverse=True)
        for probe in probes:
            if probe.available:
                return BACKENDS[probe.name]()
        reasons = "; ".join(f"{p.name}: {p.reason} (fix: {p.fix})" for p in probes)
        raise BackendUnavailable(
            f"no isolation backend is available on this host, and sandlot never runs code "
            f"unsandboxed. {reasons}. Run `sandlot doctor` for details."
        )
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    backend = BACKENDS[name]()
    probe = backend.probe()
    if not probe.available:
        raise BackendUnavailable(f"{name} backend unavailable: {probe.reason}. Fix: {probe.fix}")
    return backend
