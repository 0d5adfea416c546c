"""``sandlot serve`` keeps a warm pool: creates with the default resources take a ready
sandbox (data stack imported, nothing else different), other shapes start on the request,
and the pool's counters are in /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from _host import eventually as _eventually
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

WAIT = 120.0
"""Seconds to wait for the pool to fill; generous, the machine is shared."""

PROBE = (
    "import sys\n"
    "(sorted(m for m in ('pandas', 'numpy', 'matplotlib') if m in sys.modules),"
    " sorted(k for k in globals() if k[0] != '_' and k not in ('sys', 'get_ipython')))"
)


def _metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _run(client: httpx.Client, sandbox_id: str, code: str) -> list[dict[str, object]]:
    response = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": code})
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    server = ServerProcess(tmp_path_factory.mktemp("pool"), "--pool-size", "1").start()
    try:
        key = server.key("pooled")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT
        ) as client:
            yield client
    finally:
        server.stop()


def test_a_default_create_takes_a_ready_sandbox_that_looks_fresh(pooled: httpx.Client) -> None:
    _eventually(lambda: _metric(pooled, "sandlot_pool_ready") >= 1, "a ready sandbox")
    hits = _metric(pooled, 'sandlot_pool_requests_total{result="hit"}')
    sandbox_id = pooled.post("/v1/sandboxes", json={"timeout": 300}).json()["sandbox_id"]
    try:
        assert _metric(pooled, 'sandlot_pool_requests_total{result="hit"}') == hits + 1
        events = _run(pooled, sandbox_id, PROBE)
        results = [e for e in events if e.get("type") == "result"]
        # The data stack is imported; the namespace and the cell counter are a fresh one's.
        assert results and results[0]["text"] == "(['matplotlib', 'numpy', 'pandas'], [])"
        counts = [e["execution_count"] for e in events if e["type"] == "number_of_executions"]
        assert counts == [1]
        # The pool refills behind the create.
        _eventually(lambda: _metric(pooled, "sandlot_pool_ready") >= 1, "the refill")
    finally:
        pooled.delete(f"/v1/sandboxes/{sandbox_id}")


def test_another_shape_is_a_miss_and_still_works(pooled: httpx.Client) -> None:
    misses = _metric(pooled, 'sandlot_pool_requests_total{result="miss"}')
    created = pooled.post(
        "/v1/sandboxes", json={"timeout": 300, "resources": {"memory_mb": 768}}
    ).json()
    try:
        assert created["resources"]["memory_mb"] == 768
        assert _metric(pooled, 'sandlot_pool_requests_total{result="miss"}') == misses + 1
        events = _run(pooled, created["sandbox_id"], "6 * 7")
        assert [e["text"] for e in events if e.get("type") == "result"] == ["42"]
    finally:
        pooled.delete(f"/v1/sandboxes/{created['sandbox_id']}")


def test_no_pool_when_the_size_is_zero(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "state", "--pool-size", "0").start()
    try:
        key = server.key("cold")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT
        ) as client:
            sandbox_id = client.post("/v1/sandboxes", json={"timeout": 300}).json()["sandbox_id"]
            events = _run(client, sandbox_id, PROBE)
            assert [e["text"] for e in events if e.get("type") == "result"] == ["([], [])"]
            assert _metric(client, "sandlot_pool_ready") == 0
            assert _metric(client, 'sandlot_pool_requests_total{result="hit"}') == 0
    finally:
        server.stop()
