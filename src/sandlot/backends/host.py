"""Host facts that belong to no single backend, for ``sandlot doctor`` and recovery.

Public, so the CLI can show them without reaching into a backend's private modules:
which cgroup hierarchy the host runs, whether sandlot can create the whole-sandbox
cgroups its bubblewrap-based backends need, whether CRIU (checkpoint/restore) works,
and a process's start time (what makes a
pid in a recovery token unambiguous). Backend-specific checks are
:meth:`sandlot.backends.Backend.checks`.
"""

from __future__ import annotations

from pathlib import Path

from sandlot._exceptions import IsolationUnavailable
from sandlot.backends import _cgroups, _checkpoint
from sandlot.backends._base import Finding
from sandlot.backends._cgroups import process_start_time

__all__ = ["cgroup_version", "checks", "process_start_time"]


def cgroup_version() -> tuple[str, str]:
    """("v2" | "v1" | "hybrid" | "none", description) for /sys/fs/cgroup."""
    root = Path("/sys/fs/cgroup")
    unified = (root / "cgroup.controllers").exists()
    v1 = [name for name in ("memory", "pids", "cpu") if (root / name).is_dir()]
    if unified:
        controllers = (root / "cgroup.controllers").read_text().split()
        return "v2", f"cgroup v2 (unified), controllers: {' '.join(controllers) or 'none'}"
    if v1 and (root / "unified" / "cgroup.controllers").exists():
        return "hybrid", f"cgroup v1 controllers ({', '.join(v1)}) with a v2 hierarchy beside them"
    if v1:
        return "v1", f"cgroup v1 controllers: {', '.join(v1)}"
    return "none", "no cgroup hierarchy found at /sys/fs/cgroup"


def _sandbox_cgroups() -> Finding:
    """Whether sandlot can create whole-sandbox cgroups here (bwrap and zygote need them;
    container engines make their own)."""
    try:
        host = _cgroups.host()
    except IsolationUnavailable as exc:
        return Finding("cgroups", "missing", str(exc).split(" Fix: ")[0], _cgroups.CGROUP_FIX)
    where = ", ".join(f"{ctrl or 'unified'}: {path}" for ctrl, path in host.bases.items())
    swap = "swap accounted and off" if host.swap_accounting else "no swap accounting (swappiness 0)"
    return Finding(
        "cgroups",
        "ok",
        f"cgroup v{host.version}; memory, pids and CPU limits for the whole sandbox; "
        f"{swap}; sandbox cgroups in {where}",
    )


def checks() -> list[Finding]:
    """The host's cgroup hierarchy (info), sandlot's whole-sandbox cgroups (ok or
    missing, with the fix) and checkpoint/restore (CRIU). The only change it may make
    is the one every first sandbox makes: creating sandlot's own (empty) cgroup base
    directory."""
    _version, detail = cgroup_version()
    return [Finding("cgroup hierarchy", "info", detail), _sandbox_cgroups(), _checkpoint.finding()]
