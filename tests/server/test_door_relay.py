"""The front door's relay (sandlot.server._relay) against a node that answers exactly
the bytes a test scripts: framing split at every byte, answers framed by length, by
chunks and by the end of the connection, malformed and cut answers, a client that
leaves mid-answer, and connection reuse. No Ray, no sandbox: a real front door
(uvicorn on loopback) in front of a scripted TCP peer, on a SQLite cluster store.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.requires_server]
pytest.importorskip("uvicorn", reason="the server extra is not installed")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from sandlot.server import ClusterStore, NodeRef, ServerSettings, create_front_door  # noqa: E402

Script = Callable[[socket.socket, bytes], None]
"""What the scripted node does with one request (its head and body, as received)."""


@dataclass
class ScriptedNode:
    """A TCP peer that reads each request whole and answers with ``script``."""

    script: Script
    sock: socket.socket = field(default_factory=socket.socket)
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: threading.Event = field(default_factory=threading.Event)
    """Set when a connection's peer (the front door) closed it."""

    def __post_init__(self) -> None:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        self.closed.set()
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                body = b""
                lower = head.lower()
                if b"transfer-encoding: chunked" in lower:
                    while not buffer.endswith(b"0\r\n\r\n"):
                        buffer += conn.recv(65536)
                    body, buffer = _unchunk(buffer), b""
                elif b"content-length: " in lower:
                    length = int(lower.split(b"content-length: ")[1].split(b"\r\n")[0])
                    while len(buffer) < length:
                        buffer += conn.recv(65536)
                    body, buffer = buffer[:length], buffer[length:]
                self.requests.append(head + b"\r\n\r\n" + body)
                try:
                    self.script(conn, body)
                except OSError:
                    self.closed.set()
                    return

    def close(self) -> None:
        self.sock.close()


def _unchunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2 :]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[[Script], tuple[ScriptedNode, str, str]]]:
    """``start(script)``: a scripted node holding sandbox "sbx", a front door in front
    of it; returns the node, the door's URL and an API key."""
    url = f"sqlite:///{tmp_path / 'cluster.db'}"
    started: list[tuple[ScriptedNode, uvicorn.Server, threading.Thread]] = []

    def start(script: Script) -> tuple[ScriptedNode, str, str]:
        node = ScriptedNode(script)
        ref = NodeRef("node-a", "127.0.0.1", node.url, 4)
        store = ClusterStore(url, node=ref)
        key = store.create_key("t")
        store.sandbox_started("sbx", "t", "python-data")
        store.close()

        class Static:
            def nodes(self) -> list[NodeRef]:
                return [ref]

            def refresh(self) -> set[str]:
                return set()

            def confirm_lost(self, node_id: str) -> bool:
                return False

            def draining(self) -> set[str]:
                return set()

        settings = ServerSettings(state_dir=tmp_path / "door", database_url=url)
        door = create_front_door(settings, Static(), refresh=60)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(door, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the door did not start"
            time.sleep(0.01)
        started.append((node, server, thread))
        return node, f"http://127.0.0.1:{sock.getsockname()[1]}", key

    yield start
    for node, server, thread in started:
        server.should_exit = True
        thread.join(timeout=30)
        node.close()


def _cell(door: str, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{door}/v1/sandboxes/sbx/execute",
        json={"code": "1 + 1"},
        headers=headers or {"Authorization": f"Bearer {key}"},
        timeout=30,
    )


LINES = b'{"type": "result", "text": "2"}\n{"type": "end_of_execution"}\n'


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


HEAD_CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
    b"transfer-encoding: chunked\r\nx-node: a\r\n\r\n"
)


def test_a_chunked_answer_split_at_every_byte_arrives_whole_and_the_connection_is_reused(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    answer = HEAD_CHUNKED + _chunked(LINES[:10], LINES[10:])

    def byte_by_byte(conn: socket.socket, body: bytes) -> None:
        for i in range(len(answer)):
            conn.sendall(answer[i : i + 1])
            time.sleep(0.0005)  # pacing only: each byte its own segment (not a sync)

    node, door, key = cluster(byte_by_byte)
    for _ in range(3):
        response = _cell(door, key)
        assert response.status_code == 200
        assert response.content == LINES
        assert response.headers["x-node"] == "a"
        assert response.headers["content-type"] == "application/x-ndjson"
    assert node.connections == 1  # one keep-alive connection for every call
    head, _, body = node.requests[0].partition(b"\r\n\r\n")
    assert body == b'{"code":"1 + 1"}'
    assert head.startswith(b"POST /v1/sandboxes/sbx/execute HTTP/1.1\r\n")
    assert f"host: {node.url.removeprefix('http://')}".encode() in head


def test_answers_framed_by_length_and_by_the_end_of_the_connection(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    calls = 0

    def script(conn: socket.socket, body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(LINES))
            conn.sendall(LINES)
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + LINES)
            conn.shutdown(socket.SHUT_WR)

    node, door, key = cluster(script)
    assert _cell(door, key).content == LINES
    assert _cell(door, key).content == LINES
    # Framed by its end, the second connection cannot carry a third call.
    assert _cell(door, key).content == LINES
    assert node.connections == 2


@pytest.mark.parametrize(
    "answer",
    [
        HEAD_CHUNKED + b"zz\r\nnot a chunk\r\n0\r\n\r\n",
        HEAD_CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
        HEAD_CHUNKED + b"5\r\nhelloXX0\r\n\r\n",
        HEAD_CHUNKED + b"5\r\nhello\r\n",  # then the node goes away
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + LINES,  # short, then gone
    ],
    ids=["bad-size", "prefixed-size", "no-crlf-after-data", "cut", "short"],
)
def test_a_malformed_or_cut_answer_reaches_the_client_cut_never_complete(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]], answer: bytes
) -> None:
    def script(conn: socket.socket, body: bytes) -> None:
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)

    _, door, key = cluster(script)
    with pytest.raises(httpx.RemoteProtocolError):
        _cell(door, key)


def test_a_node_that_answers_garbage_before_any_head_is_unreachable(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    def script(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")

    _, door, key = cluster(script)
    response = _cell(door, key)
    assert response.status_code == 503
    assert response.json()["type"] == "NodeUnreachable"


def test_a_client_that_leaves_mid_answer_closes_the_node_s_connection(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    dropped = threading.Event()

    def slow_cell(conn: socket.socket, body: bytes) -> None:
        conn.sendall(HEAD_CHUNKED + b"5\r\nhello\r\n")
        # The cell "runs" on; a node's server notices its caller left by the end of
        # the connection, as here.
        conn.settimeout(30)
        if conn.recv(1) == b"":
            dropped.set()

    _, door, key = cluster(slow_cell)
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            f"{door}/v1/sandboxes/sbx/execute",
            json={"code": "1 + 1"},
            headers={"Authorization": f"Bearer {key}"},
        ) as response,
    ):
        assert next(response.iter_raw()) == b"hello"
    # The client closed its connection: the door drops the node's.
    assert dropped.wait(10)


def test_a_streamed_upload_reaches_the_node_whole(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    def script(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))

    node, door, key = cluster(script)
    parts = [b"x" * 70_000, b"y" * 3, b"z" * 200_000]

    def upload() -> Iterator[bytes]:
        yield from parts

    response = httpx.post(
        f"{door}/v1/sandboxes/sbx/files?path=a.bin",
        content=upload(),
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.content == b"".join(parts)
    assert b"transfer-encoding: chunked\r\n" in node.requests[0].lower()


def test_an_interim_answer_is_skipped_and_expect_is_not_passed_on(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    def script(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))

    node, door, key = cluster(script)
    response = _cell(
        door, key, headers={"Authorization": f"Bearer {key}", "Expect": "100-continue"}
    )
    assert response.status_code == 200 and response.content == b'{"code":"1 + 1"}'
    assert b"expect:" not in node.requests[0].lower()
