"""The microvm backend beside bwrap, in one run: boot, first result, cell round trip.

Rows (milliseconds, p50/p95/p99 over the runs; runs of different rows interleaved, so a
change of load hits all of them alike):

* ``create -> ready``: ``Sandbox()`` returning (the VM booted, runner ready).
* ``create -> first result``: ``Sandbox()`` plus a cell importing numpy, pandas and
  pyplot and evaluating ``1 + 1`` (as bench/startup.py's row of that name).
* ``per-cell round trip``: ``run_code("1+1")`` in a sandbox that is up (after warm-up).

Variants: bwrap (cold, no zygote), microvm on QEMU's ``microvm`` machine, and (with
``--q35``) the same guest on ``q35``. The accelerator (KVM or TCG) is the backend
probe's choice and is printed.

    PYTHONPATH=src nice .venv/bin/python bench/microvm.py --runs 3 --out bench/results/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _rows import summary

from sandlot import Sandbox
from sandlot.backends.microvm import MicroVMBackend

FIRST_CELL = "import numpy, pandas, matplotlib.pyplot\n1 + 1"


def _variants(q35: bool) -> dict[str, Callable[[], Any]]:
    variants: dict[str, Callable[[], Any]] = {
        "bwrap (cold)": lambda: "bwrap",
        "microvm backend, QEMU microvm machine": lambda: MicroVMBackend(machine="microvm"),
    }
    if q35:
        variants["microvm backend, QEMU q35 machine (SeaBIOS, virtio-pci)"] = lambda: (
            MicroVMBackend(machine="q35")
        )
    return variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="cold starts per variant")
    parser.add_argument("--cells", type=int, default=50, help="round trips per variant")
    parser.add_argument("--q35", action="store_true", help="also boot the guest on q35")
    parser.add_argument("--out", type=Path, help="directory for the .json and .md results")
    args = parser.parse_args()

    probe = MicroVMBackend.probe()
    if not probe.available:
        print(f"microvm unavailable: {probe.reason} (fix: {probe.fix})", file=sys.stderr)
        return 1
    accel = probe.details.get("accelerator", "?")
    variants = _variants(args.q35)
    rows: dict[tuple[str, str], list[float]] = {}
    load_start = os.getloadavg()
    started = time.monotonic()
    for _ in range(args.runs):
        for name, make in variants.items():
            t0 = time.perf_counter()
            sandbox = Sandbox(backend=make(), timeout=600)
            t1 = time.perf_counter()
            result = sandbox.run_code(FIRST_CELL)
            t2 = time.perf_counter()
            sandbox.kill()
            if result.error is not None or result.text != "2":
                print(f"{name}: first cell failed: {result.error}", file=sys.stderr)
                return 1
            rows.setdefault(("create -> ready", name), []).append((t1 - t0) * 1000)
            rows.setdefault(("create -> first result (data stack imported)", name), []).append(
                (t2 - t0) * 1000
            )
    for name, make in variants.items():
        with Sandbox(backend=make(), timeout=600) as sandbox:
            for _ in range(5):
                sandbox.run_code("1+1")
            times = []
            for _ in range(args.cells):
                t0 = time.perf_counter()
                sandbox.run_code("1+1")
                times.append((time.perf_counter() - t0) * 1000)
            rows[("per-cell round trip `1+1`", name)] = times
    elapsed = time.monotonic() - started
    load_end = os.getloadavg()

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    lines = [
        f"# sandlot bench: microvm beside bwrap, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}; "
        f"microvm accelerator: {accel}.",
        f"Load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (a shared, "
        f"loaded machine: compare rows within this run). {elapsed:.0f} s in all.",
        f"Command: `bench/microvm.py {' '.join(sys.argv[1:])}`",
        "",
        "| metric | variant | ms p50 / p95 / p99 (n) |",
        "|---|---|---|",
    ]
    for (metric, name), values in rows.items():
        lines.append(f"| {metric} | {name} | {summary(values)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"microvm-{stamp}.md").write_text(text)
        data = {f"{m} | {n}": v for (m, n), v in rows.items()}
        (args.out / f"microvm-{stamp}.json").write_text(
            json.dumps({"accelerator": accel, "rows": data}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
