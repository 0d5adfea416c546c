"""``sandlot doctor``: what this host offers each isolation layer, and how to fix gaps.

Every backend is reached through the registry (``sandlot.backends``): its probe and
its :meth:`~sandlot.backends.Backend.checks`, so a plug-in backend appears here without
an edit. Host facts that belong to no backend come from ``sandlot.backends.host``.
"""

from __future__ import annotations

import glob
from typing import Any

from sandlot.backends import Finding, auto_choice, check_all, host, probe_all
from sandlot.templates import DEFAULT_TEMPLATE, cache_dir, find_template


def _cjk_font() -> bool:
    patterns = (
        "/usr/share/fonts/**/*wqy*",
        "/usr/share/fonts/**/*CJK*",
        "/usr/share/fonts/**/*Droid*",
    )
    return any(glob.glob(pattern, recursive=True) for pattern in patterns)


def doctor_report() -> dict[str, Any]:
    """Collect every check; pure reporting, no state changes on the host."""
    findings: list[Finding] = []
    probes = probe_all()
    for probe in probes:
        if probe.available:
            findings.append(Finding(f"backend {probe.name}", "ok", "available"))
        else:
            findings.append(Finding(f"backend {probe.name}", "missing", probe.reason, probe.fix))
        for key, value in probe.details.items():
            findings.append(Finding(f"  {probe.name}: {key}", "info", value))
    findings += check_all()
    findings += host.checks()
    template = find_template(DEFAULT_TEMPLATE)
    if template is not None:
        findings.append(
            Finding(
                f"template {DEFAULT_TEMPLATE}",
                "ok",
                f"built at {template.path} (Python {template.python_version})",
            )
        )
    else:
        findings.append(
            Finding(
                f"template {DEFAULT_TEMPLATE}",
                "warn",
                f"not built yet in {cache_dir()}; the first Sandbox() builds it",
                "sandlot template build",
            )
        )
    if _cjk_font():
        findings.append(Finding("CJK font", "ok", "found (charts can render CJK text)"))
    else:
        findings.append(
            Finding(
                "CJK font",
                "warn",
                "no CJK font found; CJK text in charts renders as boxes",
                "apt-get install fonts-wqy-microhei (then sandlot template build --force)",
            )
        )
    available = [p.name for p in sorted(probes, key=lambda p: -p.strength) if p.available]
    version, _ = host.cgroup_version()
    return {
        "checks": [finding.as_dict() for finding in findings],
        "backends_available": available,
        "auto": auto_choice(probes),
        "cgroup_version": version,
    }
