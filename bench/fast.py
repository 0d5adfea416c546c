"""What a user gets by default: ``Sandbox()`` with no backend named, and a warm pool.

The rows the speed targets are set on, each in one run of this script:

* ``first Sandbox()``: the process's first sandbox, create -> first ``1 + 1`` result
  (one value per run of the script; ``bench/compare.py --rounds`` runs it again in a
  fresh process);
* ``Sandbox()``: later sandboxes, create -> first result, p50/p95/p99 (the ``kill()``
  after each is not counted);
* ``pool``: ``Sandbox(pool=pool)`` from a warm ``Pool`` (each timed run waits until
  the pool has a ready sandbox again; the refill rate is the throughput row's);
* ``1+1 round trip``: ``run_code("1 + 1")`` on a started default sandbox, beside
  ``eval`` in this process (the floor);
* ``create + run + kill``: sustained sandboxes per second, ``--workers`` threads (2, and
  4 in a second row: a start waits on the kernel in part);
* ``idle sandboxes``: ``--idle`` default sandboxes alive at once, each answering
  ``is_running()`` (the time per call is the row; the count that started is noted).

It uses the public API only, so the same script measures an older sandlot: run it with
``PYTHONPATH`` at that version's ``src`` (``bench/compare.py`` does, and prints both side
by side). Run::

    .venv/bin/python bench/fast.py                       # about a minute
    .venv/bin/python bench/fast.py --idle 1000 --json out.json

Numbers on a shared 2-core machine are noisy: read them next to the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sandlot
from sandlot import Pool, Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import summary

CELL = "1 + 1"


def _ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def _create_and_run(**kwargs: Any) -> None:
    _first_result(**kwargs).kill()


def _first_result(**kwargs: Any) -> Sandbox:
    sbx = Sandbox(timeout=120, **kwargs)
    if sbx.run_code(CELL).text != "2":
        sbx.kill()
        raise RuntimeError("wrong answer")
    return sbx


def _timed_first_result(**kwargs: Any) -> float:
    """create -> first result in ms; the kill afterwards is not counted."""
    started = time.perf_counter()
    sbx = _first_result(**kwargs)
    elapsed = (time.perf_counter() - started) * 1000
    sbx.kill()
    return elapsed


def _running(sbx: Sandbox) -> None:
    if not sbx.is_running():
        raise RuntimeError("an idle sandbox is not running")


def _pool_ready(pool: Pool, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while pool.stats().size < 1:
        if time.monotonic() > end:
            raise RuntimeError("the pool did not refill within 60 s")
        time.sleep(0.005)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    rows["first Sandbox()"] = [_timed_first_result()]
    # The zygote (when "auto" uses one) starts in the background after the first
    # sandbox; the steady state is what the next rows measure.
    time.sleep(args.settle)
    _create_and_run()
    rows["Sandbox()"] = [_timed_first_result() for _ in range(args.runs)]

    with Pool(size=2) as pool:
        pool.warm()
        values = []
        for _ in range(args.runs + 1):
            _pool_ready(pool)
            values.append(_timed_first_result(pool=pool))
        rows["pool"] = values[1:]

    rows["eval 1+1 (floor)"] = [_ms(lambda: eval(CELL)) for _ in range(args.round_trips)]
    with Sandbox(timeout=None) as sbx:
        for _ in range(20):
            sbx.run_code(CELL)
        rows["1+1 round trip"] = [_ms(lambda: sbx.run_code(CELL)) for _ in range(args.round_trips)]

    for n, workers in enumerate(args.workers):
        name = "create + run + kill" + (f", {workers} threads" if n else "")
        rows[f"{name} (sandboxes/s)"] = _throughput(args.throughput_n, workers)

    alive: list[Sandbox] = []
    error = ""
    try:
        for _ in range(args.idle):
            alive.append(Sandbox(timeout=None))
        rows["idle sandboxes: is_running()"] = [_ms(lambda s=s: _running(s)) for s in alive]
    except Exception as exc:  # noted: how many started is the result
        error = f"{type(exc).__name__}: {exc}"[:200]
        rows["idle sandboxes: is_running()"] = []
    rows["idle sandboxes alive"] = {
        "value": sum(1 for s in alive if s.is_running()),
        "note": f"asked for {args.idle}" + (f"; stopped at: {error}" if error else ""),
    }
    failed_kills = 0
    for sbx in alive:
        try:
            sbx.kill()
        except Exception:  # an older sandlot's kill() could raise here; counted
            failed_kills += 1
    if failed_kills:
        rows["idle sandboxes alive"]["note"] += f"; {failed_kills} kill() calls raised"
    return rows


def _throughput(total: int, workers: int) -> dict[str, Any]:
    """Sandboxes per second created, run (``1 + 1``) and killed by ``workers`` threads."""
    done = 0
    lock = threading.Lock()
    failures: list[BaseException] = []

    def worker() -> None:
        nonlocal done
        while True:
            with lock:
                if done >= total:
                    return
                done += 1
            try:
                _create_and_run()
            except Exception as exc:  # counted, not raised: the rate is the row
                failures.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {
        "value": (total - len(failures)) / elapsed,
        "note": f"{total} sandboxes, {workers} threads, {len(failures)} failed",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="timed creates per row")
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--throughput-n", type=int, default=200)
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[2, 4],
        help="threads for the throughput rows, comma-separated (a sandbox's start waits "
        "for the kernel in part, a cgroup move's RCU grace period on v1: more threads than "
        "cores keep the CPUs busy meanwhile, as a server's concurrent requests do)",
    )
    parser.add_argument("--idle", type=int, default=200, help="default sandboxes alive at once")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the first")
    parser.add_argument("--json", type=Path, help="write {row: values} here")
    args = parser.parse_args()
    load = os.getloadavg()
    rows = measure(args)
    rows["_meta"] = {
        "sandlot": str(Path(sandlot.__file__).resolve().parent),
        "load_start": load,
        "load_end": os.getloadavg(),
    }
    if args.json:
        args.json.write_text(json.dumps(rows))
    print(
        f"sandlot from {rows['_meta']['sandlot']}; load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print("| row (ms unless noted) | p50 / p95 / p99 |")
    print("|---|---|")
    for name, value in rows.items():
        if not name.startswith("_"):
            print(f"| {name} | {summary(value)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
