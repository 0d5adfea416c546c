"""A real multi-node Ray cluster on loopback addresses, for the Ray tests and bench.

Each node is its own ``ray start --block`` process (head on 127.0.0.2, the others on
127.0.0.3, .4, ...), each with its own temp dir, started in a new session so it can be
stopped alone: ``stop()`` kills that node's process group (the ``ray start`` process,
its raylet, and the workers and sandboxes under it) by its id, the way a machine that
loses power takes its node down. Nothing here uses ``ray stop``, which would stop every
Ray process on the host, other people's included.

The dashboard and usage stats are off, and the head's health checks are tightened so
the cluster sees a dead node in about two seconds instead of half a minute.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
LOCK = Path(tempfile.gettempdir()) / "sandlot-ray-test-cluster.lock"
"""Held while a LocalRayCluster is up: clusters on this host run one after another."""
START_TIMEOUT = 120.0
"""Seconds a node may take to register (2 shared cores, several engineers)."""

ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # A node that stops answering is declared dead after ~2 s (default: ~30 s).
    "RAY_health_check_initial_delay_ms": "500",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    # Workers import sandlot from this checkout.
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p
    ),
}


class RayNode:
    """One ``ray start --block`` process and what it logs."""

    def __init__(self, ip: str, temp_dir: Path, args: list[str]) -> None:
        self.ip = ip
        self.temp_dir = temp_dir
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.log = (temp_dir / "ray-start.log").open("wb")
        self.process = subprocess.Popen(
            [
                RAY,
                "start",
                "--block",
                "--node-ip-address",
                ip,
                "--temp-dir",
                str(temp_dir),
                "--disable-usage-stats",
                "--num-gpus",
                "0",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
            start_new_session=True,
        )

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Take the node down at once: its whole process group, by the group's id."""
        if self.process.poll() is None or _group_alive(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.log.close()

    def tail(self) -> str:
        try:
            return (self.temp_dir / "ray-start.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class LocalRayCluster:
    """A head on 127.0.0.2 and nodes added on 127.0.0.3, .4, ... (``add_node``)."""

    def __init__(self, base: Path, *, cpus: int = 2) -> None:
        # One cluster at a time on this host (its fixed addresses and ports), even when
        # test modules run in parallel processes (pytest-xdist): wait for the lock.
        self._lock = LOCK.open("a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        # Ray puts its Unix sockets under each node's temp dir (session_<date>_<pid>/
        # sockets/...), and a socket's path must fit in 107 bytes: pytest's temp dirs
        # (deeper still under xdist) do not leave room. The nodes' dirs are short ones
        # in /tmp, linked from ``base`` for the logs.
        self._short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        base.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            (base / "nodes").symlink_to(self._short, target_is_directory=True)
        self.base = self._short
        self.cpus = cpus
        self.nodes: list[RayNode] = []
        self.node_ids: dict[str, str] = {}
        """``{ip: Ray node ID}`` of the nodes ``wait_for_nodes`` has seen join."""
        self._next_ip = 3
        self.head = RayNode(
            "127.0.0.2",
            self.base / "head",
            ["--head", "--port", "0", "--include-dashboard=false", "--num-cpus", str(cpus)],
        )
        self.nodes.append(self.head)
        self.address = self._read_address()

    def _read_address(self) -> str:
        path = self.head.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            if self.head.process.poll() is not None:
                break
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"the Ray head did not come up:\n{self.head.tail()}")

    def add_node(self) -> RayNode:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        node = RayNode(
            ip,
            self.base / ip,
            ["--address", self.address, "--num-cpus", str(self.cpus)],
        )
        self.nodes.append(node)
        return node

    def wait_for_nodes(self, ips: set[str]) -> dict[str, str]:
        """Wait until a node on each of ``ips`` is alive; ``{ip: Ray node ID}``."""
        import ray

        deadline = time.monotonic() + START_TIMEOUT
        while True:
            alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if ips <= set(alive):
                joined = {ip: alive[ip] for ip in ips}
                self.node_ids.update(joined)
                return joined
            dead = [n for n in self.nodes if n.ip in ips and n.process.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {n.ip}\n{n.tail()}" for n in self.nodes)
                raise RuntimeError(f"nodes {sorted(ips - set(alive))} did not join:\n{logs}")
            time.sleep(0.2)

    def wait_dead(self, node_id: str) -> None:
        """Wait until the cluster has declared ``node_id`` dead."""
        import ray

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Ray still lists node {node_id} alive")

    def close(self) -> None:
        # Killed, not stopped gracefully: a throwaway cluster has nothing to save, and a
        # graceful stop spends ~10 s per node draining.
        try:
            for node in reversed(self.nodes):
                node.stop()
        finally:
            if not self._lock.closed:  # close() may run twice (a failed start)
                shutil.rmtree(self._short, ignore_errors=True)
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                self._lock.close()
