"""TCP connections multiplexed over one byte stream: a microVM's door to the egress proxy.

A VM has no network device. A sandbox with a network policy reaches the host's egress
proxy through a second virtio-serial port instead, which carries every connection at
once, in frames. Both ends run this module (stdlib only): in the guest, as a thread of
pid 1 (non-dumpable), it listens on the sandbox's loopback at the proxy port and opens
a stream per accepted connection; on the host (``MicroVMBackend``) it connects each
stream to the sandbox's own socket on the egress proxy, which decides everything. The
host end trusts nothing the guest sends: bounded frames, a bounded number of streams,
a bounded window per stream; a violation ends the door.

Frame: stream id (u32), kind (u8), payload length (u32), payload. Kinds: ``OPEN`` (guest
to host), ``DATA``, ``EOF`` (the sender's side of the connection is done: half-close),
``CLOSE`` (abort; the stream is gone), ``ACK`` (u32 bytes: the receiver wrote that many
to its socket). A sender keeps at most :data:`WINDOW` bytes of a stream unacknowledged,
so a receiver never holds more than that per stream and never has to stop reading the
port for one slow connection: one stream cannot stall the others.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import sys
from collections.abc import Callable

HEADER = struct.Struct(">IBI")
OPEN, DATA, EOF, CLOSE, ACK = 1, 2, 3, 4, 5
MAX_FRAME = 64 * 1024
"""Largest payload of a frame."""
WINDOW = 256 * 1024
"""Bytes of one stream a sender may have in flight before an ACK."""
MAX_STREAMS = 128
"""Streams open at once (the proxy's per-sandbox connection cap is usually lower)."""
TX_HIGH = 1024 * 1024
"""Bytes queued for the port past which no more is read from the sockets."""


class MuxViolation(Exception):
    """The peer broke the framing (a hostile or broken guest): the door closes."""


class _Stream:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()
        """Bytes from the peer waiting to be written to the socket (at most WINDOW)."""
        self.in_flight = 0
        """Bytes sent to the peer and not yet acknowledged."""
        self.to_ack = 0
        self.peer_eof = False
        self.local_eof = False


class Mux:
    """One end of the multiplexed door. ``port``: a file descriptor of the byte stream
    (non-blocking). Exactly one of ``listener`` (the guest: accepts connections) and
    ``connect`` (the host: a new socket to the proxy per stream, or None to refuse)."""

    def __init__(
        self,
        port: int,
        *,
        listener: socket.socket | None = None,
        connect: Callable[[], socket.socket | None] | None = None,
    ) -> None:
        if (listener is None) == (connect is None):
            raise ValueError("a mux either listens (guest) or connects (host)")
        self.port = port
        self.listener = listener
        self.connect = connect
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1
        self.rx = bytearray()
        self.tx = bytearray()
        self.selector = selectors.DefaultSelector()
        self.closed = False
        os.set_blocking(port, False)
        if listener is not None:
            listener.setblocking(False)

    # --- the loop ----------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Relay until the port closes or the peer breaks the framing."""
        try:
            while self._step():
                pass
        except MuxViolation as exc:
            sys.stderr.write(f"sandlot egress door closed: {exc}\n")
        finally:
            self.close()

    def close(self) -> None:
        self.closed = True
        for stream in list(self.streams.values()):
            stream.sock.close()
        self.streams.clear()
        self.selector.close()

    def _step(self) -> bool:
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
        port_events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.tx else 0)
        self.selector.register(self.port, port_events, None)
        room = len(self.tx) < TX_HIGH
        if self.listener is not None and room and len(self.streams) < MAX_STREAMS:
            self.selector.register(self.listener, selectors.EVENT_READ, None)
        for sid, stream in self.streams.items():
            events = 0
            if room and not stream.local_eof and stream.in_flight < WINDOW:
                events |= selectors.EVENT_READ
            if stream.out:
                events |= selectors.EVENT_WRITE
            if events:
                self.selector.register(stream.sock, events, sid)
        for key, events in self.selector.select():
            if key.fileobj == self.port:
                if events & selectors.EVENT_WRITE and not self._write_port():
                    return False
                if events & selectors.EVENT_READ and not self._read_port():
                    return False
            elif key.fileobj is self.listener:
                self._accept()
            elif key.data in self.streams:
                self._service(key.data, events)
        return True

    # --- the port ----------------------------------------------------------------------
    def _send(self, sid: int, kind: int, payload: bytes = b"") -> None:
        self.tx += HEADER.pack(sid, kind, len(payload)) + payload

    def _write_port(self) -> bool:
        try:
            sent = os.write(self.port, self.tx)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del self.tx[:sent]
        return True

    def _read_port(self) -> bool:
        try:
            data = os.read(self.port, 256 * 1024)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self.rx += data
        while len(self.rx) >= HEADER.size:
            sid, kind, length = HEADER.unpack_from(self.rx)
            if length > MAX_FRAME:
                raise MuxViolation(f"a frame of {length} bytes")
            if len(self.rx) < HEADER.size + length:
                break
            payload = bytes(self.rx[HEADER.size : HEADER.size + length])
            del self.rx[: HEADER.size + length]
            self._frame(sid, kind, payload)
        return True

    def _frame(self, sid: int, kind: int, payload: bytes) -> None:
        if kind == OPEN:
            if self.connect is None:
                raise MuxViolation("OPEN sent to the listening end")
            self._open(sid)
            return
        stream = self.streams.get(sid)
        if kind == DATA:
            if stream is None:
                return  # closed here meanwhile; the peer learns it from our CLOSE
            if stream.peer_eof or len(stream.out) + len(payload) > WINDOW:
                raise MuxViolation(f"stream {sid} sent past its window or its end")
            stream.out += payload
        elif kind == ACK:
            if len(payload) != 4:
                raise MuxViolation("a malformed ACK")
            if stream is not None:
                stream.in_flight = max(0, stream.in_flight - struct.unpack(">I", payload)[0])
        elif kind == EOF:
            if stream is not None:
                stream.peer_eof = True
                self._maybe_shut(sid, stream)
        elif kind == CLOSE:
            if stream is not None:
                self._drop(sid, notify=False)
        else:
            raise MuxViolation(f"unknown frame kind {kind}")

    # --- streams -----------------------------------------------------------------------
    def _accept(self) -> None:
        assert self.listener is not None
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        client.setblocking(False)
        sid = self.next_id
        self.next_id = self.next_id % 0xFFFFFFFF + 1
        self.streams[sid] = _Stream(client)
        self._send(sid, OPEN)

    def _open(self, sid: int) -> None:
        assert self.connect is not None
        if sid in self.streams or len(self.streams) >= MAX_STREAMS:
            self._send(sid, CLOSE)
            return
        try:
            sock = self.connect()
        except OSError:
            sock = None
        if sock is None:  # the proxy is gone (the sandbox is ending): refuse
            self._send(sid, CLOSE)
            return
        sock.setblocking(False)
        self.streams[sid] = _Stream(sock)

    def _service(self, sid: int, events: int) -> None:
        stream = self.streams[sid]
        try:
            if events & selectors.EVENT_WRITE and stream.out:
                sent = stream.sock.send(stream.out)
                del stream.out[:sent]
                stream.to_ack += sent
                if not stream.out or stream.to_ack >= WINDOW // 4:
                    self._send(sid, ACK, struct.pack(">I", stream.to_ack))
                    stream.to_ack = 0
                self._maybe_shut(sid, stream)
            if sid in self.streams and events & selectors.EVENT_READ:
                data = stream.sock.recv(min(MAX_FRAME, WINDOW - stream.in_flight))
                if data:
                    stream.in_flight += len(data)
                    self._send(sid, DATA, data)
                else:
                    stream.local_eof = True
                    self._send(sid, EOF)
                    self._maybe_shut(sid, stream)
        except BlockingIOError:
            pass
        except OSError:
            self._drop(sid, notify=True)

    def _maybe_shut(self, sid: int, stream: _Stream) -> None:
        """Half-close the socket once the peer is done and all it sent is written;
        forget the stream once both directions are done."""
        if stream.peer_eof and not stream.out:
            with contextlib.suppress(OSError):
                stream.sock.shutdown(socket.SHUT_WR)
            if stream.local_eof:
                self._drop(sid, notify=False)

    def _drop(self, sid: int, *, notify: bool) -> None:
        stream = self.streams.pop(sid)
        stream.sock.close()
        if notify:
            self._send(sid, CLOSE)
