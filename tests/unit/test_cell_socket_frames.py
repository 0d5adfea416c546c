"""The remote SDK's own WebSocket framing (``sandlot._remote.CellSocket``) against a
scripted server on loopback that speaks through wsproto, frame by frame.

The client makes and reads a cell's frames itself and hands the stream to wsproto at
the first frame of another kind; these check that the hand-over keeps every frame in
order, that what the client sends is what a WebSocket server reads, and that bytes a
server sends right behind its handshake are not lost in the hand-over.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import wsproto
import wsproto.events as ws

from sandlot._remote import CellSocket

Script = Callable[["_Peer"], None]


class _Peer:
    """The server's end of one connection: wsproto's server side on a plain socket."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        self.seen: list[Any] = []

    def events(self) -> Iterator[ws.Event]:
        while True:
            for event in self.ws.events():
                self.seen.append(event)
                yield event
            data = self.conn.recv(65536)
            self.ws.receive_data(data or None)
            if not data:
                for event in self.ws.events():
                    self.seen.append(event)
                    yield event
                return

    def next_message(self) -> str:
        parts: list[str] = []
        for event in self.events():
            if isinstance(event, ws.TextMessage):
                parts.append(event.data)
                if event.message_finished:
                    return "".join(parts)
        raise AssertionError("the client left")

    def wait_for(self, kind: type[ws.Event]) -> None:
        for event in self.events():
            if isinstance(event, kind):
                return
        raise AssertionError(f"no {kind.__name__} came")

    def send(self, *events: ws.Event) -> None:
        self.conn.sendall(b"".join(self.ws.send(event) for event in events))


def _serve(script: Script) -> tuple[str, threading.Thread, list[BaseException]]:
    listener = socket.create_server(("127.0.0.1", 0))
    failures: list[BaseException] = []

    def run() -> None:
        with listener:
            listener.settimeout(10)
            conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                script(_Peer(conn))
            except BaseException as exc:  # reported by the test
                failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread, failures


def _lines(*messages: dict[str, Any]) -> str:
    return "".join(json.dumps(message) + "\n" for message in messages)


END = {"type": "end_of_execution", "status": "ok"}
BIG = "x" * 70_000  # a frame with a 64-bit length, both ways


def test_frames_of_every_kind_arrive_in_order_across_the_hand_over() -> None:
    def script(peer: _Peer) -> None:
        for event in peer.events():
            if isinstance(event, ws.Request):
                break
        # The ping rides in the handshake's own write: it must not be lost or
        # reordered by a client that parses frames itself after the handshake.
        peer.send(ws.AcceptConnection(), ws.Ping(b"behind-the-101"))
        first = json.loads(peer.next_message())
        assert first["code"] == "1+1" and first["type"] == "execute"
        peer.wait_for(ws.Pong)  # answered before this cell's answer is sent
        peer.send(
            ws.TextMessage(_lines({"type": "stdout", "text": "a"})),
            ws.TextMessage(_lines({"type": "stdout", "text": BIG}, END)),
        )
        second = json.loads(peer.next_message())
        assert second["code"] == BIG  # the client's masking, over 64 KiB
        peer.send(
            ws.TextMessage(_lines({"type": "stdout", "text": "b"})),
            # A fragmented message: the client hands over to wsproto from here on.
            ws.TextMessage('{"type": "stdout", ', message_finished=False),
            ws.TextMessage('"text": "c"}\n', message_finished=True),
            ws.Ping(b"mid-cell"),
            ws.TextMessage(_lines(END)),
        )
        third = json.loads(peer.next_message())
        assert third["code"] == "é"  # UTF-8 and the short length form
        peer.send(ws.TextMessage(_lines({"type": "stdout", "text": "d"}, END)))
        peer.send(ws.CloseConnection(code=1001))
        peer.wait_for(ws.CloseConnection)

    url, thread, failures = _serve(script)
    sock = CellSocket.connect(url, "sl_x_y", "sandbox")
    try:
        got = []
        for code, parsed_here in (("1+1", True), (BIG, False), ("é", False)):
            got.append(list(sock.cell({"code": code}, 10)))
            assert sock._fast is parsed_here  # until the fragmented message (cell 2)
        texts = [[m.get("text") for m in messages if m["type"] == "stdout"] for messages in got]
        assert texts == [["a", BIG], ["b", "c"], ["d"]]
        assert all(messages[-1] == END for messages in got)
        with pytest.raises(ConnectionError, match="1001"):
            list(sock.cell({"code": "1"}, 10))
    finally:
        sock.close()
        thread.join(10)
    assert not failures, failures


def test_a_frame_that_is_not_utf_8_closes_the_connection() -> None:
    def script(peer: _Peer) -> None:
        for event in peer.events():
            if isinstance(event, ws.Request):
                break
        peer.send(ws.AcceptConnection())
        peer.next_message()
        peer.conn.sendall(b"\x81\x02\xff\xfe")  # a text frame of two bytes that are not UTF-8
        peer.wait_for(ws.CloseConnection)

    url, thread, failures = _serve(script)
    sock = CellSocket.connect(url, "sl_x_y", "sandbox")
    try:
        with pytest.raises(ConnectionError, match="1007"):
            list(sock.cell({"code": "1"}, 10))
    finally:
        sock.close()
        thread.join(10)
    assert not failures, failures


def test_between_cells_a_ping_keeps_the_connection_and_a_close_ends_it() -> None:
    """``alive()``, asked before each cell: a keepalive ping that came meanwhile is
    answered and the connection reused; a close (the server's idle close) means a new
    connection, not a cell sent into one that is ending."""
    sent_ping = threading.Event()
    checked = threading.Event()  # the client's first alive() is done: close now
    sent_close = threading.Event()

    def script(peer: _Peer) -> None:
        for event in peer.events():
            if isinstance(event, ws.Request):
                break
        peer.send(ws.AcceptConnection())
        peer.next_message()
        peer.send(ws.TextMessage(_lines(END)), ws.Ping(b"keepalive"))
        sent_ping.set()
        peer.wait_for(ws.Pong)
        assert checked.wait(10)
        peer.send(ws.CloseConnection(code=1001))
        sent_close.set()
        peer.wait_for(ws.CloseConnection)

    url, thread, failures = _serve(script)
    sock = CellSocket.connect(url, "sl_x_y", "sandbox")
    try:
        assert list(sock.cell({"code": "1"}, 10)) == [END]
        assert sent_ping.wait(10)
        assert sock.alive()  # the ping was answered (the server waits for the pong)
        checked.set()
        assert sent_close.wait(10)
        deadline = time.monotonic() + 10
        while sock.alive():  # until the close frame has crossed loopback
            assert time.monotonic() < deadline, "alive() never saw the close"
            select.select([sock._sock], [], [], 1)
    finally:
        sock.close()
        thread.join(10)
    assert not failures, failures
