"""How bench scripts that take ``--json`` summarise a row: a list of milliseconds, or a
scalar ``{"value": v, "note": s}`` (a rate, a count)."""

from __future__ import annotations

from typing import Any


def pct(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def summary(value: Any) -> str:
    """``p50 / p95 / p99 (n=...)`` for a list of ms, or the value of a scalar row."""
    if isinstance(value, dict):
        return f"{value['value']:.1f} ({value['note']})"
    if not value:
        return "not measured"
    if len(value) == 1:
        return f"{value[0]:.2f}"
    p50, p95, p99 = (pct(value, p) for p in (50, 95, 99))
    return f"{p50:.2f} / {p95:.2f} / {p99:.2f} (n={len(value)})"


def p50(value: Any) -> float | None:
    """The p50 of a list row, the value of a scalar row, None for an empty one."""
    if isinstance(value, dict):
        return float(value["value"])
    return pct(value, 50) if value else None
