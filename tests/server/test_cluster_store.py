"""ClusterStore: placement and admission over a cluster's nodes, on a real database
(SQLite, and PostgreSQL where its binaries are installed), with no Ray and no
sandbox: what the front door decides from the shared store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.requires_server]
pytest.importorskip("sqlalchemy", reason="the server extra is not installed")

from sandlot.server import ClusterStore, NodeRef, Quotas  # noqa: E402
from sandlot.server._manager import ApiError  # noqa: E402

A = NodeRef("node-a", "10.0.0.1", "http://10.0.0.1:1", slots=2)
B = NodeRef("node-b", "10.0.0.2", "http://10.0.0.2:1", slots=3)
LOOSE = Quotas(max_sandboxes=100, creates_per_minute=1000, max_memory_mb=10**6)


@pytest.fixture(autouse=True)
def _close_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every store a test opens (a PostgreSQL connection left open warns)."""
    opened: list[ClusterStore] = []
    original = ClusterStore.__init__

    def init(self: ClusterStore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(ClusterStore, "__init__", init)
    yield
    for store in opened:
        store.close()


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[str]:
    from _postgres import postgres

    with postgres("sandlot", prefix="pg-cluster-") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.requires_postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database: SQLite, and PostgreSQL (what a cluster runs on), whose
    admission takes the advisory lock."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cluster.db'}"
    import sqlalchemy as sa

    server: str = request.getfixturevalue("postgres_server")
    name = f"t{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return server.replace("/sandlot?", f"/{name}?")


def _start(url: str, node: NodeRef, sandbox_id: str, tenant: str = "t") -> None:
    """What a node's server writes when it starts a sandbox."""
    store = ClusterStore(url, node=node)
    try:
        store.sandbox_started(sandbox_id, tenant, "python-data")
    finally:
        store.close()


def test_creates_go_to_the_node_with_most_free_slots_until_none_is_left(url: str) -> None:
    door = ClusterStore(url)
    placed = []
    for i in range(5):
        reservation, node = door.reserve("t", LOOSE, 512, [A, B])
        _start(url, node, f"s{i}")
        door.placed(reservation, f"s{i}", 512)
        placed.append(node.node_id)
    assert placed.count("node-a") == 2 and placed.count("node-b") == 3
    with pytest.raises(ApiError) as full:
        door.reserve("t", LOOSE, 512, [A, B])
    assert full.value.status == 503 and full.value.type == "NoCapacity"
    where = door.locate("s0")
    assert where is not None and where.node_id == placed[0] and where.tenant == "t"
    assert not where.lost and not where.ended
    assert door.locate("nope") is None


def test_quotas_count_every_node_and_open_reservations(url: str) -> None:
    door = ClusterStore(url)
    small = Quotas(max_sandboxes=2, creates_per_minute=1000, max_memory_mb=10**6)
    first, node = door.reserve("t", small, 512, [A, B])
    _start(url, node, "s1")
    door.placed(first, "s1", 512)
    door.reserve("t", small, 512, [A, B])  # admitted, not started yet: counts
    with pytest.raises(ApiError) as over:
        door.reserve("t", small, 512, [A, B])
    assert over.value.status == 429 and "in the cluster" in over.value.message
    # Another tenant is not affected.
    door.reserve("other", small, 512, [A, B])
    memory = Quotas(max_sandboxes=10, creates_per_minute=1000, max_memory_mb=1000)
    with pytest.raises(ApiError, match="MiB"):
        door.reserve("mem", memory, 1001, [A, B])


def test_a_lost_node_ends_its_sandboxes_and_cells_and_frees_the_quota(url: str) -> None:
    door = ClusterStore(url)
    one = Quotas(max_sandboxes=1, creates_per_minute=1000, max_memory_mb=10**6)
    reservation, node = door.reserve("t", one, 512, [A])
    _start(url, node, "s1")
    door.placed(reservation, "s1", 512)
    _start(url, B, "kept", tenant="u")
    from sandlot.server._store import Principal

    door.execution_started(
        execution_id="e1",
        principal=Principal("t", "k"),
        sandbox_id="s1",
        context="python",
        code="import time; time.sleep(60)",
        keep_code=True,
    )
    with pytest.raises(ApiError):
        door.reserve("t", one, 512, [A, B])
    assert door.node_lost("node-a") == (1, 1)
    assert door.node_lost("node-a") == (0, 0)  # idempotent: every front door may call it
    where = door.locate("s1")
    assert where is not None and where.lost and where.ended
    kept = door.locate("kept")
    assert kept is not None and not kept.lost and not kept.ended
    (cell,) = door.query_executions(sandbox_id="s1")
    assert (cell["outcome"], cell["status"], cell["error_name"]) == (
        "killed",
        "died",
        "SandboxLostError",
    )
    _, again = door.reserve("t", one, 512, [B])
    assert again.node_id == "node-b"


def test_a_node_recovers_only_its_own_sandboxes(url: str) -> None:
    _start(url, A, "on-a")
    _start(url, B, "on-b")
    store_a = ClusterStore(url, node=A)
    try:
        assert store_a.close_orphans() == (1, 0)
    finally:
        store_a.close()
    door = ClusterStore(url)
    on_a, on_b = door.locate("on-a"), door.locate("on-b")
    assert on_a is not None and on_a.ended and not on_a.lost
    assert on_b is not None and not on_b.ended


def test_a_drained_node_takes_no_new_sandbox_through_any_front_door(url: str) -> None:
    one, other = ClusterStore(url), ClusterStore(url)  # two front doors
    _start(url, A, "held")
    assert one.drain("node-b", "maintenance") is True
    assert other.drain("node-b") is False  # once: the first reason stays
    assert other.draining() == {"node-b": "maintenance"}
    placed = []
    for i in range(1):  # node-a has 2 slots, one held
        reservation, node = other.reserve("t", LOOSE, 512, [A, B])
        _start(url, node, f"s{i}")
        other.placed(reservation, f"s{i}", 512)
        placed.append(node.node_id)
    assert placed == ["node-a"]
    with pytest.raises(ApiError) as full:
        one.reserve("t", LOOSE, 512, [A, B])
    assert full.value.type == "NoCapacity" and "1 of them draining" in full.value.message
    # What it holds is still where it was; undrained, it takes new sandboxes again.
    assert one.live_per_node() == {"node-a": 2}
    assert other.undrain("node-b") is True and one.undrain("node-b") is False
    assert one.reserve("t", LOOSE, 512, [A, B])[1].node_id == "node-b"


def test_python_m_sandlot_ray_drains_and_lists(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from sandlot.ray.__main__ import main

    _start(url, A, "held")
    assert main(["drain", "node-b", "--database", url, "--reason", "kernel update"]) == 0
    assert main(["nodes", "--database", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "node-b: draining"
    assert '"node_id": "node-a", "sandboxes": 1, "draining": null' in lines[1]
    assert '"node_id": "node-b", "sandboxes": 0, "draining": "kernel update"' in lines[2]
    assert ClusterStore(url).reserve("t", LOOSE, 512, [A, B])[1].node_id == "node-a"
    assert main(["undrain", "node-b", "--database", url]) == 0
    assert "takes new sandboxes" in capsys.readouterr().out
