"""The front door's connections to its nodes: HTTP/1.1 on asyncio, relayed with as
little work per call as the protocol allows.

A routed call is the front door's hot path (every cell of every sandbox in the
cluster passes through it), and a general HTTP client costs more than the relay
itself: an event object per header, body part and end of message, two socket writes
per request, one ASGI message per chunk the node wrote. Here a request is one write
(head and body together when the body is whole), and the answer is parsed straight
from the bytes as they arrive: every complete chunk already received goes to the
client as one piece, so a cell whose few NDJSON lines arrive together costs one read
and one write in the front door.

The peer is a sandlot node (the same server code, on the cluster's network), not an
arbitrary server; still, its answer is parsed strictly (a malformed head or chunk
closes the connection and ends the call as a cut stream) and its size is bounded
where it is buffered. The client side of the front door stays uvicorn's: nothing here
parses what a client sent.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import Final, cast

MAX_HEAD: Final = 64 * 1024
"""Bytes an answer's status line and headers may take."""
HIGH_WATER: Final = 256 * 1024
"""Bytes of a node's answer buffered before the front door stops reading from the
node (until its client has taken them): a slow client slows its node, it does not
fill the front door's memory."""
_CRLF: Final = b"\r\n"
_HEAD_END: Final = b"\r\n\r\n"
_NO_BODY: Final = frozenset({204, 304})
_HEX: Final = b"0123456789abcdefABCDEF"


class UpstreamError(Exception):
    """The node could not be reached, went away mid-call or answered malformed HTTP."""


class Answer:
    """A node's answer: status and headers (names lower-case; hop-by-hop framing ones
    left out), then :meth:`body`'s pieces. Give the connection back with
    :meth:`release` (after the body was read whole) or drop it with :meth:`abort`."""

    __slots__ = ("_chunked", "_conn", "_done", "_framed", "_length", "headers", "status")

    def __init__(
        self,
        conn: NodeConnection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        length: int | None,
        chunked: bool,
    ) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self._length = length
        self._chunked = chunked
        self._framed = chunked or length is not None
        self._done = length == 0

    async def next(self) -> tuple[bytes, bool]:
        """The next piece of the body (all that has arrived, possibly empty) and whether
        it is the last. Raises :class:`UpstreamError` if the node goes away first."""
        while True:
            step = self.ready()
            if step is not None:
                return step
            await self._conn.more()

    def ready(self) -> tuple[bytes, bool] | None:
        """What :meth:`next` would return without waiting, or None if it must wait."""
        if self._done:
            return b"", True
        conn = self._conn
        if self._chunked:
            piece, finished = conn.take_chunks()
            if piece or finished:
                self._done = finished
                return piece, finished
            return None
        remaining = self._length
        piece = conn.take(remaining)
        if piece:
            if remaining is not None:
                remaining -= len(piece)
                self._length = remaining
                self._done = remaining == 0
            return piece, self._done
        if conn.eof and remaining is None:
            self._done = True  # framed by the end of the connection
            return b"", True
        return None

    async def read(self, limit: int) -> bytes:
        """The whole body (at most ``limit`` bytes, else :class:`UpstreamError`)."""
        parts: list[bytes] = []
        size = 0
        last = False
        while not last:
            piece, last = await self.next()
            size += len(piece)
            if size > limit:
                raise UpstreamError(f"the node's answer is larger than {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    @property
    def has_body(self) -> bool:
        """Whether the status allows a body (not 204 or 304)."""
        return self.status not in _NO_BODY

    def release(self) -> None:
        """Give the connection back for the next call if the answer was read whole and
        the connection can carry another; else close it."""
        self._conn.finish(reusable=self._done and self._framed)

    def abort(self) -> None:
        self._conn.abort()


class NodeConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a node, one call at a time."""

    def __init__(self, pool: NodePool, key: str) -> None:
        self._pool = pool
        self._key = key
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused_writing = False
        self._paused_reading = False
        self.eof = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._chunk_left = 0  # bytes of the current chunk's data not yet taken
        self._chunk_crlf = False  # the CRLF after a chunk's data is still to come
        self._will_close = False

    # --- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; not an isinstance check: uvloop's transports do not derive
        # from asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > HIGH_WATER and not self._paused_reading and self._transport:
            self._paused_reading = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._pool.forget(self._key, self)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- reading -------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """Open, quiet and not closing: fit for the next call."""
        transport = self._transport
        return (
            transport is not None
            and not transport.is_closing()
            and not self.eof
            and not self._buffer
            and not self._will_close
        )

    async def more(self) -> None:
        """Wait until more bytes arrive (raises :class:`UpstreamError` at the end)."""
        if self.eof:
            raise UpstreamError(f"the node closed the connection mid-answer: {self.error}")
        if self._paused_reading and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self, at_most: int | None) -> bytes:
        buffer = self._buffer
        if not buffer:
            return b""
        if at_most is None or at_most >= len(buffer):
            piece = bytes(buffer)
            buffer.clear()
        else:
            piece = bytes(buffer[:at_most])
            del buffer[:at_most]
        return piece

    def take_chunks(self) -> tuple[bytes, bool]:
        """The data of every chunk (whole or begun) in the buffer, and whether the last
        chunk and its (empty) trailer were read. Raises UpstreamError if malformed."""
        buffer = self._buffer
        out = bytearray()
        pos = 0
        while True:
            if self._chunk_left:
                n = min(self._chunk_left, len(buffer) - pos)
                out += buffer[pos : pos + n]
                pos += n
                self._chunk_left -= n
                if self._chunk_left:
                    break
                self._chunk_crlf = True
            if self._chunk_crlf:
                if len(buffer) - pos < 2:
                    break
                if buffer[pos : pos + 2] != _CRLF:
                    raise UpstreamError("the node's chunked answer is malformed")
                pos += 2
                self._chunk_crlf = False
            end = buffer.find(_CRLF, pos)
            if end < 0:
                if len(buffer) - pos > 1024:
                    raise UpstreamError("the node's chunked answer is malformed")
                break
            size_text = bytes(buffer[pos:end]).split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16 or size_text.strip(_HEX):
                raise UpstreamError("the node's chunked answer is malformed")
            size = int(size_text, 16)
            if size == 0:
                # The last chunk: then trailers (sandlot sends none) and a blank line.
                trailer_end = buffer.find(_CRLF, end + 2)
                if trailer_end != end + 2:
                    if trailer_end < 0 and len(buffer) - end < 1024:
                        break  # wait for the rest of the trailer section
                    raise UpstreamError("the node's chunked answer has trailers")
                pos = end + 4
                del buffer[:pos]
                if buffer:
                    raise UpstreamError("the node sent bytes after its answer")
                return bytes(out), True
            pos = end + 2
            self._chunk_left = size
        del buffer[:pos]
        return bytes(out), False

    async def head(self, method: bytes) -> Answer:
        """Read the answer's status line and headers."""
        while True:
            end = self._buffer.find(_HEAD_END)
            if end >= 0:
                break
            if len(self._buffer) > MAX_HEAD:
                raise UpstreamError("the node's answer head is too large")
            await self.more()
        raw = bytes(self._buffer[:end])
        del self._buffer[: end + 4]
        lines = raw.split(_CRLF)
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise UpstreamError(f"the node's answer is not HTTP/1.1: {lines[0][:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise UpstreamError(f"the node's status line is malformed: {lines[0][:80]!r}") from None
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the front door never
            # asks for one, and the client's was answered by its own server. Skipped.
            return await self.head(method)
        if status < 200 or status > 599:
            raise UpstreamError(f"the node answered status {status}")
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        self._will_close = parts[0] == b"HTTP/1.0"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise UpstreamError("the node's answer has a malformed header")
            name = name.lower()
            value = value.strip()
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    raise UpstreamError("the node's Content-Length is malformed")
                length = int(value)
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked":
                    raise UpstreamError(f"the node's Transfer-Encoding is {value[:40]!r}")
                chunked = True
            elif name == b"connection":
                if b"close" in value.lower():
                    self._will_close = True
            else:
                headers.append((name, value))
        if chunked and length is not None:
            raise UpstreamError("the node's answer has both Content-Length and chunks")
        if method == b"HEAD" or status in _NO_BODY:
            length, chunked = 0, False
        elif not chunked and length is None:
            self._will_close = True  # framed by the end of the connection
        self._chunk_left, self._chunk_crlf = 0, False
        return Answer(self, status, headers, length, chunked)

    # --- writing -------------------------------------------------------------------------
    async def write(self, data: bytes | bytearray) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise UpstreamError(f"the connection to the node is closed: {self.error}")
        transport.write(data)
        if self._paused_writing:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
            if transport.is_closing():
                raise UpstreamError(f"the connection to the node is closed: {self.error}")

    # --- end of a call -------------------------------------------------------------------
    def finish(self, *, reusable: bool) -> None:
        if reusable and self.usable:
            self.idle_since = time.monotonic()
            self._pool.give_back(self._key, self)
        else:
            self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class NodePool:
    """Idle connections to the nodes, kept ``keepalive`` seconds at most (the nodes keep
    theirs longer, so the front door never sends a call on one the node is closing)."""

    def __init__(self, *, keepalive: float, per_node: int = 256, connect_timeout: float = 5.0):
        self._keepalive = keepalive
        self._per_node = per_node
        self._connect_timeout = connect_timeout
        self._idle: dict[str, list[NodeConnection]] = {}
        self._addresses: dict[str, tuple[str, int, bytes]] = {}

    def address(self, url: str) -> tuple[str, int, bytes]:
        """``(host, port, Host header)`` of a node's ``http://HOST:PORT`` URL."""
        known = self._addresses.get(url)
        if known is None:
            split = urllib.parse.urlsplit(url)
            if split.scheme != "http" or split.hostname is None:
                raise UpstreamError(f"a node's URL must be http://HOST:PORT, not {url!r}")
            known = (split.hostname, split.port or 80, split.netloc.encode("latin-1"))
            self._addresses[url] = known
        return known

    async def connection(self, url: str) -> tuple[NodeConnection, bool]:
        """A connection to the node at ``url``, and whether it was reused."""
        idle = self._idle.get(url)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self._keepalive:
                return conn, True
            conn.abort()
        host, port, _ = self.address(url)
        loop = asyncio.get_running_loop()
        try:
            # asyncio sets TCP_NODELAY on its TCP connections: a call's writes are
            # never held back for the node's delayed ACK.
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: NodeConnection(self, url), host, port),
                self._connect_timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn, False

    def give_back(self, url: str, conn: NodeConnection) -> None:
        idle = self._idle.setdefault(url, [])
        if len(idle) >= self._per_node:
            conn.abort()
            return
        idle.append(conn)

    def forget(self, url: str, conn: NodeConnection) -> None:
        idle = self._idle.get(url)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def request_head(
    method: bytes, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]]
) -> bytearray:
    """An HTTP/1.1 request's head. ``headers`` come from uvicorn's parser (no CR or LF
    can be in them) without the hop-by-hop ones; ``host`` is the node's."""
    out = bytearray(method)
    out += b" "
    out += target
    out += b" HTTP/1.1\r\nhost: "
    out += host
    out += _CRLF
    for name, value in headers:
        out += name
        out += b": "
        out += value
        out += _CRLF
    out += _CRLF
    return out
