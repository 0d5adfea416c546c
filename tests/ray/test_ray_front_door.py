"""``sandlot serve --ray``: the HTTP API, the remote SDK and the unmodified E2B client in
front of a real multi-node Ray cluster on loopback (one cluster for the module).

A head on 127.0.0.2 and nodes on .3 and .4 (tests/_ray_cluster.py), a throwaway
PostgreSQL shared by every node and the front door, and the front door itself as the
real CLI in a subprocess (``python -m sandlot serve --ray ADDRESS``). A node added
later (.5) receives new sandboxes, then is killed (its whole process group) to show
that it takes only its own sandboxes.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _postgres import postgres

pytestmark = [
    pytest.mark.requires_ray,
    pytest.mark.requires_bwrap,
    pytest.mark.requires_postgres,
    pytest.mark.requires_server,
    pytest.mark.slow,
]

BASE = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
WAIT = 120.0


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    with postgres(
        "sandlot", prefix="pg-ray-", settings="-c max_connections=300 -c fsync=off"
    ) as url:
        yield url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Door:
    """The cluster, its database and the front door (``sandlot serve --ray``)."""

    def __init__(self, cluster: Any, url: str, database: str, process: Any) -> None:
        self.cluster = cluster
        self.url = url
        self.database = database
        self.process = process
        from sandlot.server import Store, TenantQuotas

        store = Store(database)
        try:
            self.key = store.create_key("ray-door", TenantQuotas(200, 1000, 10**7))
            self.small_key = store.create_key("ray-small", TenantQuotas(3, 1000, 10**7))
        finally:
            store.close()
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )

    def nodes(self) -> dict[str, dict[str, Any]]:
        """``{node_id: entry}`` of ``GET /v1/cluster`` (as of the last membership check)."""
        answer = self.http.get("/v1/cluster")
        answer.raise_for_status()
        return {n["node_id"]: n for n in answer.json()["nodes"]}

    def wait_nodes(self, predicate: Any) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + WAIT
        while True:
            nodes = self.nodes()
            if predicate(nodes):
                return nodes
            assert time.monotonic() < deadline, nodes
            time.sleep(0.2)

    def node_of(self, sandbox_id: str, key: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        info = self.http.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)
        info.raise_for_status()
        node: dict[str, str] = info.json()["node"]
        return node

    def sandbox(self, key: str | None = None, **kwargs: Any) -> Any:
        import sandlot

        return sandlot.Sandbox(api_url=self.url, api_key=key or self.key, **kwargs)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[Door]:
    import ray
    from _ray_cluster import ENV, LocalRayCluster

    local = LocalRayCluster(tmp_path_factory.mktemp("ray"))
    process = None
    log = None
    try:
        local.add_node()
        local.add_node()
        ray.init(address=local.address, _node_ip_address="127.0.0.2", log_to_driver=False)
        local.wait_for_nodes(set(BASE))
        port = _free_port()
        state = tmp_path_factory.mktemp("door")
        log = (state / "door.log").open("wb")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sandlot",
                "serve",
                "--ray",
                local.address,
                "--ray-node-ip",
                "127.0.0.2",
                "--database",
                postgres_url,
                "--state-dir",
                str(state),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--pool-size",
                "0",
                "--node-slots",
                "30",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError((state / "door.log").read_text()[-4000:])
            time.sleep(0.2)
        door = Door(local, url, postgres_url, process)
        try:
            door.wait_nodes(lambda nodes: {n.get("ip") for n in nodes.values()} >= set(BASE))
            yield door
        finally:
            door.http.close()
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        if log is not None:
            log.close()
        ray.shutdown()
        local.close()


@pytest.fixture(scope="module")
def sixty(door: Door) -> Iterator[list[Any]]:
    """60 sandboxes made through the front door, each told its own number."""

    def make(i: int) -> Any:
        sbx = door.sandbox(metadata={"n": str(i)})
        execution = sbx.run_code(f"x = {i}")
        assert execution.error is None, (i, execution.error)
        return sbx

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        made = list(pool.map(make, range(60)))
    yield made
    for sbx in made:
        sbx.kill()


def test_sixty_sandboxes_spread_over_every_node_and_keep_their_state(
    door: Door, sixty: list[Any]
) -> None:
    where = [door.node_of(sbx.sandbox_id) for sbx in sixty]
    counts: dict[str, int] = {}
    for node in where:
        counts[node["ip"]] = counts.get(node["ip"], 0) + 1
    assert set(counts) == set(BASE), counts
    assert all(count >= 10 for count in counts.values()), counts
    for node in where:
        assert node["node_id"] == door.cluster.node_ids[node["ip"]]
    # State stays with each sandbox on its node.
    for i, sbx in enumerate(sixty):
        execution = sbx.run_code("x * 2")
        assert execution.text == str(i * 2), (i, execution.error, execution.logs)
    answer = door.http.get("/v1/sandboxes")
    assert answer.status_code == 200, answer.text
    listed = answer.json()
    assert {s.sandbox_id for s in sixty} <= {item["sandbox_id"] for item in listed}
    assert all(item["node"]["ip"] in BASE for item in listed)


def test_files_and_commands_go_to_the_sandbox_s_node(door: Door, sixty: list[Any]) -> None:
    sbx = sixty[7]
    sbx.files.write("notes/a.txt", "alpha")
    assert sbx.files.read("notes/a.txt") == "alpha"
    assert [e.name for e in sbx.files.list("notes")] == ["a.txt"]
    assert sbx.commands.run("cat notes/a.txt").stdout == "alpha"
    assert sbx.run_code("open('notes/a.txt').read()").text == "'alpha'"
    # A body larger than one read streams through the front door both ways.
    blob = bytes(range(256)) * (12 * 1024)  # 3 MiB
    sbx.files.write("blob.bin", blob)
    assert sbx.files.read("blob.bin", format="bytes") == blob
    assert sbx.run_code("import os; os.path.getsize('blob.bin')").text == str(len(blob))


def test_quotas_hold_over_the_whole_cluster(door: Door) -> None:
    import sandlot

    made = [door.sandbox(key=door.small_key) for _ in range(3)]
    try:
        ips = {door.node_of(s.sandbox_id, door.small_key)["ip"] for s in made}
        assert len(ips) > 1, "three creates should not all land on one node"
        with pytest.raises(sandlot.QuotaExceeded):
            door.sandbox(key=door.small_key)
    finally:
        for sbx in made:
            sbx.kill()
    # Killed: the quota is free again.
    door.sandbox(key=door.small_key).kill()


def test_the_unmodified_e2b_client_works_through_the_cluster(door: Door) -> None:
    from e2b_code_interpreter import Sandbox

    opts = {"api_url": door.url, "sandbox_url": door.url, "api_key": door.key}
    sbx = Sandbox.create(timeout=120, metadata={"suite": "ray"}, **opts)
    try:
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
        sbx.files.write("e2b/a.txt", "from e2b")
        assert sbx.files.read("e2b/a.txt") == "from e2b"
        assert sbx.files.exists("e2b/a.txt")
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        assert door.node_of(sbx.sandbox_id)["ip"] in BASE
        listed = Sandbox.list(**opts).next_items()
        assert sbx.sandbox_id in {info.sandbox_id for info in listed}
        # Lists fan out to every node and page as one list.
        from e2b import SandboxQuery

        run = {"run": "paging"}
        more = [Sandbox.create(timeout=120, metadata=run, **opts) for _ in range(3)]
        try:
            pages = Sandbox.list(query=SandboxQuery(metadata=run), limit=2, **opts)
            seen: list[str] = []
            for _ in range(5):
                if not pages.has_next:
                    break
                seen += [info.sandbox_id for info in pages.next_items()]
            assert sorted(seen) == sorted(m.sandbox_id for m in more)
            assert len({door.node_of(m.sandbox_id)["ip"] for m in more}) > 1
        finally:
            for m in more:
                m.kill()
        again = Sandbox.connect(sbx.sandbox_id, **opts)
        assert again.run_code("x").text == "41"
    finally:
        assert sbx.kill() is True
    assert not sbx.is_running()


def test_signed_file_urls_reach_the_sandbox_s_node(door: Door) -> None:
    """E2B's ``download_url`` / ``upload_url`` name no sandbox, only a signature its
    node can check: the front door asks every node, the right one answers."""
    from e2b import Sandbox

    opts = {"api_url": door.url, "sandbox_url": door.url, "api_key": door.key}
    made = [Sandbox.create(timeout=120, secure=True, **opts) for _ in range(3)]
    try:
        for i, sbx in enumerate(made):
            sbx.files.write("signed.txt", f"sandbox {i}")
        # Placement spreads them: the signatures are checked on different nodes.
        assert len({door.node_of(sbx.sandbox_id)["ip"] for sbx in made}) > 1
        for i, sbx in enumerate(made):
            assert httpx.get(sbx.download_url("signed.txt", "user")).text == f"sandbox {i}"
            upload = httpx.post(
                sbx.upload_url("up.txt", "user"), files={"file": ("up.txt", f"up {i}".encode())}
            )
            assert upload.status_code == 200, upload.text
            assert sbx.files.read("up.txt") == f"up {i}"
        url = made[0].download_url("signed.txt", "user")
        tampered = httpx.get(url[:-2] + "xx")
        assert tampered.status_code == 401
        assert tampered.json()["message"] == "invalid signature for this file URL"
        # A read signature does not allow a write, on any node.
        denied = httpx.post(url, files={"file": ("signed.txt", b"overwritten")})
        assert denied.status_code == 401
        assert made[0].files.read("signed.txt") == "sandbox 0"
    finally:
        for sbx in made:
            sbx.kill()


def _node_url(door: Door, sandbox_id: str) -> str:
    """The address of the node server that holds ``sandbox_id`` (from the shared store)."""
    from sandlot.server import ClusterStore

    store = ClusterStore(door.database)
    try:
        placement = store.locate(sandbox_id)
    finally:
        store.close()
    assert placement is not None
    return placement.url


def test_the_remote_sdk_sends_its_cells_over_the_websocket_through_the_door(door: Door) -> None:
    """From its second cell on, the SDK's cells go over one WebSocket that the front
    door relays to the sandbox's node; state persists across them; a kill ends the
    socket. (A client leaving mid-cell: tests/server/test_door_relay.py, against a
    real node server without Ray.)"""
    import sandlot

    sbx = door.sandbox()
    core = sbx._core
    try:
        assert sbx.run_code("x = 1").error is None  # the first cell: over HTTP
        assert core._socket is None
        opened = None
        for n in range(2, 7):
            assert sbx.run_code("x += 1; x").text == str(n)
            # The SDK holds an open cell WebSocket: the door accepted the upgrade and
            # the cell came back on it (the same connection for every cell).
            assert core._socket is not None and not core._socket.closed
            opened = opened or core._socket
            assert core._socket is opened
        assert core._socket_offered
        printed: list[str] = []
        assert (
            sbx.run_code(
                "print('out', flush=True); 6 * 7", on_stdout=lambda m: printed.append(m.line)
            ).text
            == "42"
        )
        assert printed == ["out\n"] and core._socket is opened

        # A sandbox killed under a cell running on the socket: the cell ends (typed, as
        # over HTTP), and so does the socket.
        started = threading.Event()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(
                    sbx.run_code(
                        "import time\nprint('in', flush=True)\ntime.sleep(600)",
                        on_stdout=lambda m: started.set(),
                        timeout=300,
                    )
                )
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(WAIT)
        sock = core._socket
        assert sock is not None and sock is opened  # the long cell is on the socket
        assert door.http.delete(f"/v1/sandboxes/{sbx.sandbox_id}").status_code == 204
        thread.join(WAIT)
        assert not thread.is_alive()
        (result,) = outcome
        if isinstance(result, BaseException):
            assert isinstance(result, sandlot.SandboxClosed | sandlot.SandboxLost), result
        else:
            assert result.status == "died", result
        with pytest.raises(sandlot.SandlotError) as after:
            sbx.run_code("x")
        assert type(after.value).__name__ in ("SandboxNotFound", "SandboxClosed"), after.value
        if not sock.closed:
            # The node refused that cell on the socket, then closed it (1008): relayed.
            import wsproto.events as ws

            sock._sock.settimeout(WAIT)
            ended = next(e for e in sock._events() if isinstance(e, ws.CloseConnection))
            assert ended.code == 1008, ended
    finally:
        sbx.kill()


def test_a_refused_cell_websocket_tells_nothing_and_http_answers_as_the_node_does(
    door: Door,
) -> None:
    """Another tenant's sandbox, a wrong key, an id that never existed: the front
    door refuses each upgrade the same way, saying nothing (the node itself answers
    its own typed refusal); the SDK then asks over HTTP, which answers as the node
    does, byte for byte, whether or not the id exists."""
    import sandlot
    from sandlot._remote import CellSocket, NoCellSocket

    theirs = door.sandbox(key=door.small_key)
    try:
        node = _node_url(door, theirs.sandbox_id)
        with pytest.raises(sandlot.SandlotError) as at_node:
            CellSocket.connect(node, door.key, theirs.sandbox_id).close()
        assert "not found" in str(at_node.value)  # the node's own typed refusal
        refusals = set()
        for key, sandbox_id in (
            (door.key, theirs.sandbox_id),
            ("sk_wrong", theirs.sandbox_id),
            (door.key, "sbx-never-was"),
            ("sk_wrong", "sbx-never-was"),
        ):
            with pytest.raises(NoCellSocket) as refused:
                CellSocket.connect(door.url, key, sandbox_id).close()
            refusals.add(str(refused.value))
        assert len(refusals) == 1, refusals

        def answer(url: str, key: str, sandbox_id: str) -> tuple[int, bytes, str | None]:
            got = httpx.post(
                f"{url}/v1/sandboxes/{sandbox_id}/execute",
                json={"code": "1"},
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            )
            return got.status_code, got.content, got.headers.get("www-authenticate")

        for key in (door.key, "sk_wrong"):
            at_node_answer = answer(node, key, theirs.sandbox_id)
            assert at_node_answer[0] in (401, 404), at_node_answer
            assert answer(door.url, key, theirs.sandbox_id) == at_node_answer
            unknown = answer(door.url, key, "sbx-never-was")
            assert unknown == (
                at_node_answer[0],
                at_node_answer[1].replace(theirs.sandbox_id.encode(), b"sbx-never-was"),
                at_node_answer[2],
            )
    finally:
        theirs.kill()


def test_a_node_added_later_gets_new_sandboxes_and_its_loss_takes_only_its_own(
    door: Door, sixty: list[Any]
) -> None:
    from e2b_code_interpreter import Sandbox as E2bSandbox

    import sandlot

    victim = door.cluster.add_node()
    victim_id = door.cluster.wait_for_nodes({victim.ip})[victim.ip]
    door.wait_nodes(lambda nodes: victim_id in nodes and not nodes[victim_id]["lost"])
    # The new node has the most free slots: new sandboxes go there.
    doomed = [door.sandbox() for _ in range(3)]
    assert {door.node_of(s.sandbox_id)["node_id"] for s in doomed} == {victim_id}
    for i, sbx in enumerate(doomed):
        sbx.run_code(f"y = {i}")
    opts = {"api_url": door.url, "sandbox_url": door.url, "api_key": door.key}
    e2b_doomed = E2bSandbox.create(timeout=120, **opts)
    assert door.node_of(e2b_doomed.sandbox_id)["node_id"] == victim_id
    # A small tenant at its quota, all on the victim: the loss must free the quota.
    small = [door.sandbox(key=door.small_key) for _ in range(3)]
    assert {door.node_of(s.sandbox_id, door.small_key)["node_id"] for s in small} == {victim_id}
    with pytest.raises(sandlot.QuotaExceeded):
        door.sandbox(key=door.small_key)

    # A cell is running on the victim when the node goes down.
    running: list[Any] = []
    started = threading.Event()

    def long_cell() -> None:
        running.append(
            doomed[0].run_code(
                "import time\nprint('started', flush=True)\ntime.sleep(120)",
                on_stdout=lambda _: started.set(),
            )
        )

    worker = threading.Thread(target=long_cell)
    worker.start()
    assert started.wait(WAIT)
    victim.stop()
    worker.join(WAIT)
    assert not worker.is_alive()
    (cut,) = running
    assert cut.error is not None and cut.error.name == "SandboxLostError", cut.error

    door.wait_nodes(lambda nodes: nodes.get(victim_id, {}).get("lost"))
    for sbx in doomed:
        with pytest.raises(sandlot.NodeLost) as lost:
            sbx.run_code("y")
        assert victim.ip in str(lost.value)
        assert issubclass(type(lost.value), sandlot.SandboxLost)
    assert not e2b_doomed.is_running()
    with pytest.raises(Exception, match="was not found"):
        e2b_doomed.run_code("1")
    from e2b import SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        E2bSandbox.connect(e2b_doomed.sandbox_id, **opts)
    # The others answer as before.
    for i, sbx in enumerate(sixty):
        execution = sbx.run_code("x")
        assert execution.text == str(i), (i, execution.error)
    # The audit trail says what happened; the small tenant's quota is released.
    from sandlot.server import Store

    store = Store(door.database)
    try:
        import sqlalchemy as sa

        with store.engine.connect() as conn:
            reasons = dict(
                conn.execute(
                    sa.text(
                        "SELECT sandbox_id, end_reason FROM sandboxes WHERE sandbox_id = ANY(:ids)"
                    ),
                    {"ids": [s.sandbox_id for s in doomed]},
                ).all()
            )
        assert set(reasons.values()) == {"node-lost"}, reasons
        cells = list(store.query_executions(sandbox_id=doomed[0].sandbox_id))
        assert cells[-1]["outcome"] == "killed" and cells[-1]["status"] == "died", cells[-1]
    finally:
        store.close()
    replacement = door.sandbox(key=door.small_key)
    assert door.node_of(replacement.sandbox_id, door.small_key)["ip"] in BASE
    replacement.kill()
    for sbx in [*doomed, *small]:
        sbx.kill()  # idempotent for a lost sandbox


def test_a_node_ray_drains_takes_no_new_sandbox_and_keeps_its_own(
    door: Door, sixty: list[Any]
) -> None:
    """Ray's own drain (its autoscaler's scale-down or a preemption notice; here
    ``ray drain-node``) reaches every front door: nothing new goes there, what it
    holds answers on. Last in the module: Ray has no undrain."""
    ip = "127.0.0.4"
    node_id = door.cluster.node_ids[ip]
    held = [s for s in sixty if door.node_of(s.sandbox_id)["ip"] == ip]
    assert held, "placement put none of the sixty on the node to drain"
    subprocess.run(
        [
            str(Path(sys.executable).with_name("ray")),
            "drain-node",
            "--address",
            door.cluster.address,
            "--node-id",
            node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "sandlot test",
        ],
        check=True,
        capture_output=True,
        timeout=WAIT,
    )
    nodes = door.wait_nodes(lambda nodes: nodes[node_id].get("draining"))
    assert nodes[node_id]["sandboxes"] >= len(held)
    made = [door.sandbox() for _ in range(4)]
    try:
        assert ip not in {door.node_of(s.sandbox_id)["ip"] for s in made}
        for sbx in held:
            assert sbx.run_code("x").error is None
    finally:
        for sbx in made:
            sbx.kill()


@pytest.mark.parametrize("route", ["node", "door"])
def test_a_client_that_leaves_mid_cell_interrupts_it_on_its_node(door: Door, route: str) -> None:
    """As on one server: the cell's HTTP client leaving (straight to the node, or
    through the front door) interrupts the cell there, rather than leaving it to run
    to its timeout (the node's server runs in a Ray worker, whose threads block
    SIGINT: its sandboxes inherited that, so the interrupt never reached the kernel)."""
    from sandlot.server import ClusterStore

    with door.sandbox() as sbx:
        base = _node_url(door, sbx.sandbox_id) if route == "node" else door.url
        with (
            httpx.Client(base_url=base, timeout=60) as client,
            client.stream(
                "POST",
                f"/v1/sandboxes/{sbx.sandbox_id}/execute",
                json={
                    "code": "import time\nprint('started', flush=True)\ntime.sleep(600)",
                    "timeout": 120,
                },
                headers={"Authorization": f"Bearer {door.key}"},
            ) as answer,
        ):
            assert "started" in next(answer.iter_lines())
        store = ClusterStore(door.database)
        try:
            deadline = time.monotonic() + 60
            while True:
                rows = list(store.query_executions(sandbox_id=sbx.sandbox_id))
                if rows and rows[-1]["outcome"] != "running":
                    break
                assert time.monotonic() < deadline, rows[-1:]
                time.sleep(0.1)
        finally:
            store.close()
        assert rows[-1]["status"] == "interrupted", rows[-1]
        assert sbx.run_code("'free'").text == "'free'"
