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


def _seccomp() -> tuple[str, str, str]:
    """(status, detail, fix) for sandlot's syscall filter on this host."""
    from sandlot._exceptions import IsolationUnavailable
    from sandlot.backends.bwrap import _seccomp as compiled
    from sandlot.seccomp import DENIED, denied_names

    try:
        program = compiled.filter_program()
    except IsolationUnavailable as exc:
        return "missing", str(exc), compiled.LIBSECCOMP_FIX
    return (
        "ok",
        (
            f"libseccomp filter ({len(program) // 8} BPF instructions): {len(denied_names())} "
            f"syscalls denied outright, {len(DENIED) - len(denied_names())} argument rules "
            "(namespace clone flags, raw/netlink/packet sockets, TIOCSTI, personality); "
            "installed in every sandbox"
        ),
        "",
    )


def _cgroups() -> tuple[str, str, str]:
    """(status, detail, fix) for whole-sandbox limits on this host."""
    from sandlot._exceptions import IsolationUnavailable
    from sandlot.backends import _cgroups as cg

    try:
        host = cg.host()
    except IsolationUnavailable as exc:
        return "missing", str(exc).split(" Fix: ")[0], cg.CGROUP_FIX
    where = ", ".join(f"{ctrl or 'unified'}: {path}" for ctrl, path in host.bases.items())
    swap = "swap accounted and off" if host.swap_accounting else "no swap accounting (swappiness 0)"
    return (
        "ok",
        (
            f"cgroup v{host.version}; memory, pids and CPU limits for the whole sandbox; "
            f"{swap}; sandbox cgroups in {where}"
        ),
        "",
    )


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
    if os.geteuid() == 0:
        # The range (or what is missing) is in the bwrap backend's probe above.
        running = "root; each sandbox runs as an unprivileged host uid of its own, no capabilities"
    else:
        running = (
            f"uid {os.geteuid()}; sandboxes run as this uid, with no capabilities, and share "
            "its per-user kernel quotas (SECURITY.md)"
        )
    checks.append(_check("running as", "info", running))
    version, detail = cgroup_version()
    checks.append(_check("cgroup hierarchy", "info", detail))
    status, detail, fix = _cgroups()
    checks.append(_check("cgroups", status, detail, fix))
    status, detail, fix = _seccomp()
    checks.append(_check("seccomp", status, detail, fix))
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
