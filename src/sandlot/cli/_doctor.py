"""``sandlot doctor``: what this host offers each isolation layer, and how to fix gaps."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from sandlot.backends import probe_all
from sandlot.templates import DEFAULT_TEMPLATE, cache_dir, find_template


def _check(name: str, status: str, detail: str, fix: str = "") -> dict[str, str]:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


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


def _seccomp() -> tuple[str, str]:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return "warn", "cannot read /proc/self/status"
    for line in status.splitlines():
        if line.startswith("Seccomp:"):
            mode = line.split()[1]
            return "info", (
                f"kernel supports seccomp (this process: mode {mode}); sandlot does not install "
                "a syscall filter yet"
            )
    return "warn", "kernel without seccomp"


def _cjk_font() -> bool:
    patterns = (
        "/usr/share/fonts/**/*wqy*",
        "/usr/share/fonts/**/*CJK*",
        "/usr/share/fonts/**/*Droid*",
    )
    return any(glob.glob(pattern, recursive=True) for pattern in patterns)


def doctor_report() -> dict[str, Any]:
    """Collect every check; pure reporting, no state changes on the host."""
    checks: list[dict[str, str]] = []
    probes = probe_all()
    for probe in probes:
        if probe.available:
            checks.append(_check(f"backend {probe.name}", "ok", "available"))
        else:
            checks.append(_check(f"backend {probe.name}", "missing", probe.reason, probe.fix))
        for key, value in probe.details.items():
            checks.append(_check(f"  {probe.name}: {key}", "info", value))
    checks.append(
        _check(
            "running as",
            "info",
            "root (the sandbox user maps to host root; see SECURITY.md)"
            if os.geteuid() == 0
            else f"uid {os.geteuid()}",
        )
    )
    version, detail = cgroup_version()
    checks.append(
        _check(
            "cgroups",
            "info",
            f"{detail}; this release enforces limits with rlimits and tmpfs sizes",
        )
    )
    status, detail = _seccomp()
    checks.append(_check("seccomp", status, detail))
    template = find_template(DEFAULT_TEMPLATE)
    if template is not None:
        checks.append(
            _check(
                f"template {DEFAULT_TEMPLATE}",
                "ok",
                f"built at {template.path} (Python {template.python_version})",
            )
        )
    else:
        checks.append(
            _check(
                f"template {DEFAULT_TEMPLATE}",
                "warn",
                f"not built yet in {cache_dir()}; the first Sandbox() builds it",
                "sandlot template build",
            )
        )
    if _cjk_font():
        checks.append(_check("CJK font", "ok", "found (charts can render CJK text)"))
    else:
        checks.append(
            _check(
                "CJK font",
                "warn",
                "no CJK font found; CJK text in charts renders as boxes",
                "apt-get install fonts-wqy-microhei (then sandlot template build --force)",
            )
        )
    available = [p.name for p in sorted(probes, key=lambda p: -p.strength) if p.available]
    return {"checks": checks, "backends_available": available, "cgroup_version": version}
