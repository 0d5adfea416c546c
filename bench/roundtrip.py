"""The cell round trip, piece by piece: where the time of ``sbx.run_code("1+1")`` goes.

Every row is timed in one run, interleaved (each round measures every row in turn, so
a change of load hits all of them alike), after a warm-up; p50/p95/p99 in
milliseconds. From the floor up:

* ``eval``: ``eval("1+1")`` in this process (the work itself).
* ``thread hand-off``: one item to another thread and back (``threading.Condition``),
  what a reader thread waking a waiting caller costs.
* ``socketpair ping-pong``: a typical ``execute`` request to another process over a
  Unix socketpair and a typical ``result`` + ``exit`` reply back (the transport floor).
* ``protocol encode+decode``: the host encoding that request and decoding, checked,
  that reply (:mod:`sandlot.protocol`), plus the channel's cost accounting of it.
* ``kernel direct``: the runner's kernel process started on the host (no sandbox, no
  supervisor), a request written to its socket and its reply read back.
* ``usage()``: the cgroup usage the SDK reads before and after every cell.
* ``<backend> list_contexts``: a request the supervisor answers without the kernel.
* ``<backend> handle execute``: the backend handle's ``request`` and its event stream
  (host channel, supervisor, kernel; no SDK fold, no pre-check, no usage reads).
* ``<backend> run_code 1+1``: the whole SDK call; ``print`` and a small DataFrame too.

Then, unless ``--no-cpu``, where the CPU time of a cell goes, process by process: the
CPU each thread of this process and of every process under it (supervisor, kernel)
used per ``handle execute`` and per ``run_code``, from ``/proc/<pid>/task/*/schedstat``
(nanoseconds, so per cell even for short cells). On a busy machine this says more than
the wall-clock rows: each process's share is its own, whatever the others waited.

Run (defaults take about a minute)::

    PYTHONPATH=src .venv/bin/python bench/roundtrip.py
    PYTHONPATH=src .venv/bin/python bench/roundtrip.py --json new.json
    PYTHONPATH=../old/src .venv/bin/python bench/roundtrip.py --json old.json
    .venv/bin/python bench/roundtrip.py --show new.json --compare old.json

Numbers are for comparison within one run, or between runs on the same idle machine
(the script prints the load average). Nothing in the test suite asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import sandlot
from sandlot import Pool, Sandbox
from sandlot.backends._channel import frame_cost
from sandlot.protocol import HOST_REQUESTS, RUNNER_MESSAGES, decode, encode
from sandlot.runner import BOOTSTRAP

Sample = Callable[[], None]

REQUEST = {
    "type": "execute",
    "id": "0123456789abcdef-42",
    "code": "1+1",
    "context": "default",
    "envs": {},
    "timeout": 300.0,
}
REPLY = [
    {
        "type": "result",
        "id": "0123456789abcdef-42",
        "data": {"text/plain": "2"},
        "is_main_result": True,
    },
    {"type": "exit", "id": "0123456789abcdef-42", "status": "ok", "execution_count": 7},
]
REQUEST_LINE = encode(REQUEST)
REPLY_LINES = b"".join(encode(m) for m in REPLY)
DATAFRAME_CELL = "pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})"


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _stats(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return _pct(ordered, 50), _pct(ordered, 95), _pct(ordered, 99)


# --- the floors -----------------------------------------------------------------------
@contextmanager
def thread_handoff() -> Iterator[Sample]:
    """A worker thread answering each item put in front of it (Condition both ways)."""
    cond = threading.Condition()
    box: list[int] = []
    stop = False

    def serve() -> None:
        with cond:
            while not stop:
                cond.wait_for(lambda: stop or box == [1])
                if box == [1]:
                    box[0] = 2
                    cond.notify_all()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()

    def sample() -> None:
        with cond:
            box[:] = [1]
            cond.notify_all()
            cond.wait_for(lambda: box == [2])
            box.clear()

    try:
        yield sample
    finally:
        with cond:
            stop = True
            cond.notify_all()
        worker.join(5)


ECHO = """
import os, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
reply = bytes.fromhex(sys.argv[2])
need = int(sys.argv[3])
while True:
    got = b""
    while len(got) < need:
        chunk = sock.recv(65536)
        if not chunk:
            sys.exit(0)
        got += chunk
    sock.sendall(reply)
"""


@contextmanager
def socketpair_pingpong() -> Iterator[Sample]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ECHO,
            str(theirs.fileno()),
            REPLY_LINES.hex(),
            str(len(REQUEST_LINE)),
        ],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    need = len(REPLY_LINES)

    def sample() -> None:
        ours.sendall(REQUEST_LINE)
        got = 0
        while got < need:
            got += len(ours.recv(65536))

    try:
        yield sample
    finally:
        ours.close()
        proc.wait(5)


@contextmanager
def protocol_codec() -> Iterator[Sample]:
    lines = [encode(m) for m in REPLY]

    def sample() -> None:
        encode(REQUEST)
        for line in lines:
            frame_cost(line)
            decode(line, RUNNER_MESSAGES)

    yield sample


@contextmanager
def kernel_direct() -> Iterator[Sample]:
    """The runner's kernel as a plain host process: request in, events out."""
    lib = str(Path(sandlot.__file__).resolve().parent.parent)
    ours, theirs = socket.socketpair()
    workdir = tempfile.mkdtemp(prefix="sandlot-rtt-")
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", BOOTSTRAP, lib, "kernel", "--fd", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    reader = ours.makefile("rb")
    request = {"type": "execute", "id": "k", "code": "1+1", "envs": {}}
    line = encode(request)

    def sample() -> None:
        ours.sendall(line)
        while True:
            event = decode(reader.readline(), RUNNER_MESSAGES)
            if event["type"] == "exit":
                return

    try:
        yield sample
    finally:
        reader.close()
        ours.close()
        proc.wait(5)
        os.rmdir(workdir)


# --- through a sandbox ----------------------------------------------------------------
def _handle_execute(sbx: Sandbox) -> Sample:
    handle = sbx.handle
    assert handle is not None
    request = {k: v for k, v in REQUEST.items() if k != "id"}
    assert set(HOST_REQUESTS["execute"]) <= set(request)

    def sample() -> None:
        stream = handle.request(request)
        try:
            while True:
                event = stream.next(60)
                assert event is not None, "no answer within 60 s"
                if event["type"] == "exit":
                    return
        finally:
            stream.close()

    return sample


def _run_code(sbx: Sandbox, code: str, expect: str | None) -> Sample:
    def sample() -> None:
        execution = sbx.run_code(code)
        assert execution.error is None, execution.error
        if expect is not None:
            assert execution.text == expect, execution.text

    return sample


def _print_cell(sbx: Sandbox) -> Sample:
    def sample() -> None:
        execution = sbx.run_code("print('hello')")
        assert execution.logs.stdout == ["hello\n"], execution.logs

    return sample


def build_rows(stack: ExitStack, backends: list[str], pool: bool) -> dict[str, Sample]:
    rows: dict[str, Sample] = {"eval 1+1 (in-process floor)": lambda: eval("1+1")}

    rows["thread hand-off (Condition, both ways)"] = stack.enter_context(thread_handoff())
    rows["socketpair ping-pong (transport floor)"] = stack.enter_context(socketpair_pingpong())
    rows["protocol encode+decode (host side)"] = stack.enter_context(protocol_codec())
    rows["kernel direct (no sandbox, no supervisor)"] = stack.enter_context(kernel_direct())
    for backend in backends:
        sbx = stack.enter_context(Sandbox(backend=backend))
        handle = sbx.handle
        if backend == backends[0] and handle is not None:
            rows["usage() (cgroup read, twice a cell)"] = handle.usage
        rows[f"{backend}: list_contexts (no kernel)"] = sbx.list_code_contexts
        rows[f"{backend}: handle execute 1+1"] = _handle_execute(sbx)
        rows[f"{backend}: run_code 1+1"] = _run_code(sbx, "1+1", "2")
        rows[f"{backend}: run_code print"] = _print_cell(sbx)
    if pool:
        warm = stack.enter_context(Pool(size=1, backend=backends[0]))
        warm.warm()
        sbx = stack.enter_context(Sandbox(backend=backends[0], pool=warm))
        sbx.run_code("import pandas as pd")
        rows[f"pool ({backends[0]}): run_code 1+1"] = _run_code(sbx, "1+1", "2")
        rows[f"pool ({backends[0]}): run_code DataFrame"] = _run_code(sbx, DATAFRAME_CELL, None)
    return rows


# --- CPU per process ------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as handle:
                    stack.extend(int(child) for child in handle.read().split())
            except OSError:
                pass
    return found


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return "?"
    if pid == os.getpid():
        return "host (SDK, channel)"
    for role in (b"supervisor", b"kernel", b"zygote"):
        if role in argv:
            return role.decode()
    return os.path.basename(argv[0].decode(errors="replace")) or "?"


def _cpu_by_thread() -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (role, CPU nanoseconds so far) for this process and its tree."""
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for pid in _descendants(os.getpid()):
        role = _role(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                    seen[(pid, int(tid))] = (role, int(handle.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
    return seen


def cpu_per_cell(samples: dict[str, Sample], cells: int) -> str:
    """A table: microseconds of CPU per cell, by process role and thread, per sample."""
    lines = ["| path | thread | CPU us a cell |", "|---|---|---:|"]
    for name, sample in samples.items():
        for _ in range(50):
            sample()
        before = _cpu_by_thread()
        for _ in range(cells):
            sample()
        after = _cpu_by_thread()
        total = 0.0
        for key, (role, ns) in sorted(after.items()):
            if key not in before:
                continue
            used = (ns - before[key][1]) / cells / 1000
            total += used
            if used >= 1.0:
                lines.append(f"| {name} | {role} (tid {key[1]}) | {used:.1f} |")
        lines.append(f"| {name} | **all** | **{total:.1f}** |")
    return "\n".join(lines)


def measure(rows: dict[str, Sample], runs: int, warmup: int, rounds: int) -> dict[str, list[float]]:
    for sample in rows.values():
        for _ in range(warmup):
            sample()
    times: dict[str, list[float]] = {name: [] for name in rows}
    per_round = max(1, runs // rounds)
    clock = time.perf_counter
    for _ in range(rounds):
        for name, sample in rows.items():
            kept = times[name]
            for _ in range(per_round):
                started = clock()
                sample()
                kept.append((clock() - started) * 1000)
    return times


def table(times: dict[str, list[float]], before: dict[str, list[float]] | None) -> str:
    if before is None:
        lines = ["| path | p50 ms | p95 ms | p99 ms |", "|---|---:|---:|---:|"]
    else:
        lines = [
            "| path | before p50 | after p50 | before p95 | after p95 | before p99 | after p99 |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
    for name, values in times.items():
        p50, p95, p99 = _stats(values)
        if before is None:
            lines.append(f"| {name} | {p50:.3f} | {p95:.3f} | {p99:.3f} |")
            continue
        old = before.get(name)
        b50, b95, b99 = _stats(old) if old else (float("nan"),) * 3
        lines.append(
            f"| {name} | {b50:.3f} | {p50:.3f} | {b95:.3f} | {p95:.3f} | {b99:.3f} | {p99:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="samples per row")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured samples per row")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--backends", default="bwrap,zygote", help="comma-separated")
    parser.add_argument("--no-pool", action="store_true", help="skip the pool rows")
    parser.add_argument("--json", type=Path, help="write {row: [ms, ...]} here")
    parser.add_argument("--no-cpu", action="store_true", help="skip CPU time per process")
    parser.add_argument("--cpu-cells", type=int, default=2000, help="cells per CPU row")
    parser.add_argument("--show", type=Path, help="print a table from this JSON; no run")
    parser.add_argument("--compare", type=Path, help="JSON of an earlier run, shown beside")
    args = parser.parse_args()
    before: dict[str, list[float]] | None = None
    if args.compare is not None:
        before = json.loads(args.compare.read_text())
    if args.show is not None:
        print(table(json.loads(args.show.read_text()), before))
        return
    load = os.getloadavg()
    started = time.monotonic()
    with ExitStack() as stack:
        rows = build_rows(stack, [b for b in args.backends.split(",") if b], not args.no_pool)
        times = measure(rows, args.runs, args.warmup, args.rounds)
        first = next(b for b in args.backends.split(",") if b)
        cpu = None
        if not args.no_cpu:
            cpu = cpu_per_cell(
                {k: v for k, v in rows.items() if k.startswith(f"{first}: ") and "1+1" in k},
                args.cpu_cells,
            )
    print(
        f"sandlot {sandlot.__file__}\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        f" before, {os.getloadavg()[0]:.2f} after; {args.runs} runs a row; "
        f"{time.monotonic() - started:.0f} s\n"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(times))
    print(table(times, before))
    mean = statistics.fmean(times[next(n for n in times if n.endswith("run_code 1+1"))])
    print(f"\n(mean of the first run_code 1+1 row: {mean:.3f} ms)")
    if cpu is not None:
        print(f"\nCPU time per cell, by thread (load average now {os.getloadavg()[0]:.2f}):\n")
        print(cpu)


if __name__ == "__main__":
    main()
