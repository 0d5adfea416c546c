"""Operator ceilings and bounded memory, against a real ``sandlot serve`` on loopback.

A tenant used to lift its own limits by sending ``null`` (``pids: null`` let a command
start thousands of processes; ``output_bytes: null`` let one print grow the server by a
GiB), and a cell could make the server parse results into a dozen times their size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _server_harness import ServerProcess
from sandlot.policy import MiB

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("ceilings"),
        "--ceiling",
        "pids=64",
        "--ceiling",
        "output_bytes=65536",
        "--ceiling",
        "result_bytes=4194304",
        "--client-stall-timeout",
        "5",
    ).start()
    try:
        yield process
    finally:
        process.stop()


def _client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


@pytest.mark.parametrize(
    ("resources", "mention"),
    [
        ({"pids": None}, "pids"),
        ({"cpus": None}, "cpus"),
        ({"output_bytes": None}, "output_bytes"),
        ({"pids": 65}, "ceiling"),
        ({"output_bytes": 65537}, "ceiling"),
        ({"cpus": 1.5}, "ceiling"),
    ],
)
def test_null_or_above_the_ceiling_is_refused(
    server: ServerProcess, resources: dict[str, Any], mention: str
) -> None:
    with _client(server, server.key("refused")) as client:
        response = client.post("/v1/sandboxes", json={"resources": resources})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "InvalidArgumentError"
    assert mention in response.json()["message"]


def test_a_resource_left_out_gets_the_ceiling_and_a_tenant_can_have_its_own(
    server: ServerProcess,
) -> None:
    with _client(server, server.key("plain")) as client:
        response = client.post("/v1/sandboxes", json={"resources": {"memory_mb": 512}})
        assert response.status_code == 201, response.text
        info = response.json()
        client.delete(f"/v1/sandboxes/{info['sandbox_id']}")
    assert info["resources"]["pids"] == 64
    assert info["resources"]["output_bytes"] == 65536
    assert info["resources"]["memory_mb"] == 512
    # The cgroup really says so: the ceiling is applied, not only reported.
    key = server.key("small", "--ceiling", "pids=16", "--ceiling", "cell_timeout=5")
    with _client(server, key) as client:
        response = client.post("/v1/sandboxes", json={})
        assert response.status_code == 201, response.text
        sandbox_id = response.json()["sandbox_id"]
        try:
            assert response.json()["resources"]["pids"] == 16
            refused = client.post("/v1/sandboxes", json={"resources": {"pids": 17}})
            assert refused.status_code == 400 and "16" in refused.json()["message"]
            slow = client.post(
                f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "1", "timeout": 6}
            )
            assert slow.status_code == 400 and "ceiling" in slow.json()["message"]
            # A command that names no timeout gets the default or the ceiling, not a 400.
            plain = client.post(f"/v1/sandboxes/{sandbox_id}/commands", json={"cmd": "true"})
            assert plain.status_code == 200, plain.text
            ran = client.post(
                f"/v1/sandboxes/{sandbox_id}/commands",
                json={"cmd": "for i in $(seq 40); do sleep 5 & done; wait", "timeout": 5},
            )
            lines = [json.loads(line) for line in ran.text.splitlines() if line]
            text = "".join(str(m.get("text", "")) for m in lines)
            assert "fork" in text or "Resource temporarily unavailable" in text, lines
        finally:
            client.delete(f"/v1/sandboxes/{sandbox_id}")


def _status(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1]) * 1024
    raise KeyError(field)


HOSTILE = """
import sys
frame = sys._getframe()
while type(frame.f_locals.get("self")).__name__ != "Kernel":
    frame = frame.f_back
kernel = frame.f_locals["self"]
items = (4 * 1024 * 1024 - 4096) // 6
line = (
    '{"type":"result","id":"%s","is_main_result":false,"data":{"application/json":['
    % kernel.current_id + '"ab",' * items + '"x"]}}\\n'
).encode()
with kernel.channel.lock:
    for _ in range(8):
        kernel.channel.sock.sendall(line)
print("x" * 1000000)
open("/home/user/done", "w").close()
"""


def _paused(
    server: ServerProcess, key: str, code: str, resources: dict[str, Any]
) -> tuple[list[dict[str, Any]], int]:
    """Run ``code`` while its client reads nothing until the cell has ended (it creates
    ``done`` last); return the messages, then read, and the server's RSS growth."""
    assert server.process is not None
    pid = server.process.pid
    with _client(server, key) as client:
        created = client.post("/v1/sandboxes", json={"resources": resources})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["sandbox_id"]
        try:
            warm = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "1"})
            assert warm.status_code == 200
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            base = _status(pid, "VmRSS")
            with (
                _client(server, key) as paused,
                paused.stream(
                    "POST", f"/v1/sandboxes/{sandbox_id}/execute", json={"code": code}
                ) as response,
            ):
                assert response.status_code == 200
                for _ in range(600):  # bounded: a few minutes at most
                    done = client.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "done"})
                    if done.status_code == 200:
                        break
                    # A round trip into the sandbox as the pause between polls.
                    client.post(
                        f"/v1/sandboxes/{sandbox_id}/commands",
                        json={"cmd": "sleep 0.1", "timeout": 5},
                    )
                else:
                    pytest.fail("the cell did not finish")
                lines = [json.loads(line) for line in response.iter_lines() if line]
            return lines, _status(pid, "VmHWM") - base
        finally:
            client.delete(f"/v1/sandboxes/{sandbox_id}")


def test_a_hostile_cell_and_a_paused_client_leave_the_server_bounded(
    server: ServerProcess,
) -> None:
    # Eight results of 4 MiB of two-letter strings (each within the runner's caps):
    # parsed, each is ~50 MiB of objects. The client reads nothing until the cell ended.
    lines, growth = _paused(server, server.key("hostile"), HOSTILE, {})
    assert growth < 32 * MiB, f"the server grew by {growth / MiB:.0f} MiB"
    end = lines[-1]
    assert end["type"] == "end_of_execution" and end["truncated"] is True, end
    assert any("host dropped" in str(m.get("text", "")) for m in lines)


PRINTS = """
chunk = "x" * (1 << 20)
try:
    for _ in range(200):
        print(chunk)
finally:  # also when the server interrupts the cell
    open("/home/user/done", "w").close()
"""


def test_a_paused_client_makes_the_cell_wait_then_cuts_it_not_the_server_grow(
    server: ServerProcess,
) -> None:
    # 200 MiB of output, all within this tenant's own output ceiling (256 MiB), to a
    # client that reads nothing: the server holds a bounded queue, the sandbox waits,
    # and after --client-stall-timeout (5 s) the stream is cut with ClientTooSlow.
    key = server.key("printer", "--ceiling", f"output_bytes={256 * MiB}")
    lines, growth = _paused(server, key, PRINTS, {"output_bytes": 256 * MiB})
    assert growth < 64 * MiB, f"the server grew by {growth / MiB:.0f} MiB"
    printed = sum(len(str(m.get("text", ""))) for m in lines if m["type"] == "stdout")
    assert 0 < printed < 64 * MiB, printed
    assert lines[-1]["type"] == "error" and lines[-1]["name"] == "ClientTooSlow", lines[-1]
