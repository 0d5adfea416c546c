"""Batch throughput of ``sandlot.ray.run_batch``: 1 Ray node vs 3, beside plain local sandboxes.

All in one run, on one machine:

* ``local``: the same programs on ordinary ``Sandbox(pool=pool)`` objects in this
  process, ``--local-threads`` at a time (no Ray at all: the floor to compare with),
  with as many at once as one node (2) and as three nodes (6) run;
* ``ray, 1 node``: a Ray head on 127.0.0.2 (``ray start``, its own process tree) and
  ``run_batch`` on it;
* ``ray, 3 nodes``: two more nodes (127.0.0.3, .4) joined to the same cluster, and the
  same batch.

Every node has ``--slots`` slots (programs at once). The three Ray nodes are processes
on the SAME machine and share its cores: three nodes here cannot be faster than the
cores allow, so the 3-node row measures what routing over more nodes costs, not what
more machines would gain (that scales with the machines; see docs/ray.md).

Run::

    .venv/bin/python bench/ray_batch.py                  # ~2 minutes on 2 cores
    .venv/bin/python bench/ray_batch.py --programs 1000 --out bench/results/ray-batch.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _ray_cluster import LocalRayCluster  # noqa: E402
from sandlot import Execution, Pool, Sandbox  # noqa: E402

WORKLOADS: dict[str, Callable[[int], str]] = {
    "tiny": lambda i: f"{i} + 1",
    "sum of 120k squares": lambda i: f"sum(x * x for x in range(120_000)) + {i}",
}


def _local(codes: list[str], threads: int) -> tuple[float, list[Execution]]:
    results: list[Execution | None] = [None] * len(codes)
    lock = threading.Lock()
    next_index = 0

    def worker(pool: Pool) -> None:
        nonlocal next_index
        while True:
            with lock:
                index = next_index
                next_index += 1
            if index >= len(codes):
                return
            with Sandbox(pool=pool, precheck="off", timeout=120) as sbx:
                results[index] = sbx.run_code(codes[index], timeout=30)

    with Pool(size=2, preload=()) as pool:
        # One warm-up so the zygote and the pool are up, as on the Ray nodes.
        with Sandbox(pool=pool, precheck="off") as sbx:
            sbx.run_code("1")
        started = time.perf_counter()
        workers = [threading.Thread(target=worker, args=(pool,)) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - started
    return elapsed, [r for r in results if r is not None]


def _ray(cluster: Any, codes: list[str]) -> tuple[float, list[Any]]:
    from sandlot.ray import run_batch

    run_batch(["1"] * 6, cluster=cluster)  # warm each node's zygote and pool
    started = time.perf_counter()
    out = run_batch(codes, cluster=cluster)
    return time.perf_counter() - started, out


def _row(name: str, workload: str, n: int, elapsed: float, out: list[Any]) -> dict[str, Any]:
    failed = sum(1 for e in out if e.error is not None)
    nodes = len({getattr(e, "node_ip", "local") for e in out})
    return {
        "setup": name,
        "workload": workload,
        "programs": n,
        "seconds": round(elapsed, 2),
        "programs_per_second": round(n / elapsed, 1),
        "failed": failed,
        "nodes_used": nodes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=300)
    parser.add_argument("--slots", type=int, default=2, help="programs at once per node")
    parser.add_argument(
        "--local-threads", default="2,6", help="comma-separated thread counts for local rows"
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown results file")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from sandlot.ray import SandlotCluster

    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for threads in (int(t) for t in args.local_threads.split(",")):
        for workload, make in WORKLOADS.items():
            codes = [make(i) for i in range(args.programs)]
            elapsed, out = _local(codes, threads)
            rows.append(_row(f"local, {threads} threads", workload, len(codes), elapsed, out))
            print(rows[-1], flush=True)

    with tempfile.TemporaryDirectory(prefix="sandlot-bench-ray-") as tmp:
        local = LocalRayCluster(Path(tmp), cpus=args.slots)
        try:
            ray.init(address=local.address, _node_ip_address="127.0.0.2", log_to_driver=False)
            local.wait_for_nodes({"127.0.0.2"})
            for nodes in (1, 3):
                if nodes == 3:
                    local.add_node()
                    local.add_node()
                    local.wait_for_nodes({"127.0.0.2", "127.0.0.3", "127.0.0.4"})
                with SandlotCluster(slots_per_node=args.slots) as cluster:
                    for workload, make in WORKLOADS.items():
                        codes = [make(i) for i in range(args.programs)]
                        elapsed, out = _ray(cluster, codes)
                        assert [e.error for e in out] == [None] * len(out), out[:3]
                        rows.append(
                            _row(f"ray, {nodes} node(s)", workload, len(codes), elapsed, out)
                        )
                        print(rows[-1], flush=True)
        finally:
            ray.shutdown()
            local.close()

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "slots_per_node": args.slots,
        "ray": ray.__version__,
    }
    lines = [
        f"# sandlot.ray batch throughput ({meta['date']})",
        "",
        f"{meta['cpus']} CPUs shared by every row (and with other work on the host: load "
        f"{meta['load_before']} before, {meta['load_after']} after). The 3 Ray nodes are "
        "processes on this one machine: they share the same cores as the 1-node and the "
        "local rows, so the 3-node row shows routing cost, not the gain of more machines.",
        f"Each node has {args.slots} slots; Ray {meta['ray']}; default backend ('auto').",
        "",
        "| setup | workload | programs | seconds | programs/s | failed | nodes used |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['workload']} | {r['programs']} | {r['seconds']} | "
            f"{r['programs_per_second']} | {r['failed']} | {r['nodes_used']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
