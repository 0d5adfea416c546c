"""The cell WebSocket through a front door to a real node server, without Ray: the
node is ``create_app`` on a :class:`ClusterStore` (as a cluster node runs it), the
front door sits in front of it with a static directory, both on loopback and one
SQLite file. What needs a real sandbox behind the relay and not a real cluster."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="the server extra is not installed")

import httpx
import uvicorn

from sandlot import Sandbox
from sandlot._remote import CellSocket
from sandlot.server import (
    ClusterStore,
    NodeRef,
    ServerSettings,
    create_front_door,
)

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]


@dataclass
class Cluster:
    door: str
    node: str
    key: str
    database: str


def _serve(app: Any, servers: list[tuple[uvicorn.Server, threading.Thread]]) -> str:
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    servers.append((server, thread))
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "a server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


NODE = """
import socket, sys, uvicorn
from pathlib import Path
from sandlot.server import ClusterStore, NodeRef, ServerSettings, create_app
database, state, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
ref = NodeRef("node-a", "127.0.0.1", f"http://127.0.0.1:{port}", 8)
settings = ServerSettings(state_dir=state, database_url=database, pool_size=0)
app = create_app(settings, store=ClusterStore(database, node=ref))
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
sock.bind(("127.0.0.1", port))
sock.listen(64)
uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")).run(sockets=[sock])
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A node server (its own process, as a cluster node's is) and a front door."""
    tmp = tmp_path_factory.mktemp("door-cells")
    database = f"sqlite:///{tmp / 'cluster.db'}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ref = NodeRef("node-a", "127.0.0.1", f"http://127.0.0.1:{port}", 8)
    store = ClusterStore(database, node=ref)
    key = store.create_key("t")
    store.close()
    (tmp / "node").mkdir()
    log = (tmp / "node.log").open("wb")
    node = subprocess.Popen(
        [sys.executable, "-c", NODE, database, str(tmp / "node"), str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{ref.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert node.poll() is None and time.monotonic() < deadline, (
                tmp / "node.log"
            ).read_text()[-3000:]
            time.sleep(0.1)

        class OneNode:
            def nodes(self) -> list[NodeRef]:
                return [ref]

            def refresh(self) -> set[str]:
                return set()

            def confirm_lost(self, node_id: str) -> bool:
                return False

            def draining(self) -> set[str]:
                return set()

        door_settings = ServerSettings(state_dir=tmp / "door", database_url=database)
        door = _serve(create_front_door(door_settings, OneNode(), refresh=60), servers)
        yield Cluster(door, ref.url, key, database)
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=60)
        node.terminate()
        node.wait(timeout=60)
        log.close()


def _last_cell(cluster: Cluster, sandbox_id: str) -> dict[str, Any]:
    """The sandbox's latest cell in the audit trail once it is no longer running."""
    store = ClusterStore(cluster.database)
    try:
        deadline = time.monotonic() + 60
        while True:
            rows = list(store.query_executions(sandbox_id=sandbox_id))
            if rows and rows[-1]["outcome"] != "running":
                return rows[-1]
            assert time.monotonic() < deadline, rows[-1:]
            time.sleep(0.1)
    finally:
        store.close()


def test_the_sdk_s_cells_go_over_the_relayed_websocket(cluster: Cluster) -> None:
    with Sandbox(api_url=cluster.door, api_key=cluster.key) as sbx:
        sbx.run_code("x = 1")  # the first cell: over HTTP
        opened = None
        for n in range(2, 5):
            assert sbx.run_code("x += 1; x").text == str(n)
            sock = sbx._core._socket  # type: ignore[attr-defined]
            assert sock is not None and not sock.closed
            assert opened is None or sock is opened
            opened = sock
        store = ClusterStore(cluster.database)
        try:
            rows = list(store.query_executions(sandbox_id=sbx.sandbox_id))
        finally:
            store.close()
        assert [r["outcome"] for r in rows] == ["ok"] * 4


@pytest.mark.parametrize("how", ["close-frame", "connection-dropped"])
def test_a_client_that_leaves_mid_cell_interrupts_it_on_the_node(
    cluster: Cluster, how: str
) -> None:
    with Sandbox(api_url=cluster.door, api_key=cluster.key) as sbx:
        sbx.run_code("1")
        with contextlib.closing(
            CellSocket.connect(cluster.door, cluster.key, sbx.sandbox_id)
        ) as sock:
            stream = sock.cell(
                {"code": "import time\nprint('started', flush=True)\ntime.sleep(600)"}, 60
            )
            assert next(stream)["text"] == "started\n"
            if how == "close-frame":
                sock.close()
            else:
                sock._sock.close()
        row = _last_cell(cluster, sbx.sandbox_id)
        assert row["outcome"] == "killed" and row["status"] == "interrupted", row
        assert sbx.run_code("'free'").text == "'free'"


def test_a_refusal_is_the_same_whether_or_not_the_id_exists(cluster: Cluster) -> None:
    """The socket's refusal is one bare 403 for all; the HTTP answers the SDK then gets
    are byte for byte the node's (another tenant's sandbox, a wrong key), also where
    the front door answers itself because no node holds the id."""
    from sandlot._remote import NoCellSocket

    store = ClusterStore(cluster.database)
    try:
        other = store.create_key("other")
    finally:
        store.close()
    with Sandbox(api_url=cluster.door, api_key=other) as theirs:
        refusals = set()
        for key, sandbox_id in (
            (cluster.key, theirs.sandbox_id),
            ("sk_wrong", theirs.sandbox_id),
            (cluster.key, "sbx-never-was"),
            ("sk_wrong", "sbx-never-was"),
        ):
            with pytest.raises(NoCellSocket) as refused:
                CellSocket.connect(cluster.door, key, sandbox_id).close()
            refusals.add(str(refused.value))
        assert len(refusals) == 1, refusals

        def answer(url: str, key: str, sandbox_id: str) -> tuple[int, bytes, str | None, str]:
            got = httpx.post(
                f"{url}/v1/sandboxes/{sandbox_id}/execute",
                json={"code": "1"},
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )
            return (
                got.status_code,
                got.content.replace(sandbox_id.encode(), b"ID"),
                got.headers.get("www-authenticate"),
                got.headers["content-type"],
            )

        for key in (cluster.key, "sk_wrong"):
            at_node = answer(cluster.node, key, theirs.sandbox_id)
            assert at_node[0] == (404 if key == cluster.key else 401), at_node
            assert answer(cluster.door, key, theirs.sandbox_id) == at_node
            assert answer(cluster.door, key, "sbx-never-was") == at_node
