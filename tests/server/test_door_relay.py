"""The front door's relay (sandlot.server._relay) against a node that answers exactly
the bytes a test scripts: framing split at every byte, answers framed by length, by
chunks and by the end of the connection, malformed and cut answers, a client that
leaves mid-answer, and connection reuse; the cell WebSocket relayed to a scripted
WebSocket peer (framing, refusals, a node that goes away or falls silent, a client
that stops reading). No Ray, no sandbox: a real front door
(uvicorn on loopback) in front of a scripted TCP peer, on a SQLite cluster store.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.requires_server]
pytest.importorskip("uvicorn", reason="the server extra is not installed")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
import wsproto  # noqa: E402
import wsproto.events as ws  # noqa: E402

from sandlot.server import (  # noqa: E402
    ClusterStore,
    NodeRef,
    ServerSettings,
    _relay,
    create_front_door,
)

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


# --- the cell WebSocket ------------------------------------------------------------------
# The scripted node reads the upgrade as a request with no body; the script answers it
# with wsproto's server side, fed the very bytes the front door sent.


def _node_accepts(conn: socket.socket, head: bytes) -> wsproto.WSConnection:
    server = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    server.receive_data(head)
    events = list(server.events())
    assert isinstance(events[0], ws.Request), events
    conn.sendall(server.send(ws.AcceptConnection()))
    return server


def _events(conn: socket.socket, peer: wsproto.WSConnection) -> Iterator[ws.Event]:
    """``peer``'s events as they arrive (the end of the connection: a 1006 close)."""
    while True:
        yield from peer.events()
        data = conn.recv(65536)
        peer.receive_data(data or None)
        if not data:
            yield from peer.events()
            return


class WsClient:
    """A cell WebSocket client on a raw socket, as the remote SDK's is (wsproto)."""

    def __init__(self, door: str, headers: list[tuple[bytes, bytes]], path: str) -> None:
        host, port = door.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self.sock.sendall(
            self.ws.send(ws.Request(host=f"{host}:{port}", target=path, extra_headers=headers))
        )
        self.answer: ws.Event = next(self.events())

    def events(self) -> Iterator[ws.Event]:
        yield from _events(self.sock, self.ws)

    def send(self, data: str | bytes) -> None:
        event = ws.TextMessage(data) if isinstance(data, str) else ws.BytesMessage(data)
        self.sock.sendall(self.ws.send(event))

    def message(self) -> str | bytes | ws.CloseConnection:
        """The next whole message, or the close that came instead."""
        parts: list[Any] = []
        for event in self.events():
            if isinstance(event, ws.Message):
                parts.append(event.data)
                if event.message_finished:
                    return "".join(parts) if isinstance(event, ws.TextMessage) else b"".join(parts)
            elif isinstance(event, ws.CloseConnection):
                return event
        raise AssertionError("the connection ended without a close")

    def close(self) -> None:
        self.sock.close()


def _socket(
    door: str, key: str | None, path: str = "/v1/sandboxes/sbx/cells", **extra: str
) -> WsClient:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    return WsClient(door, headers, path)


def test_a_cell_websocket_is_relayed_message_by_message_both_ways(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    """Text stays text, binary stays binary, a message the node sent in fragments
    arrives whole; the client's key (and origin, which the node checks) reach the node,
    never the client's own handshake key; closes go both ways."""
    got: list[str | bytes] = []
    closes: queue.Queue[int] = queue.Queue()

    def node_script(conn: socket.socket, body: bytes) -> None:
        server = _node_accepts(conn, node.requests[-1])
        parts: list[Any] = []
        for event in _events(conn, server):
            if isinstance(event, ws.Message):
                parts.append(event.data)
                if not event.message_finished:
                    continue
                message = "".join(parts) if isinstance(event, ws.TextMessage) else b"".join(parts)
                parts.clear()
                got.append(message)
                if message == "fragments":
                    conn.sendall(server.send(ws.TextMessage("one ", message_finished=False)))
                    conn.sendall(server.send(ws.TextMessage("two", message_finished=True)))
                elif message == "close":
                    conn.sendall(server.send(ws.CloseConnection(code=4001, reason="done")))
                else:
                    conn.sendall(server.send(ws.Message(data=message)))  # echo
            elif isinstance(event, ws.CloseConnection):
                closes.put(event.code)
                return

    node, door, key = cluster(node_script)
    client = _socket(door, key, origin="http://127.0.0.1:1")
    assert isinstance(client.answer, ws.AcceptConnection)
    big = bytes(range(256)) * 4096  # 1 MiB: several reads on each side
    client.send('{"type": "execute", "code": "1 + 1"}')
    assert client.message() == '{"type": "execute", "code": "1 + 1"}'
    client.send(b"\x00\xffbinary")
    assert client.message() == b"\x00\xffbinary"
    client.send(big)
    assert client.message() == big
    client.send("fragments")
    assert client.message() == "one two"
    client.send("close")
    ended = client.message()
    assert isinstance(ended, ws.CloseConnection) and ended.code == 4001, ended
    client.close()
    assert closes.get(timeout=10) == 4001  # the front door answered the node's close
    assert got == [
        '{"type": "execute", "code": "1 + 1"}',
        b"\x00\xffbinary",
        big,
        "fragments",
        "close",
    ]
    head = node.requests[0].lower()
    assert head.startswith(b"get /v1/sandboxes/sbx/cells http/1.1\r\n")
    assert f"authorization: bearer {key}".lower().encode() in head
    assert b"origin: http://127.0.0.1:1\r\n" in head
    assert head.count(b"sec-websocket-key:") == 1  # the front door's own, not the client's too
    assert head.count(b"host:") == 1

    # The client closing ends the node's side too (the client left: 1001).
    client = _socket(door, key)
    client.send("hello")
    assert client.message() == "hello"
    client.sock.sendall(client.ws.send(ws.CloseConnection(code=1000)))
    assert isinstance(client.message(), ws.CloseConnection)
    client.close()
    assert closes.get(timeout=10) == 1001


def test_every_refused_cell_websocket_is_the_same_close_before_the_handshake(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    """A node's refusal (here a 401 with the node's JSON error), an unknown sandbox and
    a path that is no cell WebSocket: one answer for all, a refused handshake that says
    nothing (the SDK then asks over HTTP, whose answer says what is wrong)."""

    def node_refuses(conn: socket.socket, body: bytes) -> None:
        error = b'{"type": "AuthenticationError", "message": "invalid or revoked API key"}'
        conn.sendall(
            b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(error), error)
        )

    _, door, key = cluster(node_refuses)
    answers = []
    for client in (
        _socket(door, "wrong"),
        _socket(door, key),
        _socket(door, key, "/v1/sandboxes/no-such-sandbox/cells"),
        _socket(door, "wrong", "/v1/sandboxes/no-such-sandbox/cells"),
        _socket(door, key, "/v1/sandboxes/sbx/other"),
    ):
        answer = client.answer
        assert isinstance(answer, ws.RejectConnection), answer
        body = b"".join(e.data for e in client.events() if isinstance(e, ws.RejectData))
        answers.append((answer.status_code, sorted(answer.headers), body))
        client.close()
    assert all(a == answers[0] for a in answers), answers
    assert answers[0][0] == 403 and answers[0][2] == b""


def test_a_node_that_does_not_answer_the_upgrade_is_a_refusal(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_relay, "SOCKET_HANDSHAKE_TIMEOUT", 0.5)
    dropped = threading.Event()

    def node_is_silent(conn: socket.socket, body: bytes) -> None:
        conn.settimeout(30)
        if conn.recv(1) == b"":
            dropped.set()

    _, door, key = cluster(node_is_silent)
    client = _socket(door, key)
    try:
        assert isinstance(client.answer, ws.RejectConnection)
        assert client.answer.status_code == 403
        assert dropped.wait(10)  # the front door gave up on the node's connection
    finally:
        client.close()


@pytest.mark.parametrize("how", ["mid-message", "without-close", "too-large"])
def test_a_node_that_goes_away_ends_the_client_s_websocket_with_an_error(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
    how: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Half a message never reaches the client as a message: the client gets a close
    that says the relay failed (1011), as a cut HTTP answer is a cut stream. So does a
    message larger than the front door holds."""
    monkeypatch.setattr(_relay, "SOCKET_MAX_MESSAGE", 100_000)

    def node_dies(conn: socket.socket, body: bytes) -> None:
        server = _node_accepts(conn, node.requests[-1])
        for event in _events(conn, server):
            if isinstance(event, ws.Message):
                conn.sendall(server.send(ws.TextMessage("whole")))
                if how == "too-large":
                    for _ in range(20):  # 200 kB in fragments, never finished
                        conn.sendall(
                            server.send(ws.TextMessage("y" * 10_000, message_finished=False))
                        )
                    conn.settimeout(30)
                    with contextlib.suppress(OSError):
                        conn.recv(1)  # the front door drops it
                    return
                if how == "mid-message":
                    frame = server.send(ws.TextMessage("x" * 1000))
                    conn.sendall(frame[:500])  # half a frame
                else:
                    conn.sendall(server.send(ws.TextMessage("part", message_finished=False)))
                conn.shutdown(socket.SHUT_RDWR)
                return

    node, door, key = cluster(node_dies)
    client = _socket(door, key)
    client.send("go")
    assert client.message() == "whole"
    ended = client.message()
    assert isinstance(ended, ws.CloseConnection) and ended.code == 1011, ended
    client.close()


def test_a_client_that_stops_reading_stops_the_reads_from_its_node(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]],
) -> None:
    """The node writes 64 MiB to a client that reads nothing: the front door holds a
    bounded amount (the sockets' buffers and a message), the node's writes block; the
    client's leaving then closes the node's connection."""
    total = 64
    sent: list[int] = []
    blocked = threading.Event()

    def node_floods(conn: socket.socket, body: bytes) -> None:
        server = _node_accepts(conn, node.requests[-1])
        next(e for e in _events(conn, server) if isinstance(e, ws.Message))
        frame = server.send(ws.BytesMessage(b"x" * (1 << 20)))
        conn.settimeout(3)  # nothing taken for 3 s: the door stopped reading
        try:
            for _ in range(total):
                conn.sendall(frame)
                sent.append(1)
        except TimeoutError:
            blocked.set()
        conn.settimeout(30)
        # What the door does once its client is gone: close this connection.
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass
        node.closed.set()

    node, door, key = cluster(node_floods)
    client = _socket(door, key)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    client.send("go")
    assert blocked.wait(60), f"the node wrote all {len(sent)} MiB"
    assert len(sent) < total / 2, len(sent)
    client.sock.shutdown(socket.SHUT_RDWR)
    client.close()
    assert node.closed.wait(30)


def test_a_node_that_falls_silent_is_pinged_then_dropped(
    cluster: Callable[[Script], tuple[ScriptedNode, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live node's server answers the front door's ping; a dead one (no FIN, nothing
    answered) is given up after twice the quiet time, and the client told (1011)."""
    monkeypatch.setattr(_relay, "SOCKET_QUIET", 0.3)
    pinged: list[int] = []
    done = threading.Event()

    def node_script(conn: socket.socket, body: bytes) -> None:
        server = _node_accepts(conn, node.requests[-1])
        for event in _events(conn, server):
            if isinstance(event, ws.Ping):
                pinged.append(1)
                if len(pinged) == 1:
                    conn.sendall(server.send(event.response()))
                    conn.sendall(server.send(ws.TextMessage("alive")))
                # later pings: a dead node answers nothing
        done.set()  # the front door dropped the connection

    node, door, key = cluster(node_script)
    client = _socket(door, key)
    assert client.message() == "alive"
    ended = client.message()
    assert isinstance(ended, ws.CloseConnection) and ended.code == 1011, ended
    assert done.wait(10)
    assert len(pinged) == 2
    client.close()
