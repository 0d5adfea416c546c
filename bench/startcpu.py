"""CPU per default ``Sandbox()`` start: create -> first ``1 + 1`` result -> kill.

Sums the CPU of this process (``os.times()``) and of every process it started (the
zygote and the sandboxes it forks, which end up in the zygote's reaped-children
counters once killed) from ``/proc/<pid>/stat``, before and after ``--n`` sequential
starts, and prints CPU ms per start with the create -> first result p50. With
``--perf``, the zygote's side is counted by ``perf stat -e task-clock`` attached to
it (nanoseconds, children included) rather than in clock ticks. Uses the
public API only, so an older sandlot is measured the same way (``PYTHONPATH``).
The first cell also reads, from inside the sandbox, the CPU (schedstat) and minor
faults of its pid 1 (the supervisor) and of its kernel so far: medians are printed::

    .venv/bin/python bench/startcpu.py --n 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time

from sandlot import Sandbox

TICK = os.sysconf("SC_CLK_TCK")
PROBE = """
def faults(pid):
    return open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()[7]
def ran(pid):
    return open("/proc/%s/schedstat" % pid).read().split()[0]
import os
print(faults(1), faults(os.getpid()), ran(1), ran(os.getpid()))
"""
PROBED = (
    ("pid1_faults", 1),
    ("kernel_faults", 1),
    ("pid1_cpu_ms", 1e6),
    ("kernel_cpu_ms", 1e6),
)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _tree_cpu() -> float:
    """Seconds of CPU: the descendants' own and reaped children's, and this process's."""
    total = 0.0
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK
    times = os.times()
    return total + times.user + times.system


def _attach_perf() -> subprocess.Popen[str]:
    zygotes = [p for p in _descendants(os.getpid()) if b" zygote --fd " in _cmdline(p)]
    perf = subprocess.Popen(
        ["perf", "stat", "-e", "task-clock", "-p", str(zygotes[-1])],
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1)  # attached
    return perf


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ")
    except OSError:
        return b""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--perf", action="store_true")
    args = parser.parse_args()
    for _ in range(3):  # the zygote starts after the first sandbox
        Sandbox(timeout=60).kill()
        time.sleep(args.settle / 3)
    Sandbox(timeout=60).kill()
    time.sleep(0.5)
    perf = _attach_perf() if args.perf else None
    before = _tree_cpu()
    host_before = time.process_time()
    latencies: list[float] = []
    probes: list[list[int]] = []
    for _ in range(args.n):
        started = time.perf_counter()
        sbx = Sandbox(timeout=60)
        execution = sbx.run_code(PROBE)
        latencies.append((time.perf_counter() - started) * 1000)
        if execution.error is not None or len(execution.logs.stdout) != 1:
            raise RuntimeError(f"the probe failed: {execution.error!r}")
        probes.append([int(x) for x in execution.logs.stdout[0].split()])
        sbx.kill()
    time.sleep(0.5)  # the killed sandboxes are reaped into the zygote's counters
    after = _tree_cpu()
    host = (time.process_time() - host_before) * 1000 / args.n
    extra = {}
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        _, err = perf.communicate()
        zygote = float(err.split("msec task-clock")[0].split()[-1].replace(",", "")) / args.n
        extra = {"perf_zygote_ms": round(zygote, 2), "perf_total_ms": round(zygote + host, 2)}
    print(
        json.dumps(
            {
                "cpu_ms_per_start": round((after - before) * 1000 / args.n, 2),
                "host_ms": round(host, 2),
                **extra,
                "p50_ms": round(statistics.median(latencies), 2),
                **{
                    name: round(statistics.median(p[i] for p in probes) / scale, 2)
                    for i, (name, scale) in enumerate(PROBED)
                },
                "load": os.getloadavg()[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
