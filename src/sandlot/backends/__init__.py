"""Isolation backends behind one seam (:mod:`sandlot.backends._base`).

Backends are plug-ins, found by name through the ``sandlot.backends`` entry-point
group: sandlot's own are declared in its ``pyproject.toml``, and an installed package
adds one by declaring ``name = "package.module:BackendClass"`` in the same group. A
backend's module is imported only when that backend is asked for, so ``import
sandlot`` loads none of them. A third-party entry point cannot take a built-in name
(a package shadowing ``bwrap`` would silently change what "bwrap" isolates with).

``"auto"`` picks the strongest backend whose probe passes and starts it through its
:attr:`Backend.fast_path` when that one's probe passes too (bubblewrap through the
zygote). It never falls back to running code unsandboxed: if none is available,
:class:`sandlot.BackendUnavailable` lists each reason and fix.

The CLI and the server reach every declared backend through this module only:
:func:`probe_all` and :func:`check_all` for ``sandlot doctor``, :func:`cleanup_orphans`
at ``sandlot serve`` start-up, :func:`reap` for crash recovery. Host facts that belong
to no backend are in :mod:`sandlot.backends.host`. docs/backends.md says how to add a
backend.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandlot._exceptions import BackendUnavailable, InvalidArgumentError
from sandlot.backends._base import (
    Backend,
    Event,
    EventStream,
    Finding,
    Probe,
    RecoveryToken,
    SandboxHandle,
    construct,
)

if TYPE_CHECKING:
    from sandlot.egress import EgressProxy

GROUP = "sandlot.backends"
"""The entry-point group backends are declared in."""

log = logging.getLogger("sandlot.backend")

__all__ = [
    "BACKENDS",
    "GROUP",
    "Backend",
    "Event",
    "EventStream",
    "Finding",
    "Probe",
    "RecoveryToken",
    "SandboxHandle",
    "auto_choice",
    "backend_names",
    "check_all",
    "cleanup_orphans",
    "get_backend",
    "load_backend",
    "probe_all",
    "reap",
]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    target: str
    """``module:attribute``, as written in the entry point."""


@functools.cache
def _entries() -> dict[str, _Entry]:
    """Every declared backend by name, sorted by name; read once per process."""
    from importlib.metadata import entry_points

    found: dict[str, _Entry] = {}
    for name, target in _builtin_targets().items():
        found[name] = _Entry(name, target)
    for point in entry_points(group=GROUP):
        if point.name not in found:  # built-ins first; then the first on sys.path wins
            found[point.name] = _Entry(point.name, point.value)
    return dict(sorted(found.items()))


def _builtin_targets() -> dict[str, str]:
    """sandlot's own backends, as its installed metadata declares them.

    An editable install made before the declarations existed has none in its metadata
    (pip writes ``entry_points.txt`` at install time); a source checkout then reads them
    from its ``pyproject.toml``, so the declaration there stays the only one.
    """
    from importlib.metadata import EntryPoints, PackageNotFoundError, distribution

    try:
        points = distribution("sandlot").entry_points.select(group=GROUP)
    except PackageNotFoundError:  # running from a source tree that was never installed
        points = EntryPoints(())
    declared = {point.name: point.value for point in points}
    if declared:
        return declared
    source = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if not source.is_file():
        return {}
    import tomllib

    with source.open("rb") as handle:
        project = tomllib.load(handle).get("project", {})
    if project.get("name") != "sandlot":
        return {}
    table = project.get("entry-points", {}).get(GROUP, {})
    return {str(name): str(target) for name, target in table.items()}


def backend_names() -> list[str]:
    """The names ``Sandbox(backend=...)`` accepts besides ``"auto"``, sorted.

    Reads the declarations only; no backend module is imported.
    """
    return list(_entries())


@functools.cache
def load_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name``, imported now (and only now).

    Raises :class:`sandlot.InvalidArgumentError` for a name nobody declared and
    :class:`sandlot.BackendUnavailable` when its declaration does not lead to a
    :class:`Backend` subclass (a broken or half-installed plug-in).
    """
    entry = _entries().get(name)
    if entry is None:
        known = ", ".join(["auto", *_entries()])
        raise InvalidArgumentError(f"unknown backend {name!r}; known: {known}")
    module_name, _, attribute = entry.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name.strip())
        for part in attribute.strip().split(".") if attribute else ():
            obj = getattr(obj, part)
    except Exception as exc:
        raise BackendUnavailable(
            f"backend {name!r} is declared as {entry.target!r} but could not be loaded: "
            f"{type(exc).__name__}: {exc}. Fix: reinstall the package that provides it"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise BackendUnavailable(
            f"backend {name!r} is declared as {entry.target!r}, which is not a "
            "sandlot.backends.Backend subclass. Fix: correct the package's entry point"
        )
    return obj


class _Registry(Mapping[str, type[Backend]]):
    """``BACKENDS``: name -> backend class, importing a class on first lookup."""

    def __getitem__(self, name: str) -> type[Backend]:
        if name not in _entries():
            raise KeyError(name)
        return load_backend(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_entries())

    def __len__(self) -> int:
        return len(_entries())

    def __contains__(self, name: object) -> bool:
        return name in _entries()


BACKENDS: Mapping[str, type[Backend]] = _Registry()
"""Every declared backend by name (lazy: looking one up imports it)."""


def _probe(name: str) -> Probe:
    try:
        cls = load_backend(name)
    except BackendUnavailable as exc:
        return Probe(name, False, str(exc).split(". Fix: ")[0], "reinstall the package")
    probe = cls.probe()
    return probe if probe.name == name else _renamed(probe, name)


def _renamed(probe: Probe, name: str) -> Probe:
    return Probe(name, probe.available, probe.reason, probe.fix, probe.strength, probe.details)


def probe_all() -> list[Probe]:
    """Probe every declared backend (what ``sandlot doctor`` shows), in name order."""
    return [_probe(name) for name in _entries()]


def check_all() -> list[Finding]:
    """Every declared backend's :meth:`Backend.checks`, each finding once, in name order.

    Backends that share a layer (bwrap and the zygote) report it alike and it is shown
    once. A backend that cannot be loaded adds nothing here (its probe says why); one
    whose checks raise adds a ``missing`` finding with the error, so one broken plug-in
    cannot take ``sandlot doctor`` down.
    """
    found: dict[Finding, None] = {}
    for name in _entries():
        try:
            cls = load_backend(name)
        except BackendUnavailable:
            continue
        try:
            findings = cls.checks()
        except Exception as exc:
            findings = [
                Finding(
                    f"{name} checks",
                    "missing",
                    f"the backend's checks failed: {type(exc).__name__}: {exc}",
                    "report this to the package that provides the backend",
                )
            ]
        found.update(dict.fromkeys(findings))
    return list(found)


def cleanup_orphans() -> dict[str, list[str]]:
    """Run every declared backend's :meth:`Backend.cleanup_orphans`; returns backend
    name -> what it removed, for the backends that removed something.

    ``sandlot serve`` calls this at start-up. It never raises: a backend that cannot be
    loaded (a container backend without its client library) has nothing of its own to
    clean, and one whose cleanup fails is logged and the others still run; orphans
    are leftovers of sandboxes that are already dead, so none of this weakens a
    running sandbox's isolation.
    """
    removed: dict[str, list[str]] = {}
    for name in _entries():
        try:
            gone = load_backend(name).cleanup_orphans()
        except BackendUnavailable as exc:
            log.info("orphan cleanup skipped for backend %s: %s", name, exc)
            continue
        except Exception:
            log.exception("orphan cleanup failed for backend %s", name)
            continue
        if gone:
            removed[name] = list(gone)
    return removed


def reap(name: str, token: Mapping[str, Any]) -> bool:
    """Destroy the sandbox ``token`` describes (a :meth:`SandboxHandle.recovery_token`
    of a sandbox of backend ``name``, stored before a crash) if it survived; True if
    something was destroyed. Never raises: an unknown or broken backend, or a token it
    does not recognise, is logged and reaps nothing."""
    try:
        return bool(load_backend(name).reap(token))
    except (BackendUnavailable, InvalidArgumentError) as exc:
        log.warning("cannot reap a sandbox of backend %r: %s", name, exc)
    except Exception:
        log.exception("reaping a sandbox of backend %r failed", name)
    return False


def get_backend(name: str | Backend = "auto", *, egress: EgressProxy | None = None) -> Backend:
    """Return a backend instance by name, ``"auto"`` for the strongest available.

    ``egress``: the proxy the backend's sandboxes with a network policy use (default:
    the process-wide one); ignored when ``name`` is already a backend instance.
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        # Not the by-name-only backends (auto never picks them): a microVM's probe reads
        # its artifacts' manifest, half a millisecond of every default Sandbox().
        probes = [_probe(name) for name in _entries() if not _by_name_only(name)]
        chosen = auto_choice(probes)
        if chosen is None:
            reasons = "; ".join(f"{p.name}: {p.reason} (fix: {p.fix})" for p in probes)
            raise BackendUnavailable(
                f"no isolation backend is available on this host, and sandlot never runs "
                f"code unsandboxed. {reasons}. Run `sandlot doctor` for details."
            )
        return load_backend(chosen).for_auto(egress)
    backend = construct(load_backend(name), egress)
    probe = backend.probe()
    if not probe.available:
        raise BackendUnavailable(f"{name} backend unavailable: {probe.reason}. Fix: {probe.fix}")
    return backend


def _by_name_only(name: str) -> bool:
    try:
        return load_backend(name).by_name_only
    except BackendUnavailable:
        return False  # probed, so that the error can say why it is unavailable


def auto_choice(probes: list[Probe]) -> str | None:
    """The backend ``"auto"`` starts sandboxes with, given every backend's probe: the
    strongest available one (of those not :attr:`Backend.by_name_only`), or its
    :attr:`Backend.fast_path` when that one is available too; None when nothing is
    available.
    """
    available = {
        probe.name: probe
        for probe in probes
        if probe.available and not load_backend(probe.name).by_name_only
    }
    if not available:
        return None
    strongest = max(available.values(), key=lambda p: p.strength).name
    fast = load_backend(strongest).fast_path
    return fast if fast in available else strongest
