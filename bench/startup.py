"""Startup, round-trip, memory, throughput and data-workload numbers, side by side.

Every row is measured in the same run, on the same machine, against the same
template interpreter, so the baselines and sandlot can be compared directly:

* ``python -c``: the template's interpreter importing numpy, pandas and matplotlib,
  no sandbox at all (the floor for a cold interpreter);
* ``naive bwrap``: the same ``python -c`` inside a bare per-call bubblewrap sandbox
  (new namespaces, read-only root; no sandlot, no seccomp, no cgroup);
* ``sandlot cold``: ``Sandbox()`` then the first ``run_code`` result, no pool;
* ``sandlot zygote``: ``Sandbox(backend="zygote")``, a sandbox forked from the
  template's zygote, which has the data stack imported (fresh namespaces, cgroup,
  seccomp and no capabilities per sandbox), no pool;
* ``sandlot pool``: ``Sandbox(backend=..., pool=...)`` from a warm pool (refilled from
  the zygote unless ``--pool-backend bwrap``) whose sandboxes have the data stack
  already imported (each timed run starts once the pool has a ready sandbox; the
  refill rate shows up in the throughput rows instead);
* Docker rows, when a Docker backend is registered in sandlot and its engine runs.

Run (as root or as a user that can run sandlot), for example:

    .venv/bin/python bench/startup.py --runs 100                   # about 10 min, busy 2 cores
    .venv/bin/python bench/startup.py --runs 100 --cold-runs 100   # cold rows 100x too (slow)
    .venv/bin/python bench/startup.py --runs 5 --alive 3 --throughput-n 5 --data-runs 2

It prints a table and writes ``bench/results/<date>-<host>.md`` and ``.json`` with a
description of the machine (CPU, cores, kernel, RAM, load average, bwrap and cgroup
versions). Numbers on a shared machine are noisy: read them next to the load average.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sandlot
from sandlot import Sandbox
from sandlot.templates import ensure_template

IMPORT_STACK = "import numpy, pandas, matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot"
FIRST_CELL = "import numpy as np, pandas as pd, matplotlib.pyplot as plt\n1 + 1"
DATA_STACK = ("numpy", "pandas", "matplotlib.pyplot")

# The data workload: 1M rows, a groupby, a chart written to a PNG. The same code runs
# in plain python and in a sandbox; only the workload is timed, not the imports.
MAKE_CSV = """
import numpy as np, pandas as pd
rng = np.random.default_rng(7)
n = 1_000_000
pd.DataFrame({
    "region": rng.choice(["north", "south", "east", "west", "centre"], n),
    "product": rng.integers(0, 200, n),
    "units": rng.integers(1, 20, n),
    "price": rng.random(n).round(4) * 100,
}).to_csv(%r, index=False)
"""
WORKLOAD = """
df = pd.read_csv("sales.csv")
df["revenue"] = df["units"] * df["price"]
summary = df.groupby(["region", "product"]).revenue.agg(["sum", "mean", "count"])
top = summary.sort_values("sum", ascending=False).head(20)
fig, ax = plt.subplots(figsize=(8, 4))
df.groupby("region").revenue.sum().plot.bar(ax=ax)
fig.savefig("chart.png")
plt.close(fig)
len(summary)
"""
PLAIN_WORKLOAD = """
import sys, time, json
import numpy as np, pandas as pd, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
code = compile(%r, "<workload>", "exec")
# One run per line on stdin, so the bench can alternate plain and sandboxed runs.
for _ in sys.stdin:
    t, c = time.perf_counter(), time.process_time()
    exec(code)
    print(json.dumps([time.perf_counter() - t, time.process_time() - c]), flush=True)
"""


@dataclass
class Row:
    """One line of the table: a metric for one variant."""

    metric: str
    variant: str
    unit: str
    samples: list[float] = field(default_factory=list)
    ok: int = 0
    attempts: int = 0
    note: str = ""

    def summary(self) -> dict[str, Any]:
        values = sorted(self.samples)
        return {
            "metric": self.metric,
            "variant": self.variant,
            "unit": self.unit,
            "n": len(values),
            "p50": _pct(values, 50),
            "p95": _pct(values, 95),
            "p99": _pct(values, 99),
            "success": self.ok / self.attempts if self.attempts else None,
            "note": self.note,
        }


def _pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (no interpolation: every value printed was measured)."""
    if not values:
        return None
    rank = max(1, -(-len(values) * p // 100))
    return values[int(rank) - 1]


def _timed(row: Row, fn: Callable[[], object], scale: float = 1000.0) -> None:
    """Time ``fn``; if it returns a ``perf_counter`` value, that is the end (so the
    sandbox's teardown after the result is not counted)."""
    row.attempts += 1
    started = time.perf_counter()
    try:
        end = fn()
    except Exception as exc:  # a failed run counts against the success rate
        row.note = f"last failure: {type(exc).__name__}: {exc}"[:200]
        return
    if not isinstance(end, float):
        end = time.perf_counter()
    row.samples.append((end - started) * scale)
    row.ok += 1


def _progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


# --- baselines --------------------------------------------------------------------------
def _run_ok(argv: list[str], preexec: Callable[[], None] | None = None) -> None:
    done = subprocess.run(argv, capture_output=True, timeout=120, preexec_fn=preexec)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode(errors="replace")[-300:])


def naive_bwrap_argv(python: str) -> list[str]:
    """A bare per-call bubblewrap sandbox: what a hand-rolled wrapper would do."""
    bwrap = shutil.which("bwrap") or "bwrap"
    return [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        python,
    ]


@contextlib.contextmanager
def _beside_sandboxes() -> Iterator[Callable[[], None] | None]:
    """A ``preexec_fn`` that moves a plain process into a fresh cgroup next to the
    sandboxes' (in the CPU hierarchy), or None where that cannot be done (not root,
    no cgroup base). Shows what the scheduler gives that spot, without a sandbox."""
    from sandlot.backends import _cgroups

    try:
        host = _cgroups.host()
        base = host.bases.get("cpu" if host.version == 1 else "")
        if base is None:
            yield None
            return
        path = base / f"bench-{os.getpid()}"
        path.mkdir()
    except (OSError, sandlot.SandlotError):
        yield None
        return
    procs = str(path / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write("0")

    try:
        yield enter
    finally:
        with contextlib.suppress(OSError):
            path.rmdir()


# --- sandlot helpers ----------------------------------------------------------------------
def _check(execution: Any) -> None:
    if execution.error is not None:
        raise RuntimeError(f"{execution.error.name}: {execution.error.value}")


def _pids_under(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_mib(pids: list[int]) -> float:
    """Proportional set size summed over processes, MiB (shared pages split fairly)."""
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
                    break
    return total_kib / 1024


def sandbox_pids(sbx: Sandbox) -> list[int]:
    """Every process of one sandbox: bwrap and its descendants on the host."""
    handle = sbx._core._handle  # bench-only peek at the backend handle
    process = getattr(handle, "_process", None)
    if process is None:
        raise RuntimeError("this backend does not expose its process")
    return _pids_under(process.pid)


def _make_pool(args: argparse.Namespace) -> Any:
    pool_cls = getattr(sandlot, "Pool", None)
    if pool_cls is None:
        return None
    pool = pool_cls(size=args.pool_size, preload=DATA_STACK, backend=args.pool_backend)
    pool.warm()  # the key every Sandbox(pool=pool) below uses
    return pool


def _from_pool(pool: Any) -> Sandbox:
    return Sandbox(backend=pool._backend, pool=pool)


def _zygote() -> Sandbox:
    return Sandbox(backend="zygote")


def _wait_warm(pool: Any, timeout: float = 120.0) -> None:
    """Block (untimed) until the pool holds a ready sandbox for the default key."""
    deadline = time.monotonic() + timeout
    while pool.stats().size < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the pool did not refill in time")
        time.sleep(0.01)


# --- the measurements -----------------------------------------------------------------------
def bench_first_result(args: argparse.Namespace, python: str, pool: Any) -> list[Row]:
    metric = "create -> first result (numpy+pandas+matplotlib imported)"
    rows = [
        Row(metric, "python -c (no sandbox, floor)", "ms"),
        Row(metric, "naive bwrap + python -c", "ms"),
        Row(metric, "sandlot cold (no pool)", "ms"),
        Row(metric, "sandlot zygote (a fork per sandbox, no pool)", "ms"),
    ]
    if pool is not None:
        rows.append(Row(metric, f"sandlot pool ({pool._backend}, preloaded)", "ms"))
    floor = [python, "-c", IMPORT_STACK]
    naive = [*naive_bwrap_argv(python), "-c", IMPORT_STACK]
    shares = Row(metric, "python -c in a cgroup beside the sandboxes' (no sandbox)", "ms")

    def cold() -> float:
        with Sandbox() as sbx:
            _check(sbx.run_code(FIRST_CELL))
            return time.perf_counter()

    def pooled() -> float:
        with _from_pool(pool) as sbx:
            _check(sbx.run_code(FIRST_CELL))
            return time.perf_counter()

    def forked() -> float:
        with _zygote() as sbx:
            _check(sbx.run_code(FIRST_CELL))
            return time.perf_counter()

    with _zygote():  # the zygote's own start (once per template) is not timed
        pass

    # Interleaved, so that load changes during the run hit every variant alike.
    with _beside_sandboxes() as enter:
        for i in range(args.cold_runs):
            _timed(rows[0], lambda: _run_ok(floor))
            _timed(rows[1], lambda: _run_ok(naive))
            if enter is not None:
                _timed(shares, lambda: _run_ok(floor, enter))
            _timed(rows[2], cold)
            _timed(rows[3], forked)
            if pool is not None:
                _wait_warm(pool)
                _timed(rows[-1], pooled)
            if (i + 1) % 10 == 0:
                _progress(f"first result: {i + 1}/{args.cold_runs}")
    if shares.samples:
        rows.insert(2, shares)
        shares.note = "the CPU scheduler's share for sandboxes, without any sandbox"
    # The remaining runs of the cheap rows (the cold ones above are not cheap).
    for _ in range(args.runs - args.cold_runs):
        _timed(rows[-2 if pool is not None else -1], forked)
        if pool is not None:
            _wait_warm(pool)
            _timed(rows[-1], pooled)
    if pool is not None:
        stats = pool.stats()
        rows[-1].note = f"pool hits {stats.hits}, misses {stats.misses}"
    return rows


def bench_round_trip(args: argparse.Namespace) -> list[Row]:
    metric = "per-cell round trip, `1+1` through the SDK"
    rows = []
    for sbx, variant in (
        (Sandbox(), "sandlot (precheck=report, default)"),
        (Sandbox(precheck="off"), "sandlot (precheck=off)"),
        (Sandbox(backend="zygote", precheck="off"), "sandlot zygote (precheck=off)"),
    ):
        row = Row(metric, variant, "ms")
        with sbx:
            _check(sbx.run_code("1+1"))  # warm-up: the kernel's first cell

            def cell(sbx: Sandbox = sbx) -> None:
                _check(sbx.run_code("1+1"))

            for _ in range(args.runs * 5):
                _timed(row, cell)
        rows.append(row)
    return rows


def bench_memory(args: argparse.Namespace, python: str, pool: Any) -> list[Row]:
    metric = f"idle memory per sandbox, PSS ({args.alive} alive at once)"
    rows = [
        Row(metric, "python with the data stack imported (no sandbox)", "MiB"),
        Row(metric, "sandlot cold, idle (nothing run)", "MiB"),
        Row(metric, "sandlot cold, data stack imported", "MiB"),
    ]
    rows.append(Row(metric, "sandlot zygote, idle (data stack imported)", "MiB"))
    if pool is not None:
        rows.append(Row(metric, f"sandlot pool ({pool._backend}, preloaded)", "MiB"))
    procs = [
        subprocess.Popen(
            [python, "-c", IMPORT_STACK + "; import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
        )
        for _ in range(args.alive)
    ]
    try:
        time.sleep(min(30, 2 + args.alive))  # imports finish; crude but untimed
        for proc in procs:
            rows[0].attempts += 1
            rows[0].samples.append(pss_mib([proc.pid]))
            rows[0].ok += 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

    def measure(row: Row, make: Callable[[], Sandbox], cell: str | None) -> None:
        with contextlib.ExitStack() as stack:
            boxes = []
            for _ in range(args.alive):
                row.attempts += 1
                try:
                    sbx = stack.enter_context(make())
                    if cell is not None:
                        _check(sbx.run_code(cell))
                    boxes.append(sbx)
                except Exception as exc:
                    row.note = f"{type(exc).__name__}: {exc}"[:200]
            time.sleep(1)  # let the cell's garbage settle
            for sbx in boxes:
                row.samples.append(pss_mib(sandbox_pids(sbx)))
                row.ok += 1

    measure(rows[1], Sandbox, None)
    measure(rows[2], Sandbox, FIRST_CELL)
    measure(rows[3], _zygote, None)
    if pool is not None:

        def from_pool() -> Sandbox:
            _wait_warm(pool)
            return _from_pool(pool)

        measure(rows[4], from_pool, None)
    return rows


def bench_many(args: argparse.Namespace) -> list[Row]:
    """``--many`` zygote sandboxes alive at once: does the host hold them, and what each
    costs (its processes' PSS, plus its share of the zygote's)."""
    if args.many <= 0:
        return []
    from sandlot.backends.bwrap import _zygote as zygote_backend

    metric = f"{args.many} idle zygote sandboxes alive at once, PSS per sandbox"
    row = Row(metric, "sandlot zygote (own processes + 1/N of the zygote)", "MiB")
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        boxes = []
        for i in range(args.many):
            row.attempts += 1
            try:
                boxes.append(stack.enter_context(_zygote()))
                row.ok += 1
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if (i + 1) % 50 == 0:
                _progress(f"many: {i + 1}/{args.many}")
        time.sleep(1)
        per_box: list[list[int]] = []
        for sbx in boxes:
            try:
                per_box.append(sandbox_pids(sbx))
            except RuntimeError as exc:
                errors.append(f"{exc}")
        in_boxes = {pid for pids in per_box for pid in pids}
        zygotes = [
            z._process.pid for z in zygote_backend._ZYGOTES.values() if z._process is not None
        ]
        own = [p for pid in zygotes for p in (pid, *_pids_under(pid)) if p not in in_boxes]
        zygote_pss = pss_mib(own)
        share = zygote_pss / max(1, len(per_box))
        for pids in per_box:
            row.samples.append(pss_mib(pids) + share)
        alive = sum(1 for sbx in boxes if sbx.is_running())
        row.note = f"{alive}/{args.many} answered is_running(); zygote PSS {zygote_pss:.0f} MiB"
        if errors:
            row.note += f"; {len(errors)} failed, first: {errors[0]}"
    return [row]


def bench_throughput(args: argparse.Namespace, pool: Any) -> list[Row]:
    """Sandboxes per second, create + run `1+1` + kill, one after another."""
    metric = "sustained create + run `1+1` + kill (sequential)"
    rows = [
        Row(metric, "sandlot cold (no pool)", "sandboxes/s"),
        Row(metric, "sandlot zygote (no pool)", "sandboxes/s"),
    ]
    if pool is not None:
        rows.append(
            Row(
                metric, f"sandlot pool ({pool._backend}, refilled in the background)", "sandboxes/s"
            )
        )

    def loop(row: Row, make: Callable[[], Sandbox]) -> None:
        started = time.perf_counter()
        for _ in range(args.throughput_n):
            row.attempts += 1
            try:
                with make() as sbx:
                    _check(sbx.run_code("1+1"))
                row.ok += 1
            except Exception as exc:
                row.note = f"{type(exc).__name__}: {exc}"[:200]
        elapsed = time.perf_counter() - started
        row.samples.append(row.ok / elapsed)

    def pooled(row: Row, pool: Any) -> None:
        _wait_warm(pool)
        before = pool.stats()
        loop(row, lambda: _from_pool(pool))
        after = pool.stats()
        row.note = (
            f"{after.hits - before.hits} hits, {after.misses - before.misses} misses "
            f"(pool size {args.pool_size})"
        )

    loop(rows[0], Sandbox)
    loop(rows[1], _zygote)
    if pool is not None:
        pooled(rows[2], pool)
    # Callers in parallel (a server's request handlers), one per core.
    workers = os.cpu_count() or 2
    parallel = Row(
        f"sustained create + run `1+1` + kill ({workers} callers in parallel)",
        "sandlot zygote (no pool)",
        "sandboxes/s",
    )
    with concurrent.futures.ThreadPoolExecutor(workers) as executor:
        started = time.perf_counter()
        per_worker = max(1, args.throughput_n // workers)

        def work() -> int:
            done = 0
            for _ in range(per_worker):
                with _zygote() as sbx:
                    _check(sbx.run_code("1+1"))
                done += 1
            return done

        futures = [executor.submit(work) for _ in range(workers)]
        parallel.attempts = per_worker * workers
        for future in futures:
            try:
                parallel.ok += future.result()
            except Exception as exc:
                parallel.note = f"{type(exc).__name__}: {exc}"[:200]
        parallel.samples.append(parallel.ok / (time.perf_counter() - started))
    return [*rows, parallel]


def bench_data(args: argparse.Namespace, python: str, pool: Any, workdir: Path) -> list[Row]:
    metric = "data workload (1M-row CSV, groupby, chart), workload only"
    csv = workdir / "sales.csv"
    _run_ok([python, "-c", MAKE_CSV % str(csv)])
    plain = Row(metric, "plain python (no sandbox)", "ms")
    boxed = Row(metric, "sandlot", "ms")
    # CPU time as well as wall time: on a busy host the wall time mostly measures the
    # scheduler's share, not what the sandbox costs.
    cpu_metric = "data workload, CPU time (all threads)"
    plain_cpu = Row(cpu_metric, "plain python (no sandbox)", "ms")
    boxed_cpu = Row(cpu_metric, "sandlot (sandbox cgroup's cpuacct)", "ms")
    # Plain and sandboxed runs alternate, one each per round, so that both see the
    # same host (a shared VM's speed drifts by tens of percent over a minute).
    plain_proc = subprocess.Popen(
        [python, "-c", PLAIN_WORKLOAD % WORKLOAD],
        cwd=workdir,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert plain_proc.stdin is not None and plain_proc.stdout is not None

    def run_plain() -> None:
        plain.attempts += 1
        plain_cpu.attempts += 1
        try:
            plain_proc.stdin.write("run\n")  # type: ignore[union-attr]
            plain_proc.stdin.flush()  # type: ignore[union-attr]
            wall, cpu = json.loads(plain_proc.stdout.readline())  # type: ignore[union-attr]
        except (OSError, ValueError) as exc:
            plain.note = f"{type(exc).__name__}: {exc}"[:200]
            return
        plain.samples.append(wall * 1000)
        plain_cpu.samples.append(cpu * 1000)
        plain.ok += 1
        plain_cpu.ok += 1

    # The sandbox gets the host's CPUs, as plain python has: this row measures what
    # sandboxing costs, not the default 1-CPU quota (a policy the caller chooses).
    with Sandbox(backend="zygote", resources={"cpus": None}) as sbx, plain_proc:
        with open(csv, "rb") as f:
            sbx.files.write("sales.csv", f)
        _check(sbx.run_code(FIRST_CELL))
        run_plain()  # warm-up for both: the first run reads the file cold
        plain.samples.clear()
        plain_cpu.samples.clear()
        plain.ok = plain_cpu.ok = plain.attempts = plain_cpu.attempts = 0
        _check(sbx.run_code(WORKLOAD, timeout=300))
        handle = sbx._core._handle  # bench-only: the sandbox's cgroup counters
        for _ in range(args.data_runs):
            run_plain()
            boxed.attempts += 1
            boxed_cpu.attempts += 1
            before = handle.usage() if handle is not None else None
            execution = sbx.run_code(WORKLOAD, timeout=300)
            after = handle.usage() if handle is not None else None
            if execution.error is None:
                boxed.samples.append(execution.duration * 1000)
                boxed.ok += 1
                if before and after and before.cpu_seconds is not None and after.cpu_seconds:
                    boxed_cpu.samples.append((after.cpu_seconds - before.cpu_seconds) * 1000)
                    boxed_cpu.ok += 1
            else:
                boxed.note = f"{execution.error.name}: {execution.error.value}"[:200]
        plain_proc.stdin.close()
    for a, b in ((plain, boxed), (plain_cpu, boxed_cpu)):
        if a.samples and b.samples:
            ratio = statistics.median(b.samples) / statistics.median(a.samples)
            b.note = f"p50 ratio sandlot / plain = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)"
    return [plain, boxed, plain_cpu, boxed_cpu]


def bench_docker(args: argparse.Namespace) -> list[Row]:
    """sandlot's Docker backend, only when it is registered and its engine answers."""
    from sandlot.backends import BACKENDS

    cls = BACKENDS.get("docker")
    if cls is None or not cls.probe().available:
        return []
    metric = "create -> first result (numpy+pandas+matplotlib imported)"
    row = Row(metric, "sandlot docker backend, cold", "ms")

    def cold() -> float:
        with Sandbox(backend="docker") as sbx:
            _check(sbx.run_code(FIRST_CELL))
            return time.perf_counter()

    for _ in range(args.cold_runs):
        _timed(row, cold)
    return [row]


# --- machine and report --------------------------------------------------------------------
def machine() -> dict[str, Any]:
    def first(path: str, prefix: str) -> str:
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
        return "?"

    bwrap = shutil.which("bwrap")
    version = "?"
    if bwrap:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout
    fs = subprocess.run(
        ["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "host": socket.gethostname(),
        "cpu": first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "ram": first("/proc/meminfo", "MemTotal"),
        "loadavg_start": os.getloadavg(),
        "bwrap": version.strip(),
        "cgroup": "v2" if fs == "cgroup2fs" else "v1 (or hybrid)",
        "python_host": platform.python_version(),
        "sandlot": getattr(sandlot, "__version__", "?"),
        "uid": os.getuid(),
    }


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms" and value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}"


def render(rows: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"# sandlot bench, {info['date']}",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, kernel {info['kernel']}, "
        f"RAM {info['ram']}, {info['bwrap']}, cgroup {info['cgroup']}, "
        f"running as uid {info['uid']}.",
        f"Load average at start: {' '.join(f'{x:.2f}' for x in info['loadavg_start'])}; "
        f"at end: {' '.join(f'{x:.2f}' for x in info['loadavg_end'])}. "
        "Numbers from a shared, loaded machine are noisy; compare rows within this run.",
        f"Command: `bench/startup.py {' '.join(sys.argv[1:])}` "
        f"(runs {args.runs}, cold runs {args.cold_runs}, {info['seconds']:.0f} s in all).",
        "",
        "| metric | variant | n | p50 | p95 | p99 | unit | success | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        success = "-" if r["success"] is None else f"{r['success'] * 100:.0f}%"
        lines.append(
            f"| {r['metric']} | {r['variant']} | {r['n']} | {_fmt(r['p50'], r['unit'])} | "
            f"{_fmt(r['p95'], r['unit'])} | {_fmt(r['p99'], r['unit'])} | {r['unit']} | "
            f"{success} | {r['note']} |"
        )
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "How to read this:",
    "",
    "* *create -> first result*: wall time from `Sandbox()` (or `subprocess.run` for the",
    "  baselines, process exit included) to the result of a cell that imports numpy, pandas",
    "  and pyplot and evaluates `1 + 1` (sandlot's teardown after the result is not timed).",
    "  Baselines and sandlot cold are interleaved run by run. A pool run",
    "  starts once the pool holds a ready sandbox (that wait is not timed); how fast the",
    "  pool refills shows in the throughput rows.",
    "* *idle memory*: PSS summed over bwrap and every process under it, read from",
    "  `/proc/PID/smaps_rollup` with that many sandboxes alive (shared library pages are",
    "  split between them, so the number falls as more are alive).",
    "* *sustained throughput*: create + run `1+1` + kill in a loop, by one caller or by one",
    "  caller per core. With a pool it is bounded by the refill (a fork of the zygote, or",
    "  a cold start plus the data-stack import with `--pool-backend bwrap`).",
    "* *zygote*: each sandbox is forked from the template's zygote (data stack imported",
    "  once) into fresh mount/pid/net/ipc/uts namespaces and its own cgroup, with every",
    "  capability dropped and the seccomp filter installed. Its PSS counts the sandbox's",
    "  own processes; the many-sandboxes row adds each one's share of the zygote.",
    "* *data workload*: the same code timed inside one process (plain) and per cell",
    "  (sandlot zygote sandbox without a CPU quota, like plain python; SDK duration),",
    "  alternating run by run after a warm-up run of each. CPU time from",
    "  `time.process_time()` (plain) and the",
    "  sandbox cgroup's CPU counter (sandlot). Wall time on a busy host mostly measures the",
    "  scheduler: every sandbox cgroup sits under one parent cgroup, which on cgroup v1",
    "  competes with other host processes with the weight of a single process.",
]


@contextlib.contextmanager
def _pool(args: argparse.Namespace) -> Iterator[Any]:
    pool = None if args.no_pool else _make_pool(args)
    try:
        yield pool
    finally:
        if pool is not None:
            pool.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of the cheap rows")
    parser.add_argument(
        "--cold-runs",
        type=int,
        default=20,
        help="runs of the cold-start rows, which take seconds each (the pool row gets --runs)",
    )
    parser.add_argument("--alive", type=int, default=10, help="sandboxes alive for PSS")
    parser.add_argument("--throughput-n", type=int, default=30, help="sandboxes per loop")
    parser.add_argument("--data-runs", type=int, default=5, help="data workload repetitions")
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--pool-backend", default="zygote", help="what the pool refills from")
    parser.add_argument("--many", type=int, default=200, help="zygote sandboxes alive at once")
    parser.add_argument("--no-pool", action="store_true", help="skip the pool rows")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.cold_runs = min(args.runs, args.cold_runs)

    info = machine()
    started = time.perf_counter()
    info["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    python = str(ensure_template("python-data").python)
    rows: list[Row] = []
    with _pool(args) as pool, tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp:
        steps: list[tuple[str, Callable[[], list[Row]]]] = [
            ("first result", lambda: bench_first_result(args, python, pool)),
            ("round trip", lambda: bench_round_trip(args)),
            ("memory", lambda: bench_memory(args, python, pool)),
            ("throughput", lambda: bench_throughput(args, pool)),
            ("data workload", lambda: bench_data(args, python, pool, Path(tmp))),
            ("many", lambda: bench_many(args)),
            ("docker", lambda: bench_docker(args)),
        ]
        for name, step in steps:
            _progress(f"{name} (load {os.getloadavg()[0]:.1f})")
            rows.extend(step())
    info["seconds"] = time.perf_counter() - started
    info["loadavg_end"] = os.getloadavg()
    summaries = [row.summary() for row in rows]
    text = render(summaries, info, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-{info['host']}"
    stem.with_suffix(".md").write_text(text)
    raw = {"machine": info, "rows": summaries, "samples": [asdict(r) for r in rows]}
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(f"written: {stem}.md, {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
