"""Cold and pooled sandbox latency for bubblewrap, Docker (runc, optionally gVisor) and
Podman, in one run on one host: p50/p95/p99 in milliseconds, printed and written to
``bench/results/``.

For each backend, *cold* is ``Sandbox()`` (start the sandbox, wait for the runner)
then a first pandas cell (which imports pandas); *pooled* is ``Sandbox(pool=...)`` with
a :class:`sandlot.Pool` (sandboxes started ahead, the data stack already imported) and
the same cell. Before each pooled round the pool is full, so the acquire column is the
hand-off, not the refill. Run:

    .venv/bin/python bench/backends.py                 # 20 rounds each
    .venv/bin/python bench/backends.py -n 50 --backends bwrap,docker,docker-runsc,podman

Numbers are for comparison within one run; the machine and its load matter more
than anything here. Nothing in the test suite asserts them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandlot import Pool, Sandbox
from sandlot.backends import Backend, get_backend
from sandlot.backends.docker import DockerBackend

CELL = "import pandas as pd\npd.DataFrame({'a': [1, 2, 3]}).a.sum()"
RESULTS = Path(__file__).parent / "results"


def _backend(name: str) -> Backend:
    if name == "docker-runsc":
        return DockerBackend(runtime="runsc")
    return get_backend(name)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(_pct(values, 50), 1),
        "p95": round(_pct(values, 95), 1),
        "p99": round(_pct(values, 99), 1),
        "mean": round(statistics.fmean(values), 1),
    }


def _round(backend: Backend, pool: Pool | None = None) -> tuple[float, float]:
    """(ms until the sandbox is usable, ms for the first pandas cell)."""
    started = time.perf_counter()
    sbx = Sandbox(backend=backend, timeout=120, pool=pool)
    ready = time.perf_counter()
    try:
        execution = sbx.run_code(CELL, timeout=120)
        done = time.perf_counter()
        assert execution.error is None, execution.error
    finally:
        sbx.kill()
    return (ready - started) * 1000, (done - ready) * 1000


def measure(name: str, rounds: int, pool_size: int) -> dict[str, Any]:
    backend = _backend(name)
    _round(backend)  # warm the image/template and page cache; not counted
    cold = [_round(backend) for _ in range(rounds)]
    with Pool(size=pool_size, backend=backend, ttl=None) as pool:
        pool.warm()
        pooled: list[tuple[float, float]] = []
        for _ in range(rounds):
            _full(pool, pool_size)  # measure acquisition, not refill speed
            hits = pool.stats().hits
            pooled.append(_round(backend, pool))
            assert pool.stats().hits == hits + 1, pool.stats()
    report: dict[str, Any] = {}
    for label, samples in (("cold", cold), ("pooled", pooled)):
        report[label] = {
            "acquire_ms": _summary([a for a, _ in samples]),
            "first_cell_ms": _summary([c for _, c in samples]),
            "total_ms": _summary([a + c for a, c in samples]),
        }
    return report


def _full(pool: Pool, size: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while pool.stats().size < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not fill in {timeout} s: {pool.stats()}")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=20)
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--backends", default="bwrap,docker,docker-runsc,podman")
    args = parser.parse_args()
    names = [n for n in args.backends.split(",") if n]
    results: dict[str, Any] = {}
    for name in names:
        print(f"measuring {name} ({args.rounds} cold + {args.rounds} pooled rounds)...", flush=True)
        results[name] = measure(name, args.rounds, args.pool_size)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    document = {
        "when": stamp,
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": _cpus()},
        "rounds": args.rounds,
        "cell": CELL,
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    lines = [
        f"# Sandbox latency, {stamp} ({args.rounds} rounds, {_cpus()} CPUs)",
        "",
        "| backend | mode | acquire p50 / p95 / p99 ms | first pandas cell p50 / p95 / p99 ms "
        "| total p50 / p95 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    for name, modes in results.items():
        for mode, numbers in modes.items():
            cells = [
                " / ".join(str(numbers[key][q]) for q in ("p50", "p95", "p99"))
                for key in ("acquire_ms", "first_cell_ms", "total_ms")
            ]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (RESULTS / f"backends-{stamp}.json").write_text(json.dumps(document, indent=2) + "\n")
    (RESULTS / f"backends-{stamp}.md").write_text(table)
    (RESULTS / "backends-latest.md").write_text(table)
    print()
    print(table)


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
