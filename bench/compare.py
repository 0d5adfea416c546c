"""Run one bench script against an earlier sandlot and this one, and print both.

The earlier version's ``src`` is exported from git (``--baseline``, default: the
newest commit of the previous day's work, or any revision) into a temporary directory,
and the script runs with ``PYTHONPATH`` at one ``src`` or the other, alternating for
``--rounds`` rounds (so a change in the machine's load hits both alike). The script must
take ``--json PATH`` and write ``{row: [ms, ...] | {"value": v, "note": s}}``
(``bench/fast.py``, ``bench/roundtrip.py`` and ``bench/server.py`` do). Each side runs the
same copy of the script, the current one. Run::

    .venv/bin/python bench/compare.py --baseline a10098a -- bench/fast.py --runs 30
    .venv/bin/python bench/compare.py --baseline a10098a --rounds 3 --out \\
        bench/results/fast-compare.md -- bench/fast.py

It prints a Markdown table (previous beside now, and the change of the p50) and writes it to
``--out`` when given, with the load averages.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import p50, summary

ROOT = Path(__file__).resolve().parents[1]


def export(revision: str, into: Path) -> tuple[Path, str]:
    """``revision``'s ``src`` under ``into``; (that src, the full commit id)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "src"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src", commit


def run(script: list[str], src: Path, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, *script, "--json", str(out)], env=env, check=True)
    rows: dict[str, Any] = json.loads(out.read_text())
    return rows


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one side together: lists are joined, scalars averaged (notes kept)."""
    merged: dict[str, Any] = {}
    for rows in runs:
        for name, value in rows.items():
            if name.startswith("_"):
                continue
            if isinstance(value, dict):
                merged.setdefault(name, []).append(value)
            else:
                merged.setdefault(name, []).extend(value)
    for name, value in merged.items():
        if value and isinstance(value[0], dict):
            merged[name] = {
                "value": sum(v["value"] for v in value) / len(value),
                "note": value[-1]["note"] + (f"; mean of {len(value)}" if len(value) > 1 else ""),
            }
    return merged


def _cell(value: Any) -> str:
    return "missing" if value is None else summary(value)


def table(previous: dict[str, Any], now: dict[str, Any], labels: tuple[str, str]) -> str:
    lines = [
        f"| row (ms unless noted) | {labels[0]} p50 / p95 / p99 | {labels[1]} p50 / p95 / p99 "
        "| p50 now / before |",
        "|---|---|---|---|",
    ]
    for name in dict.fromkeys([*previous, *now]):
        before, after = previous.get(name), now.get(name)
        a = p50(before) if before is not None else None
        b = p50(after) if after is not None else None
        ratio = f"{b / a:.2f}x" if a and b is not None else ""
        lines.append(f"| {name} | {_cell(before)} | {_cell(after)} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- bench/x.py [args]")
    args = parser.parse_args()
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the bench script after --")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        base_src, commit = export(args.baseline, Path(tmp))
        sides: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
        for n in range(args.rounds):
            for side, src in (("before", base_src), ("now", ROOT / "src")):
                print(f"round {n + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                sides[side].append(run(script, src, Path(tmp) / f"{side}-{n}.json"))
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True, text=True
    ).stdout.strip()
    labels = (f"before ({commit[:7]})", f"now ({head}{'+changes' if dirty else ''})")
    load_end = os.getloadavg()
    report = "\n".join(
        [
            f"`{' '.join(script)}`, {args.rounds} round(s) per side, alternating; "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"{platform.node()}, {os.cpu_count()} cores, kernel {platform.release()}, "
            f"load {load_start[0]:.2f} -> {load_end[0]:.2f}",
            "",
            table(merge(sides["before"]), merge(sides["now"]), labels),
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
