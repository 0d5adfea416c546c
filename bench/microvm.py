"""The microvm backend beside bwrap, the zygote and Docker, in one run: start, first
result, cell round trip, and a warm pool's hand-out.

Rows (milliseconds, p50/p95/p99 over the runs; runs of different variants interleaved,
so a change of load hits all of them alike):

* ``create -> ready``: ``Sandbox()`` returning (runner ready). For the restored microvm
  variant this is the restore: QEMU started with the saved template VM's state, the
  guest's kernel generator reseeded with the host's entropy, pid 1 down to uid 1000,
  the default kernel forked (a fresh identity, docs/microvm.md).
* ``create -> first result (data stack imported)``: ``Sandbox()`` plus a cell importing
  numpy, pandas and pyplot and evaluating ``1 + 1`` (bench/startup.py's row of that
  name). For the restored VM: restore -> first result.
* ``per-cell round trip `1+1```: ``run_code("1+1")`` in a sandbox that is up (after
  warm-up).
* ``pool hand-out -> first result`` (``--pool N``): a ``Pool(size=1)`` on the variant,
  refilled before each take; ``Sandbox(pool=...)`` plus the first cell.

Variants: bwrap (cold), the zygote, Docker (when its engine answers; else the results
say why not), microvm booted cold (the backend's machine for the accelerator), and
microvm restored from its snapshot (the default; the snapshot is made before timing).
The accelerator (KVM or TCG) is the backend probe's choice and is printed.

    PYTHONPATH=src nice .venv/bin/python bench/microvm.py --runs 5 --pool 5 --out bench/results/

Against an earlier sandlot, restored VMs only, alternating (bench/compare.py; each side
makes its own snapshot once, before its rows)::

    nice .venv/bin/python bench/compare.py --baseline 4a273a8 --rounds 3 -- \\
        bench/microvm.py --runs 5 --cells 30 --only restored
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

from sandlot import Pool, Sandbox
from sandlot.backends.microvm import MicroVMBackend

FIRST_CELL = "import numpy, pandas, matplotlib.pyplot\n1 + 1"


def _variants(docker: Callable[[], Any] | None) -> dict[str, Callable[[], Any]]:
    variants: dict[str, Callable[[], Any]] = {
        "bwrap (cold)": lambda: "bwrap",
        "zygote (bwrap, forked from a preloaded sandbox)": lambda: "zygote",
    }
    if docker is not None:
        variants["docker (runc)"] = docker
    variants["microvm, booted cold"] = lambda: MicroVMBackend(snapshot=False)
    variants["microvm, restored from its snapshot (fresh identity)"] = lambda: MicroVMBackend()
    return variants


def _docker() -> tuple[Callable[[], Any] | None, str]:
    """Docker's variant when its engine answers and the template image is built."""
    from sandlot.backends import load_backend
    from sandlot.backends.docker import container_backend_problem

    docker = load_backend("docker")
    problem = container_backend_problem(docker())
    return (None, problem) if problem else (lambda: docker(), "")


def _pool_rows(make: Callable[[], Any], runs: int) -> list[float]:
    """Hand-out -> first result from a ``Pool(size=1)``, refilled before each take."""
    times = []
    with Pool(size=1, backend=make()) as pool:
        pool.warm()
        for _ in range(runs):
            with pool._cond:  # notified when a started sandbox joins the ready queue
                pool._cond.wait_for(lambda: pool.stats().size == 1, timeout=600)
            t0 = time.perf_counter()
            with Sandbox(backend=make(), pool=pool, timeout=600) as sandbox:
                result = sandbox.run_code(FIRST_CELL)
                times.append((time.perf_counter() - t0) * 1000)
            if result.text != "2":
                raise RuntimeError(f"pooled sandbox answered {result.text!r}: {result.error}")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="cold starts per variant")
    parser.add_argument("--cells", type=int, default=50, help="round trips per variant")
    parser.add_argument("--pool", type=int, default=0, help="pool hand-outs per pooled variant")
    parser.add_argument("--out", type=Path, help="directory for the .json and .md results")
    parser.add_argument(
        "--only", help="only the variants whose name contains this (e.g. 'restored')"
    )
    parser.add_argument(
        "--json", type=Path, help="write {row: [ms, ...]} here (what bench/compare.py reads)"
    )
    args = parser.parse_args()

    probe = MicroVMBackend.probe()
    if not probe.available:
        print(f"microvm unavailable: {probe.reason} (fix: {probe.fix})", file=sys.stderr)
        return 1
    accel = probe.details.get("accelerator", "?")
    docker, no_docker = _docker() if not args.only or args.only in "docker (runc)" else (None, "")
    variants = {k: v for k, v in _variants(docker).items() if not args.only or args.only in k}
    rows: dict[tuple[str, str], list[float]] = {}
    notes = [f"Docker not measured: {no_docker}"] if no_docker else []
    # The snapshot is made once (a cold boot and the imports); not what the rows time.
    made = time.perf_counter()
    Sandbox(backend=MicroVMBackend(), timeout=900).kill()
    if any(name.startswith("zygote") for name in variants):
        Sandbox(backend="zygote", timeout=900).kill()  # the zygote itself starts once, too
    notes.append(f"Making or finding the microvm snapshot took {time.perf_counter() - made:.1f} s.")
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
    for name, make in variants.items() if args.cells else ():
        with Sandbox(backend=make(), timeout=600) as sandbox:
            for _ in range(5):
                sandbox.run_code("1+1")
            times = []
            for _ in range(args.cells):
                t0 = time.perf_counter()
                sandbox.run_code("1+1")
                times.append((time.perf_counter() - t0) * 1000)
            rows[("per-cell round trip `1+1`", name)] = times
    pooled = {k: v for k, v in variants.items() if k.startswith(("zygote", "microvm, restored"))}
    for name, make in pooled.items() if args.pool else ():
        rows[("pool hand-out -> first result (data stack imported)", name)] = _pool_rows(
            make, args.pool
        )
    elapsed = time.monotonic() - started
    load_end = os.getloadavg()

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    lines = [
        "# sandlot bench: microvm beside bwrap, zygote and Docker, "
        + time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
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
    text = "\n".join([*lines, "", *notes]) + "\n"
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({f"{m} | {n}": v for (m, n), v in rows.items()}))
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
