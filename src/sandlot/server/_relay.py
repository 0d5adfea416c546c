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

A sandbox's cell WebSocket goes to its node on a connection of its own
(:class:`NodeSocket`: wsproto's client on asyncio streams), never a pooled one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from typing import Final, cast

try:
    import wsproto
    import wsproto.connection
    import wsproto.events as ws
    import wsproto.utilities
except ImportError:  # a server without a WebSocket library still serves everything else
    WEBSOCKETS = False
else:
    WEBSOCKETS = True

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
        self.connect_timeout = connect_timeout
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
                self.connect_timeout,
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


# --- WebSockets ------------------------------------------------------------------------
SOCKET_HANDSHAKE_TIMEOUT: Final = 10.0
"""Seconds a node has to answer a WebSocket upgrade (it checks a key and a sandbox)."""
SOCKET_READ: Final = 64 * 1024
"""Bytes read from a node's WebSocket at once (the stream buffers at most twice that
before it stops reading the node)."""
SOCKET_MAX_MESSAGE: Final = 16 * 1024 * 1024
"""Bytes (characters, for text) of one message from a node the front door holds while
it reassembles it: uvicorn's own limit for a message from a client."""
SOCKET_QUIET: Final = 20.0
"""Seconds of silence from a node's WebSocket after which the front door pings it; a
node that answers nothing for as long again is gone (a cell may run silently for
hours, a node's server answers a ping within milliseconds)."""
SOCKET_WRITE_TIMEOUT: Final = 30.0
"""Seconds a node may take to accept a message (its server reads one as it comes)."""
_SOCKET_HANDSHAKE_HEADERS: Final = frozenset(
    {
        b"host",
        b"connection",
        b"upgrade",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"content-length",
        b"expect",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
    }
)


class SocketClosed:
    """A node's WebSocket ended: its close code (1006 when it ended without one)."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


class NodeSocket:
    """A WebSocket to a node: wsproto's client on asyncio streams, relayed message by
    message (text stays text, binary stays binary).

    Reads are bounded (:data:`SOCKET_READ` at a time, nothing read while the caller is
    busy with the last message, so a client that stops reading stops the reads from
    its node) and never wait forever on a dead node (:data:`SOCKET_QUIET`); writes wait
    for the node to take them, at most :data:`SOCKET_WRITE_TIMEOUT`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self._parts: list[str | bytes] = []
        self._size = 0
        self._pinged = False

    @classmethod
    async def open(
        cls,
        pool: NodePool,
        url: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
    ) -> NodeSocket:
        """Connect to the node at ``url`` and upgrade ``target`` with the client's
        ``headers`` (those of its handshake that the node reads: its key, its origin);
        :class:`UpstreamError` if the node cannot be reached, does not answer in time
        or refuses (whatever it said: the caller refuses its client without a word)."""
        if not WEBSOCKETS:
            raise UpstreamError("this front door has no WebSocket library (wsproto)")
        host, port, netloc = pool.address(url)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=SOCKET_READ), pool.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc}") from exc
        self = cls(reader, writer)
        try:
            async with asyncio.timeout(SOCKET_HANDSHAKE_TIMEOUT):
                await self._handshake(netloc.decode("latin-1"), target, headers)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, TimeoutError):
                raise UpstreamError("the node did not answer the WebSocket upgrade") from None
            if isinstance(exc, (OSError, wsproto.utilities.ProtocolError)):
                raise UpstreamError(f"the WebSocket upgrade to the node failed: {exc}") from exc
            raise
        return self

    async def _handshake(self, host: str, target: str, headers: list[tuple[bytes, bytes]]) -> None:
        extra = [(k, v) for k, v in headers if k not in _SOCKET_HANDSHAKE_HEADERS]
        self._writer.write(self._ws.send(ws.Request(host=host, target=target, extra_headers=extra)))
        read = 0
        while True:
            for event in self._ws.events():
                if isinstance(event, ws.AcceptConnection):
                    return
                if isinstance(event, ws.RejectConnection):
                    raise UpstreamError(f"the node refused the upgrade ({event.status_code})")
                raise UpstreamError(f"the node answered the upgrade with {type(event).__name__}")
            data = await self._reader.read(SOCKET_READ)
            read += len(data)
            if not data:
                raise UpstreamError("the node closed the connection during the upgrade")
            if read > MAX_HEAD:
                raise UpstreamError("the node's answer to the upgrade is too large")
            self._ws.receive_data(data)

    async def receive(self) -> str | bytes | SocketClosed:
        """The node's next whole message, or how the WebSocket ended (the closing
        handshake answered). :class:`UpstreamError` if the node breaks the protocol,
        sends a message over :data:`SOCKET_MAX_MESSAGE` or falls silent for good."""
        ws_conn = self._ws
        while True:
            for event in ws_conn.events():
                if isinstance(event, ws.Message):
                    self._parts.append(event.data)
                    self._size += len(event.data)
                    if self._size > SOCKET_MAX_MESSAGE:
                        raise UpstreamError(
                            f"a message from the node is larger than {SOCKET_MAX_MESSAGE} bytes"
                        )
                    if not event.message_finished:
                        continue
                    parts, self._parts, self._size = self._parts, [], 0
                    if len(parts) == 1:
                        return parts[0]
                    if isinstance(event, ws.TextMessage):
                        return "".join(cast(list[str], parts))
                    return b"".join(cast(list[bytes], parts))
                if isinstance(event, ws.Ping):
                    self._writer.write(ws_conn.send(event.response()))
                elif isinstance(event, ws.CloseConnection):
                    if ws_conn.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                        self._writer.write(ws_conn.send(event.response()))
                    return SocketClosed(event.code, event.reason or "")
                # Pongs: the answer to a ping, which the read below counted as life.
            data = await self._read()
            try:
                ws_conn.receive_data(data or None)  # None: the end, a close (1006) event
            except wsproto.utilities.ProtocolError as exc:
                raise UpstreamError(f"the node broke the WebSocket protocol: {exc}") from exc

    async def _read(self) -> bytes:
        while True:
            try:
                async with asyncio.timeout(SOCKET_QUIET):
                    data = await self._reader.read(SOCKET_READ)
            except TimeoutError:
                if self._pinged:
                    raise UpstreamError(
                        f"the node's WebSocket answered nothing for {2 * SOCKET_QUIET:g} s"
                    ) from None
                self._pinged = True
                self._writer.write(self._ws.send(ws.Ping(b"sandlot")))
                continue
            except OSError as exc:
                raise UpstreamError(f"the node's WebSocket failed: {exc}") from exc
            self._pinged = False
            return data

    async def send(self, data: str | bytes) -> None:
        """Send one message (:class:`UpstreamError` if the node is gone or stuck)."""
        try:
            event = ws.TextMessage(data) if isinstance(data, str) else ws.BytesMessage(data)
            self._writer.write(self._ws.send(event))
            async with asyncio.timeout(SOCKET_WRITE_TIMEOUT):
                await self._writer.drain()
        except TimeoutError:
            raise UpstreamError(
                f"the node took no message for {SOCKET_WRITE_TIMEOUT:g} s"
            ) from None
        except (OSError, wsproto.utilities.LocalProtocolError) as exc:
            raise UpstreamError(f"the node's WebSocket is closed: {exc}") from exc

    def close(self, code: int = 1000) -> None:
        """Start the closing handshake if the WebSocket is open, then close the
        connection once what was written has gone (the node's answer is not awaited)."""
        if self._ws.state is wsproto.connection.ConnectionState.OPEN:
            with contextlib.suppress(wsproto.utilities.LocalProtocolError):
                self._writer.write(self._ws.send(ws.CloseConnection(code=code)))
        self._writer.close()

    def abort(self) -> None:
        self._writer.transport.abort()
