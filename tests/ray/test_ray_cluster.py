"""sandlot.ray on a real multi-node Ray cluster on loopback (one cluster for the module).

A head on 127.0.0.2 and nodes on 127.0.0.3 and .4, each its own ``ray start`` with its
own temp dir (tests/_ray_cluster.py); a test that loses a node or adds one starts its
own (.5, .6), so the three base nodes stay for the others. Each node runs real
bubblewrap sandboxes ("auto" backend).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.requires_ray, pytest.mark.requires_bwrap, pytest.mark.slow]

BASE = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import ray
    from _ray_cluster import LocalRayCluster

    local = LocalRayCluster(tmp_path_factory.mktemp("ray"))
    try:
        local.add_node()
        local.add_node()
        ray.init(address=local.address, _node_ip_address="127.0.0.2", log_to_driver=False)
        local.wait_for_nodes(set(BASE))
        yield local
    finally:
        ray.shutdown()
        local.close()


@pytest.fixture(scope="module")
def sandlot_cluster(cluster: Any) -> Iterator[Any]:
    from sandlot.ray import SandlotCluster

    with SandlotCluster(slots_per_node=2) as sc:
        yield sc


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _ok(executions: list[Any]) -> None:
    bad = [e for e in executions if e.error is not None]
    assert not bad, bad[:3]


def test_every_node_gets_a_pinned_sandlot_node(cluster: Any, sandlot_cluster: Any) -> None:
    infos = {info.ip: info for info in sandlot_cluster.nodes()}
    assert set(BASE) <= set(infos)
    for ip in BASE:
        assert infos[ip].node_id == cluster.node_ids[ip]
        assert infos[ip].slots == 2 and infos[ip].free == 2


def test_programs_spread_over_every_node_and_come_back_in_order(
    cluster: Any, sandlot_cluster: Any
) -> None:
    from sandlot.ray import Program, run_batch

    programs = [Program(f"print('out', {i})\n{i} * 3") for i in range(30)]
    executions = run_batch(programs, cluster=sandlot_cluster)
    _ok(executions)
    assert [e.text for e in executions] == [str(i * 3) for i in range(30)]
    assert [e.logs.stdout for e in executions] == [[f"out {i}\n"] for i in range(30)]
    ran_on = {e.node_ip: e.node_id for e in executions}
    assert set(BASE) <= set(ran_on)
    for ip in BASE:
        assert ran_on[ip] == cluster.node_ids[ip]


def test_files_limits_and_failures_are_data_on_their_execution(
    sandlot_cluster: Any,
) -> None:
    from sandlot.ray import Program, run_batch

    programs = [
        Program("open('data.txt').read().upper()", files={"data.txt": "hello"}),
        Program("while True: pass", timeout=1),
        Program("b = bytearray(1024 * 1024 * 1024)", memory_mb=256),
        Program("1 / 0"),
        # A fresh sandbox per program: what the first program wrote is not here.
        Program("import os; os.path.exists('data.txt')"),
        Program("import os; os.getenv('K')", envs={"K": "v"}),
    ]
    out = run_batch(programs, cluster=sandlot_cluster)
    assert out[0].status == "ok" and out[0].text == "'HELLO'"
    assert out[1].status == "timeout" and out[1].error.name == "TimeoutError"
    assert out[2].status == "oom" and out[2].error.name == "OutOfMemoryError"
    assert out[3].status == "error" and out[3].error.name == "ZeroDivisionError"
    assert out[4].status == "ok" and out[4].text == "False"
    assert out[5].status == "ok" and out[5].text == "'v'"


def test_bad_programs_are_refused_before_anything_runs(sandlot_cluster: Any) -> None:
    from sandlot import InvalidArgumentError
    from sandlot.ray import Program, run_batch

    with pytest.raises(InvalidArgumentError):
        run_batch(["1", 2], cluster=sandlot_cluster)
    with pytest.raises(InvalidArgumentError):
        Program("1", timeout=-1)
    with pytest.raises(InvalidArgumentError):
        run_batch(["1"], cluster=sandlot_cluster, in_flight=0)


def test_a_sandbox_lives_on_one_node_and_keeps_its_state(
    cluster: Any, sandlot_cluster: Any
) -> None:
    from sandlot import SandboxClosed

    node_id = cluster.node_ids["127.0.0.3"]
    with sandlot_cluster.create(node_id=node_id) as sbx:
        assert sbx.node_id == node_id and sbx.node_ip == "127.0.0.3"
        sbx.files.write("notes/a.txt", "alpha")
        assert sbx.run_code("x = 20").error is None
        assert sbx.run_code("x + len(open('notes/a.txt').read())").text == "25"
        assert sbx.files.read("notes/a.txt") == "alpha"
        assert [e.name for e in sbx.files.list("notes")] == ["a.txt"]
        info = {i.ip: i for i in sandlot_cluster.nodes()}["127.0.0.3"]
        assert info.sandboxes == 1 and info.free == 1
    with pytest.raises(SandboxClosed):
        sbx.run_code("x")


def test_a_node_added_during_a_batch_receives_work(cluster: Any, sandlot_cluster: Any) -> None:
    from sandlot.ray import BatchProgress, Program, run_batch

    added: dict[str, str] = {}

    def on_progress(p: BatchProgress) -> None:
        if added:
            return
        # The batch waits here (its loop is paused, its programs run on) until the new
        # node is in the cluster; its next membership refresh must pick it up.
        node = cluster.add_node()
        added.update(cluster.wait_for_nodes({node.ip}))

    programs = [Program(f"import time; time.sleep(0.2); {i}") for i in range(40)]
    out = run_batch(
        programs,
        cluster=sandlot_cluster,
        progress=on_progress,
        refresh=0.5,
    )
    _ok(out)
    assert [e.text for e in out] == [str(i) for i in range(40)]
    ((ip, node_id),) = added.items()
    assert any(e.node_id == node_id and e.node_ip == ip for e in out)


def test_a_node_lost_mid_batch_loses_only_its_own_programs_and_sandboxes(
    cluster: Any, sandlot_cluster: Any
) -> None:
    from sandlot import NodeLost, SandboxLost
    from sandlot.ray import BatchProgress, Program, run_batch

    victim = cluster.add_node()
    victim_id = cluster.wait_for_nodes({victim.ip})[victim.ip]
    sandlot_cluster.refresh()
    doomed = sandlot_cluster.create(node_id=victim_id)
    kept = sandlot_cluster.create(node_id=cluster.node_ids["127.0.0.2"])
    marker = f"sandlot-ray-doomed-{uuid.uuid4().hex}"
    doomed.run_code(
        "import subprocess, sys\nx = 1\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])"
    )
    assert _processes_with(marker), "the doomed sandbox's process is not visible from the host"
    kept.run_code("x = 2")
    killed: list[int] = []

    def on_progress(p: BatchProgress) -> None:
        # Programs sleep 3 s: the victim's, just submitted, are still running when its
        # whole process group is killed here. (in_flight=1: the victim's other slot
        # holds ``doomed``, so it takes exactly one program at a time.)
        if not killed and p.in_flight_by_node.get(victim_id, 0) > 0:
            killed.append(p.in_flight_by_node[victim_id])
            victim.stop()

    programs = [Program(f"import time; time.sleep(3); {i}") for i in range(10)]
    out = run_batch(
        programs,
        cluster=sandlot_cluster,
        in_flight=1,
        progress=on_progress,
    )
    assert killed == [1]
    lost = [e for e in out if e.node_id == victim_id]
    assert len(lost) == 1, [(e.status, e.error) for e in lost]
    for e in lost:
        assert e.status == "died" and e.error is not None
        assert e.error.name == "SandboxLostError" and victim.ip in e.error.value
    others = [(i, e) for i, e in enumerate(out) if e.node_id != victim_id]
    assert len(others) == 9
    for i, e in others:
        assert e.status == "ok" and e.text == str(i), e
    # The sandbox it held is gone for good, typed; the others answer as before.
    with pytest.raises(NodeLost):
        doomed.run_code("x")
    assert issubclass(NodeLost, SandboxLost)
    assert kept.run_code("x").text == "2"
    kept.kill()
    doomed.kill()  # idempotent on a lost node
    # Its processes died with the node (they do not run on, written off but alive).
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(marker)
    assert victim.ip not in {i.ip for i in sandlot_cluster.nodes()}


def test_a_thousand_tiny_programs_complete_in_order(sandlot_cluster: Any) -> None:
    from sandlot.ray import BatchProgress, run_batch

    reports: list[BatchProgress] = []
    out = run_batch(
        [f"{i} + 1" for i in range(1000)],
        cluster=sandlot_cluster,
        progress=reports.append,
    )
    _ok(out)
    assert [e.text for e in out] == [str(i + 1) for i in range(1000)]
    # Backpressure: never more outstanding than the nodes' slots.
    slots = sum(i.slots for i in sandlot_cluster.nodes())
    assert max(r.in_flight for r in reports) <= slots
    assert reports[-1].done == 1000
    assert sum(len(r.finished) for r in reports) == 1000


def test_progress_bar_goes_to_stderr(
    sandlot_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from sandlot.ray import run_batch

    run_batch(["1", "2", "3"], cluster=sandlot_cluster, progress=True)
    assert "3/3" in capsys.readouterr().err


def test_a_drained_node_gets_no_new_work(cluster: Any, sandlot_cluster: Any) -> None:
    from sandlot.ray import NoCapacity, run_batch

    node_id = cluster.node_ids["127.0.0.4"]
    info = sandlot_cluster.drain(node_id)
    assert info.draining and info.free == 0
    out = run_batch([str(i) for i in range(12)], cluster=sandlot_cluster)
    _ok(out)
    assert node_id not in {e.node_id for e in out}
    with pytest.raises(NoCapacity):
        sandlot_cluster.create(node_id=node_id)


def test_a_node_ray_drains_gets_no_new_work(cluster: Any, sandlot_cluster: Any) -> None:
    """Ray's own drain (autoscaler scale-down, preemption; here ``ray drain-node``)
    drains the sandlot node at the next refresh. Last: Ray has no undrain."""
    import subprocess
    import sys
    from pathlib import Path

    from sandlot.ray import run_batch

    node_id = cluster.node_ids["127.0.0.3"]
    subprocess.run(
        [
            str(Path(sys.executable).with_name("ray")),
            "drain-node",
            "--address",
            cluster.address,
            "--node-id",
            node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "sandlot test",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    sandlot_cluster.refresh()
    assert node_id not in {n.node_id for n in sandlot_cluster.nodes()}
    drained = {n.node_id: n for n in sandlot_cluster.nodes(include_drained=True)}
    assert drained[node_id].draining
    out = run_batch([str(i) for i in range(8)], cluster=sandlot_cluster)
    _ok(out)
    assert node_id not in {e.node_id for e in out}
