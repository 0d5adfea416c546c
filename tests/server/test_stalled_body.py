"""A cell request whose body never comes must not hold its sandbox.

Both cell routes (sandlot's ``POST /v1/sandboxes/{id}/execute`` and E2B's ``POST
/execute``) take a short path past the app (:mod:`sandlot.server._shortcut`). A lease
keeps the idle reaper off a sandbox for as long as a request holds it; taken before
the body had arrived, a client that sends its headers and then nothing (and keeps the
connection open) held the sandbox for as long as it liked. The lease now waits for the
body: such a sandbox goes idle and is reaped, and the late body finds it gone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

IDLE_TTL = 2
BODY = b'{"code": "1+1"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = ServerProcess(
        tmp_path_factory.mktemp("stalled"), "--idle-ttl", str(IDLE_TTL), "--pool-size", "0"
    ).start()
    try:
        yield started
    finally:
        started.stop()


def _headers_only(url: str, path: str, headers: dict[str, str]) -> socket.socket:
    """A POST of ``BODY`` whose headers are sent and whose body is not (yet)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), 30)
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _reaped(url: str, path: str, key: str) -> None:
    """Wait (a busy machine's bound) until GET ``path`` answers 404: the reaper took it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(f"{url}{path}", headers={"X-API-Key": key}, timeout=30).status_code == 404:
            return
        time.sleep(0.25)
    pytest.fail("a request whose body never came kept its sandbox from the idle reaper")


def _status_of_late_body(sock: socket.socket) -> bytes:
    sock.sendall(BODY)
    answer = b""
    while b"\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_a_native_cell_without_its_body_does_not_hold_the_sandbox(server: ServerProcess) -> None:
    key = server.key("native")
    made = httpx.post(
        f"{server.url}/v1/sandboxes", json={}, headers={"X-API-Key": key}, timeout=120
    )
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["sandbox_id"]
    with _headers_only(
        server.url, f"/v1/sandboxes/{sandbox_id}/execute", {"X-API-Key": key}
    ) as sock:
        _reaped(server.url, f"/v1/sandboxes/{sandbox_id}", key)
        assert b" 404 " in _status_of_late_body(sock)


def test_an_e2b_cell_without_its_body_does_not_hold_the_sandbox(server: ServerProcess) -> None:
    key = server.key("e2b")
    sandbox_id, token = server.e2b_create(key, timeout=600)
    plane = {"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token}
    with _headers_only(server.url, "/execute", plane) as sock:
        _reaped(server.url, f"/sandboxes/{sandbox_id}", key)
        assert b" 200 " not in _status_of_late_body(sock)
