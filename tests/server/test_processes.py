"""The background-process routes (``/v1/sandboxes/{id}/processes``) over plain HTTP,
against a real ``sandlot serve`` running bwrap sandboxes. The SDK's remote mode over
the same routes is covered by ``tests/integration/test_commands.py[remote]``."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _host import eventually as _eventually
from _host import host_pids as _host_pids
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

WAIT = 60.0


class Api:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.alice = server.key("alice")
        self.bob = server.key("bob")

    def client(self, key: str) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.server.url, headers=headers, timeout=WAIT)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    server = ServerProcess(tmp_path_factory.mktemp("processes"), "--idle-ttl", "600").start()
    try:
        yield Api(server)
    finally:
        server.stop()


@pytest.fixture
def alice(api: Api) -> Iterator[httpx.Client]:
    with api.client(api.alice) as client:
        yield client


@pytest.fixture
def sandbox_id(alice: httpx.Client) -> Iterator[str]:
    response = alice.post("/v1/sandboxes", json={"resources": {"background_processes": 2}})
    assert response.status_code == 201, response.text
    sandbox = str(response.json()["sandbox_id"])
    try:
        yield sandbox
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox}")


def _lines(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line:
            yield json.loads(line)


def test_start_streams_then_ends(alice: httpx.Client, sandbox_id: str) -> None:
    body = {"cmd": "echo out; echo err >&2; exit 5", "envs": {"A": "b"}}
    with alice.stream("POST", f"/v1/sandboxes/{sandbox_id}/processes", json=body) as response:
        assert response.status_code == 200
        events = list(_lines(response))
    assert events[0]["type"] == "started" and events[0]["pid"] > 0
    assert {"type": "stdout", "text": "out\n"} in events
    assert {"type": "stderr", "text": "err\n"} in events
    assert events[-1] == {"type": "end", "exit_code": 5, "error": None}


def test_stdin_list_disconnect_connect_and_kill(alice: httpx.Client, sandbox_id: str) -> None:
    base = f"/v1/sandboxes/{sandbox_id}/processes"
    body = {"cmd": "cat", "stdin": True, "timeout": 0}
    with alice.stream("POST", base, json=body) as response:
        events = _lines(response)
        pid = next(events)["pid"]
        data = base64.b64encode(b"through the server\n").decode()
        sent = alice.post(f"{base}/{pid}/stdin", json={"data": data})
        assert sent.status_code == 204, sent.text
        assert next(events) == {"type": "stdout", "text": "through the server\n"}
    # The client went away; the process did not.
    listed = alice.get(base).json()
    assert [p["pid"] for p in listed] == [pid]
    assert listed[0]["args"] == ["-c", "cat"]
    with alice.stream("GET", f"{base}/{pid}") as response:
        events = _lines(response)
        assert next(events) == {"type": "started", "pid": pid}
        assert next(events) == {"type": "stdout", "text": "through the server\n"}  # replayed
        assert alice.post(f"{base}/{pid}/close-stdin").status_code == 204
        assert next(events) == {"type": "end", "exit_code": 0, "error": None}
    assert alice.get(base).json() == []
    assert alice.delete(f"{base}/{pid}").json() == {"killed": False}


def test_refusals_have_their_status(alice: httpx.Client, sandbox_id: str) -> None:
    base = f"/v1/sandboxes/{sandbox_id}/processes"
    missing = alice.get(f"{base}/4242")
    assert missing.status_code == 404 and missing.json()["type"] == "ProcessNotFoundError"
    stdin = alice.post(f"{base}/4242/stdin", json={"data": "eA=="})
    assert stdin.status_code == 404
    assert alice.post(base, json={"cmd": " "}).status_code == 400
    assert alice.post(base, json={"cmd": "true", "timeout": -1}).status_code == 422
    assert alice.post(base, json={"cmd": "true", "nope": 1}).status_code == 422
    assert alice.post(base, json={"pty": {"rows": 0, "cols": 80}}).status_code == 422
    assert alice.post(base, json={"cmd": "true", "envs": {"A=B": "x"}}).status_code == 400
    assert alice.post(f"{base}/1/stdin", json={"data": "not base64!"}).status_code == 400
    for _ in range(2):
        with alice.stream("POST", base, json={"cmd": "sleep 600"}) as response:
            assert next(_lines(response))["type"] == "started"
    full = alice.post(base, json={"cmd": "sleep 600"})
    assert full.status_code == 409 and full.json()["type"] == "ProcessLimitError"
    for process in alice.get(base).json():
        assert alice.delete(f"{base}/{process['pid']}").json() == {"killed": True}
    assert alice.get(base).json() == []


def test_another_tenant_cannot_reach_the_processes(api: Api, alice: httpx.Client) -> None:
    created = alice.post("/v1/sandboxes", json={})
    sandbox = created.json()["sandbox_id"]
    try:
        with alice.stream(
            "POST", f"/v1/sandboxes/{sandbox}/processes", json={"cmd": "sleep 600"}
        ) as response:
            pid = next(_lines(response))["pid"]
        with api.client(api.bob) as bob:
            base = f"/v1/sandboxes/{sandbox}/processes"
            assert bob.get(base).status_code == 404
            assert bob.delete(f"{base}/{pid}").status_code == 404
            assert bob.get(f"{base}/{pid}").status_code == 404
            assert bob.post(f"{base}/{pid}/stdin", json={"data": "eA=="}).status_code == 404
        assert [p["pid"] for p in alice.get(f"/v1/sandboxes/{sandbox}/processes").json()] == [pid]
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox}")


def test_processes_die_with_the_sandbox(alice: httpx.Client, tmp_path: Path) -> None:
    sandbox = alice.post("/v1/sandboxes", json={}).json()["sandbox_id"]
    marker = "7777." + str(uuid.uuid4().int % 10**9)
    body = {"cmd": f"sleep {marker} & exec sleep {marker}", "timeout": 0}
    with alice.stream("POST", f"/v1/sandboxes/{sandbox}/processes", json=body) as response:
        assert next(_lines(response))["type"] == "started"
    _eventually(lambda: len(_host_pids(marker)) == 2, "both sleepers on the host")
    assert alice.delete(f"/v1/sandboxes/{sandbox}").status_code == 204
    _eventually(lambda: _host_pids(marker) == [], "the sleepers to be gone from the host")
