"""The front door's relay alone: per-cell routing overhead with no Ray and no PostgreSQL.

One node server (``create_app`` on a :class:`ClusterStore`, as a cluster node runs it)
and two front doors in front of it (a static directory of that one node), each its own
process on loopback, one SQLite file for all: the front door from this tree and one
from ``--baseline`` (another tree's ``src``, e.g. ``git archive 4a273a8 src``). Calls
are interleaved round-robin (door, node, baseline door) on one sandbox so the three
share the host's noise; overhead is ``door - node`` per call pair. What
``bench/ray_serve.py`` measures too, without Ray's processes competing for the cores.

With ``--sdk``, the calls are the remote SDK's ``run_code("1 + 1")`` instead (one
sandbox per path, on the same node): its cells go over the sandbox's cell WebSocket
where the path relays it, else over HTTP.

Run::

    .venv/bin/python bench/door_relay.py --baseline /tmp/base/src        # ~30 s
    .venv/bin/python bench/door_relay.py --baseline /tmp/base/src --sdk
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WAIT = 60.0


def _serve(role: str, database: str, state: Path, port: int, node_port: int) -> None:
    """The body of a node or door process."""
    import uvicorn

    from sandlot.server import (
        ClusterStore,
        NodeRef,
        ServerSettings,
        create_app,
        create_front_door,
    )

    settings = ServerSettings(state_dir=state, database_url=database, pool_size=0)
    node = NodeRef("node-a", "127.0.0.1", f"http://127.0.0.1:{node_port}", 16)
    if role == "node":
        app = create_app(settings, store=ClusterStore(database, node=node))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as NodeService
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=90)
        uvicorn.Server(config).run(sockets=[sock])
        return

    class OneNode:
        def nodes(self) -> list[NodeRef]:
            return [node]

        def refresh(self) -> set[str]:
            return set()

        def confirm_lost(self, node_id: str) -> bool:
            return False

        def draining(self) -> set[str]:
            return set()

    logging.getLogger("httpx").setLevel(logging.WARNING)
    door = create_front_door(settings, OneNode())  # type: ignore[arg-type]
    uvicorn.run(
        door,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        lifespan="on",
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _row(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p90 = ms[int(len(ms) * 0.9) - 1]
    return (
        f"| {name} | {len(ms)} | {statistics.median(ms):.2f} | {p90:.2f} "
        f"| {statistics.mean(ms):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=500)
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sdk", action="store_true", help="time the remote SDK's run_code")
    parser.add_argument("--serve", nargs=5, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.serve:
        role, database, state, port, node_port = opts.serve
        _serve(role, database, Path(state), int(port), int(node_port))
        return

    from sandlot.server import Store, TenantQuotas

    src = str(Path(__file__).resolve().parents[1] / "src")
    tmp = Path(tempfile.mkdtemp(prefix="door-relay-"))
    database = f"sqlite:///{tmp / 'cluster.db'}"
    store = Store(database)
    key = store.create_key("bench", TenantQuotas(1000, 100000, 10**8))
    store.close()
    node_port = _port()
    processes: list[subprocess.Popen[bytes]] = []

    def start(role: str, source: str, name: str, port: int) -> tuple[int, str]:
        (tmp / name).mkdir()
        argv = [sys.executable, __file__, "--baseline", "-", "--serve", role, database]
        process = subprocess.Popen(
            [*argv, str(tmp / name), str(port), str(node_port)],
            env={**os.environ, "PYTHONPATH": source},
            stdout=(tmp / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return process.pid, url
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / f"{name}.log").read_text()[-3000:])
            time.sleep(0.1)

    try:
        _, node = start("node", src, "node", node_port)
        door_pid, door = start("door", src, "door", _port())
        base_pid, base = start("door", str(opts.baseline.resolve()), "base", _port())
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            made = client.post(f"{door}/v1/sandboxes", json={"timeout": 600})
            assert made.status_code == 201, made.text
            sandbox = made.json()["sandbox_id"]

            def cell(url: str) -> float:
                started = time.perf_counter()
                answer = client.post(
                    f"{url}/v1/sandboxes/{sandbox}/execute", json={"code": "1 + 1"}
                )
                elapsed = time.perf_counter() - started
                assert answer.status_code == 200 and b"end_of_execution" in answer.content
                return elapsed

            if opts.sdk:
                import sandlot

                boxes = {
                    url: sandlot.Sandbox(api_url=url, api_key=key, timeout=600)
                    for url in (door, node, base)
                }

                def cell(url: str) -> float:  # the SDK's cell instead
                    started = time.perf_counter()
                    execution = boxes[url].run_code("1 + 1")
                    elapsed = time.perf_counter() - started
                    assert execution.text == "2", execution.error
                    return elapsed

            for url in (door, node, base):
                for _ in range(30):
                    cell(url)
            via_door: list[float] = []
            at_node: list[float] = []
            via_base: list[float] = []
            cpu = _cpu(door_pid), _cpu(base_pid)
            for _ in range(opts.cells):
                via_door.append(cell(door))
                at_node.append(cell(node))
                via_base.append(cell(base))
            door_cpu = (_cpu(door_pid) - cpu[0]) / opts.cells * 1000
            base_cpu = (_cpu(base_pid) - cpu[1]) / opts.cells * 1000
            client.delete(f"{door}/v1/sandboxes/{sandbox}")
            if opts.sdk:
                sockets = {url: box._core._socket is not None for url, box in boxes.items()}  # type: ignore[attr-defined]
                for box in boxes.values():
                    box.kill()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)

    load = os.getloadavg()
    names = {"door": door, "node": node, "baseline door": base}
    lines = [
        f"# The front door's relay alone ({time.strftime('%Y-%m-%d')})",
        "",
        f"Host: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (other work shares it). One node server, two front doors, SQLite; "
        "no Ray. Cell `1 + 1`, "
        + (
            "the remote SDK's `run_code` (on the cell WebSocket: "
            + ", ".join(f"{name} {sockets[url]}" for name, url in names.items())
            + ")."
            if opts.sdk
            else "`POST /v1/sandboxes/{id}/execute`, whole answer read."
        ),
        "",
        "| path | cells | p50 ms | p90 ms | mean ms |",
        "|---|---|---|---|---|",
        _row("through the front door", via_door),
        _row("at the node's own server", at_node),
        _row(f"through the front door from {opts.baseline}", via_base),
        _row(
            "overhead (door - node, same call pairs)",
            [d - n for d, n in zip(via_door, at_node, strict=True)],
        ),
        _row(
            f"overhead of the door from {opts.baseline}",
            [b - n for b, n in zip(via_base, at_node, strict=True)],
        ),
        "",
        f"Front door CPU per routed cell: {door_cpu:.2f} ms (from {opts.baseline}: "
        f"{base_cpu:.2f} ms).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if opts.out is not None:
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
