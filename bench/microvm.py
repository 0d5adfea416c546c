"""The microvm backend beside bwrap, in one run: boot, first result, cell round trip.

Rows (milliseconds, p50/p95/p99 over the runs; runs of different rows interleaved, so a
change of load hits all of them alike):

* ``create -> ready``: ``Sandbox()`` returning (the VM booted, runner ready).
* ``create -> first result``: ``Sandbox()`` plus a cell importing numpy, pandas and
  pyplot and evaluating ``1 + 1`` (as bench/startup.py's row of that name).
* ``per-cell round trip``: ``run_code("1+1")`` in a sandbox that is up (after warm-up).

* ``restore -> first result`` (``--restore N``): an experiment towards the warm pool
  the backend does not have yet. One VM boots with the data stack preloaded, is saved
  with QEMU's migration to a state file, and is restored N times (``-incoming``), each
  with a new channel; timed from starting QEMU to the result of ``1 + 1``. Restored VMs
  share the saved VM's memory, so its identity too (random state, the configuration):
  this measures the mechanism, not a pool ready to hand out.

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
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _rows import summary

from sandlot import Sandbox
from sandlot.backends._channel import ChannelHandle
from sandlot.backends._runner_config import runner_config
from sandlot.backends.microvm import (
    MicroVMBackend,
    _await_guest,
    accelerator,
    qemu_path,
)
from sandlot.backends.microvm._qemu import (
    default_machine,
    find_artifacts,
    qemu_argv,
    sandbox_initrd,
)
from sandlot.policy import SandboxSpec
from sandlot.protocol import encode

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


def _qmp(path: str, *commands: dict[str, Any]) -> list[dict[str, Any]]:
    """Send QMP commands (after the handshake); the answers (events skipped)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        reader = sock.makefile("rb")
        reader.readline()  # greeting
        answers = []
        for command in ({"execute": "qmp_capabilities"}, *commands):
            sock.sendall(json.dumps(command).encode() + b"\n")
            while True:
                reply = json.loads(reader.readline())
                if "event" not in reply:
                    break
            answers.append(reply)
        return answers[1:]


def _vm(argv: list[str], extra: list[str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    host, guest = socket.socketpair()
    fd_index = next(i for i, a in enumerate(argv) if a.startswith("socket,id=channel,fd="))
    argv = [*argv]
    argv[fd_index] = f"socket,id=channel,fd={guest.fileno()}"
    process = subprocess.Popen(
        [*argv, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(guest.fileno(),),
    )
    guest.close()
    return process, host


def _first_result(handle: ChannelHandle, code: str) -> str:
    message = {"type": "execute", "code": code, "context": "default", "envs": {}, "timeout": 60}
    stream = handle.request(message)
    text = ""
    while (event := stream.next(timeout=120)) is not None:
        if event["type"] == "result":
            text = str(event.get("data", {}).get("text/plain", ""))
        if event["type"] in ("exit", "reply"):
            return text
    raise RuntimeError("no answer from the restored VM")


def restore_rows(runs: int) -> tuple[list[float], float]:
    """``(restore -> first result ms, state file MiB)``."""
    qemu = qemu_path()
    assert qemu is not None
    artifacts = find_artifacts()
    accel, _ = accelerator(qemu, artifacts)
    spec = SandboxSpec(preload=("numpy", "pandas", "matplotlib.pyplot"))
    argv = qemu_argv(
        qemu, spec, kernel=artifacts.kernel, initrd=sandbox_initrd(artifacts),
        image=artifacts.image(spec.template), channel_fd=-1, accel=accel,
        machine=default_machine(accel),
    )  # fmt: skip
    monitor = argv.index("-monitor")
    del argv[monitor : monitor + 2]  # QMP instead, to save the VM
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp:
        qmp = os.path.join(tmp, "qmp.sock")
        state = os.path.join(tmp, "state")
        process, host = _vm(argv, ["-qmp", f"unix:{qmp},server=on,wait=off"])
        _await_guest(host, 300)
        config = runner_config(spec, channel_fd=0, cgroup_limits=False, envs={})
        host.sendall(encode({"type": "configure", "id": "configure", "config": config}))
        handle = ChannelHandle(host, process)
        handle.wait_ready(300)  # preload imported
        # Saved running (QEMU pauses it at the end): a restored VM then starts running;
        # one saved paused would be restored paused.
        _qmp(qmp, {"execute": "migrate", "arguments": {"uri": f"exec:cat > {state}"}})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = _qmp(qmp, {"execute": "query-migrate"})[0]["return"].get("status")
            if status in ("completed", "failed"):
                break
            time.sleep(0.2)
        handle.kill()
        if status != "completed":
            raise RuntimeError(f"migration {status}")
        size = os.path.getsize(state) / 2**20
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            process, host = _vm(argv, ["-incoming", f"exec:cat {state}"])
            handle = ChannelHandle(host, process)
            try:
                answer = _first_result(handle, "1 + 1")
                times.append((time.perf_counter() - t0) * 1000)
            finally:
                handle.kill()  # also when it did not answer: no VM outlives the bench
            if answer != "2":
                raise RuntimeError(f"restored VM answered {answer!r}")
    return times, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="cold starts per variant")
    parser.add_argument("--cells", type=int, default=50, help="round trips per variant")
    parser.add_argument("--q35", action="store_true", help="also boot the guest on q35")
    parser.add_argument("--restore", type=int, default=0, help="snapshot restores (0: none)")
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
    notes = []
    if args.restore:
        times, size = restore_rows(args.restore)
        rows[("restore from a saved VM -> first result `1+1`", "microvm (experiment)")] = times
        notes.append(f"The saved VM state file was {size:.0f} MiB.")
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
    text = "\n".join([*lines, "", *notes]) + "\n"
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
