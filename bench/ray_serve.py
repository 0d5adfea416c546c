"""The cost of ``sandlot serve --ray``'s front door: per-cell routing and placement.

All in one run, on one machine, against one throwaway PostgreSQL:

* ``single``: an ordinary ``sandlot serve`` (one machine, no Ray);
* ``node``: the sandlot server a cluster node runs, called at its own address;
* ``door``: the same node's sandboxes through the front door (``sandlot serve --ray``),
  on a Ray cluster of a head (127.0.0.2) and one more node (127.0.0.3).

Per-cell routing overhead is ``door - node`` for the same sandbox (the request and its
streamed answer pass through one more process); the ``single`` row shows what a
single-machine server costs on the same host. Calls are interleaved round-robin so the
three share the host's noise. Placement latency is ``POST /v1/sandboxes`` (cold start,
no warm pool) through the door vs on the single server, then killed.

Run::

    .venv/bin/python bench/ray_serve.py                # ~3 minutes on 2 cores
    .venv/bin/python bench/ray_serve.py --cells 500 --out bench/results/ray-serve.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _postgres import postgres  # noqa: E402
from _ray_cluster import ENV, LocalRayCluster  # noqa: E402

WAIT = 120.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(
    args: list[str], state: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    log = (state / "serve.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandlot",
            "serve",
            "--port",
            str(port),
            "--state-dir",
            str(state),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((state / "serve.log").read_text()[-3000:])
        time.sleep(0.2)


def _cell(client: httpx.Client, base: str, sandbox_id: str) -> float:
    started = time.perf_counter()
    answer = client.post(f"{base}/v1/sandboxes/{sandbox_id}/execute", json={"code": "1 + 1"})
    elapsed = time.perf_counter() - started
    assert answer.status_code == 200 and b'"end_of_execution"' in answer.content, answer.text
    return elapsed


def _create(client: httpx.Client, base: str) -> tuple[float, str]:
    started = time.perf_counter()
    answer = client.post(f"{base}/v1/sandboxes", json={"timeout": 600})
    elapsed = time.perf_counter() - started
    assert answer.status_code == 201, answer.text
    return elapsed, str(answer.json()["sandbox_id"])


def _spy(opts: argparse.Namespace, pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid`` (without pausing it) until sent SIGINT."""
    return subprocess.Popen(
        [
            opts.py_spy,
            "record",
            "--nonblocking",
            "--format",
            "raw",
            "--rate",
            "500",
            "-p",
            str(pid),
            "-o",
            str(out.with_suffix(".txt")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p50 = statistics.median(ms)
    p90 = ms[int(len(ms) * 0.9) - 1]
    return f"| {name} | {len(ms)} | {p50:.2f} | {p90:.2f} | {statistics.mean(ms):.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a second front door from this source tree (a `src` directory, e.g. an "
        "older commit's `git archive ... src`), measured in the same run on the same nodes",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record the front door(s) with py-spy during the cells (flame graphs here)",
    )
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    opts = parser.parse_args()

    import ray
    from sandlot.server import Store, TenantQuotas

    with (
        postgres("sandlot", prefix="pg-bench-", settings="-c max_connections=300") as database,
        tempfile.TemporaryDirectory(prefix="ray-serve-") as tmp,
    ):
        base = Path(tmp)
        store = Store(database)
        key = store.create_key("bench", TenantQuotas(1000, 100000, 10**8))
        store.close()
        common = ["--database", database, "--pool-size", "0"]
        cluster = LocalRayCluster(base / "ray")
        processes: list[subprocess.Popen[bytes]] = []
        try:
            cluster.add_node()
            ray.init(address=cluster.address, _node_ip_address="127.0.0.2", log_to_driver=False)
            cluster.wait_for_nodes({"127.0.0.2", "127.0.0.3"})
            (base / "single").mkdir()
            (base / "door").mkdir()
            single_p, single = _serve(common, base / "single", {})
            processes.append(single_p)
            door_args = [
                *common,
                "--ray",
                cluster.address,
                "--ray-node-ip",
                "127.0.0.2",
                "--node-slots",
                "64",
            ]
            door_p, door = _serve(door_args, base / "door", ENV)
            processes.append(door_p)
            base_door: str | None = None
            if opts.baseline is not None:
                # The same node services (started by the first door, from this tree):
                # only the front door differs.
                (base / "base-door").mkdir()
                env = {**ENV, "PYTHONPATH": str(opts.baseline.resolve())}
                base_p, base_door = _serve(door_args, base / "base-door", env)
                processes.append(base_p)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(headers=headers, timeout=60) as client:
                # Cells: one sandbox through the door and at its node; one on the single server.
                _, door_sid = _create(client, door)
                _, single_sid = _create(client, single)
                store = Store(database)
                with store.engine.connect() as conn:
                    import sqlalchemy as sa

                    node_url = conn.execute(
                        sa.text("SELECT url FROM sandbox_nodes WHERE sandbox_id = :id"),
                        {"id": door_sid},
                    ).scalar_one()
                store.close()
                # Placement: creates through the door, at a node's own server (no
                # admission, no hop) and on the single server.
                door_creates, node_creates, single_creates = [], [], []
                made = []
                for _ in range(opts.creates):
                    for where, times in (
                        (door, door_creates),
                        (node_url, node_creates),
                        (single, single_creates),
                    ):
                        t, sid = _create(client, where)
                        times.append(t)
                        made.append((where, sid))
                for where, sid in made:
                    client.delete(f"{where}/v1/sandboxes/{sid}")
                targets = [(door, door_sid), (node_url, door_sid), (single, single_sid)]
                if base_door is not None:
                    targets.append((base_door, door_sid))
                for target, sid in targets:
                    for _ in range(20):  # warm the connections and the interpreter
                        _cell(client, target, sid)
                # The front door's own background work (membership checks), per second.
                cpu_before, wall_before = _cpu(door_p.pid), time.perf_counter()
                time.sleep(5)
                idle = (_cpu(door_p.pid) - cpu_before) / (time.perf_counter() - wall_before)
                via_door, at_node, on_single, via_base = [], [], [], []
                spies = []
                if opts.profile is not None:
                    opts.profile.mkdir(parents=True, exist_ok=True)
                    for name, process in (("door", door_p), ("base-door", processes[-1])):
                        if name == "base-door" and base_door is None:
                            continue
                        spies.append(_spy(opts, process.pid, opts.profile / name))
                cpu_before, wall_before = _cpu(door_p.pid), time.perf_counter()
                for _ in range(opts.cells):
                    via_door.append(_cell(client, door, door_sid))
                    at_node.append(_cell(client, node_url, door_sid))
                    on_single.append(_cell(client, single, single_sid))
                    if base_door is not None:
                        via_base.append(_cell(client, base_door, door_sid))
                door_cpu = _cpu(door_p.pid) - cpu_before
                door_wall = time.perf_counter() - wall_before
                for spy in spies:
                    spy.send_signal(2)
                    spy.wait(timeout=60)
                # The floor: a request the front door answers itself (its HTTP server only).
                cpu_before = _cpu(door_p.pid)
                for _ in range(opts.cells):
                    client.get(f"{door}/health")
                health_cpu = _cpu(door_p.pid) - cpu_before
        finally:
            for process in processes:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
            ray.shutdown()
            cluster.close()

    overhead = [d - n for d, n in zip(via_door, at_node, strict=True)]
    extra = []
    if via_base:
        extra = [
            _row(f"front door from {opts.baseline}", via_base),
            _row(
                f"its overhead (door from {opts.baseline} - node)",
                [d - n for d, n in zip(via_base, at_node, strict=True)],
            ),
        ]
    load = os.getloadavg()
    lines = [
        f"# sandlot serve --ray: routing and placement ({datetime.date.today()})",
        "",
        f"Host: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(other work shares it). Ray cluster of 2 nodes on loopback; one PostgreSQL for all.",
        "",
        "## Per cell (`POST /v1/sandboxes/{id}/execute`, `1 + 1`, whole NDJSON answer read)",
        "",
        "| path | cells | p50 ms | p90 ms | mean ms |",
        "|---|---|---|---|---|",
        _row("through the front door", via_door),
        _row("at the node's own server", at_node),
        _row("single-machine `sandlot serve`", on_single),
        _row("front door overhead (door - node, same cell pairs)", overhead),
        *extra,
        "",
        f"Front door process CPU: {door_cpu * 1000 / opts.cells:.2f} ms per cell routed "
        f"({door_cpu:.2f} s over {opts.cells} cells in {door_wall:.1f} s), of which its "
        f"background membership checks {idle * door_wall * 1000 / opts.cells:.2f} ms "
        f"({idle * 1000:.0f} ms CPU per second when idle); answering `GET /health` itself: "
        f"{health_cpu * 1000 / opts.cells:.2f} ms per request.",
        "",
        "## Placement (`POST /v1/sandboxes`, cold start, no warm pool)",
        "",
        "| path | creates | p50 ms | p90 ms | mean ms |",
        "|---|---|---|---|---|",
        _row("through the front door", door_creates),
        _row("at a node's own server (no admission, no hop)", node_creates),
        _row("single-machine `sandlot serve`", single_creates),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if opts.out is not None:
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
