"""The host-side egress proxy: one asyncio loop, one unix socket per sandbox.

A sandbox with a network policy gets a *lease*: a unix socket the proxy listens on,
mounted into that sandbox and into no other. The proxy knows which sandbox (and so
which policy) a connection belongs to only by the socket it arrived on; nothing the
sandbox sends can change that.

On each connection the proxy reads one request: an HTTP request head, or, when the
first byte is 5, a SOCKS5 greeting (both arrive on the same socket and port):

* ``CONNECT host:port``: decide, resolve on the host, check the address, connect,
  answer ``200`` and relay bytes both ways untouched (TLS stays end to end);
* ``METHOD http://host[:port]/path``: the same decision, then the request goes to that
  exact address in origin form with ``Connection: close`` and the response comes back;
* SOCKS5 ``CONNECT`` (RFC 1928, no authentication) to a name (``socks5h://``: the name
  is resolved here, on the host), an IPv4 or an IPv6 address: the same decision, then a
  relay like HTTP ``CONNECT``. Other SOCKS commands (BIND, UDP ASSOCIATE) are refused.

HTTP refusals are answered with ``403`` and the reason in the status line and body;
failures to resolve or connect with ``502``. SOCKS5 has no room for a reason: refusals
are reply ``0x02`` (not allowed by ruleset), failures ``0x04`` / ``0x05``, and the reason
is in the record. Every connection becomes one
:class:`sandlot.NetworkEvent` when it ends, kept on the lease until the SDK collects it
and passed to ``on_event`` and the ``sandlot.egress`` logger (the audit trail).

Records are bounded, because a sandbox chooses what is in them and how many there are:

* every string the sandbox chose (host, method, and the reasons that quote them) is
  escaped and capped (:func:`sandlot.safetext.escape`, :data:`HOST_LIMIT`,
  :data:`REASON_LIMIT`, :data:`METHOD_LIMIT`), so a record is one printable line of
  bounded size;
* refusal records (``refused`` and ``failed``) are rate-limited per sandbox (a burst,
  then a steady rate); the ones over the limit are folded into one summary record per
  verdict (``method`` :data:`SUMMARY`, ``count`` = how many), reported when the limit
  allows another record, when the SDK collects the records and when the lease closes,
  so the count of every connection is kept;
* a lease keeps at most :data:`KEPT_EVENTS` records until they are collected; more are
  folded into summaries the same way (``on_event`` and the log still get each one).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandlot._models import NetworkEvent, NetworkVerdict
from sandlot.egress._decide import (
    IPAddress,
    Verdict,
    check_address,
    check_destination,
    parse_host,
)
from sandlot.policy import NetworkPolicy
from sandlot.safetext import escape

log = logging.getLogger("sandlot.egress")

HEAD_LIMIT = 64 * 1024
"""Largest request head (request line + headers) the proxy reads."""
CHUNK = 64 * 1024
HOST_LIMIT = 255
"""Longest host name a record keeps (escaped; DNS names are at most 253 characters)."""
REASON_LIMIT = 1024
"""Longest reason a record keeps (escaped)."""
METHOD_LIMIT = 32
"""Longest method a record keeps (escaped)."""
KEPT_EVENTS = 1000
"""Records a lease keeps until :meth:`EgressLease.events` takes them; the rest are
folded into summaries (per verdict)."""
REFUSAL_BURST = 20
"""Refusal records (``refused``, ``failed``) a sandbox gets before the rate limit."""
REFUSAL_RATE = 1.0
"""Refusal records per second a sandbox gets after its burst."""
SUMMARY = "SUMMARY"
"""``NetworkEvent.method`` of a record that stands for ``count`` connections."""
_HOP_HEADERS = frozenset(
    {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "host", "te"}
)


class Resolver(Protocol):
    """Turns a host name into addresses, on the host (never inside the sandbox)."""

    async def resolve(self, host: str) -> list[IPAddress]:
        """Addresses for ``host`` in preference order; [] or OSError if it has none."""
        ...


class SystemResolver:
    """The host's resolver (``getaddrinfo``): /etc/hosts, DNS, as the host is set up."""

    async def resolve(self, host: str) -> list[IPAddress]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        found: list[IPAddress] = []
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if address not in found:
                found.append(address)
        return found


class StaticResolver:
    """Answers from a fixed table and nothing else: names it does not know do not
    resolve. For tests (``{"allowed.test": "127.0.0.1"}``) and air-gapped hosts."""

    def __init__(self, table: Mapping[str, str | Iterable[str]]) -> None:
        self.table: dict[str, list[IPAddress]] = {}
        for name, value in table.items():
            values = [value] if isinstance(value, str) else list(value)
            self.table[name.lower().rstrip(".")] = [ipaddress.ip_address(v) for v in values]

    async def resolve(self, host: str) -> list[IPAddress]:
        return list(self.table.get(host, []))


class _Refused(Exception):
    def __init__(
        self, status: int, verdict: NetworkVerdict, reason: str, socks: int | None = None
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.verdict = verdict
        self.reason = reason
        self.socks = socks if socks is not None else _SOCKS_REPLY.get(status, 0x01)
        """The SOCKS5 reply code for the same refusal."""


_SOCKS_REPLY = {403: 0x02, 400: 0x01}
"""HTTP status -> SOCKS5 reply: 0x02 'connection not allowed by ruleset', 0x01 'general
failure'. 502s say which (0x04 host unreachable, 0x05 connection refused)."""


class _Cut(Exception):
    """A byte cap was reached in the middle of a connection."""


@dataclass
class _Connection:
    """One connection's record while it is open."""

    time: float
    method: str = ""
    host: str = ""
    port: int = 0
    verdict: NetworkVerdict = "refused"
    reason: str = "no request"
    address: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class Summary:
    """Records of one sandbox and verdict folded into one (``method`` :data:`SUMMARY`).

    ``why`` says why they were folded; :meth:`add` takes records (summaries too, their
    ``count`` is added) and :meth:`event` is the summary record: ``count`` and the byte
    counts summed, ``time`` the first one's, ``host``, ``port`` and the quoted reason the
    last one's. Holds nothing else, so folding costs the same however many there are.
    """

    why: str
    count: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    first: float = 0.0
    last: NetworkEvent | None = None

    def add(self, event: NetworkEvent) -> None:
        if self.last is None:
            self.first = event.time
        self.count += event.count
        self.bytes_in += event.bytes_in
        self.bytes_out += event.bytes_out
        self.last = event

    def event(self) -> NetworkEvent:
        last = self.last
        if last is None:
            raise ValueError("an empty summary has no record")
        reason = (
            f"{self.count} {last.verdict} connections in one record ({self.why}); "
            f"the last to {last.host}:{last.port}: {last.reason}"
        )
        return NetworkEvent(
            sandbox=last.sandbox,
            host=last.host,
            port=last.port,
            verdict=last.verdict,
            reason=escape(reason, REASON_LIMIT),
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            method=SUMMARY,
            time=self.first,
            count=self.count,
        )


@dataclass
class _Bucket:
    """A token bucket: ``burst`` at once, then ``rate`` per second."""

    burst: int
    rate: float
    tokens: float = -1.0
    stamp: float = 0.0

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens, self.stamp = float(self.burst), now
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass(eq=False)
class EgressLease:
    """One sandbox's door through the proxy: its socket, policy, counters and records.

    Created by :meth:`EgressProxy.open`; the backend mounts :attr:`socket_path` into
    the sandbox and closes the lease when the sandbox ends.
    """

    proxy: EgressProxy
    sandbox: str
    policy: NetworkPolicy
    socket_path: str
    bytes_in: int = 0
    """Bytes relayed to the sandbox so far (all its connections)."""
    bytes_out: int = 0
    """Bytes relayed from the sandbox so far."""
    active: int = 0
    """Connections open now (counted against ``max_connections``)."""
    _handling: int = 0
    _events: list[NetworkEvent] = field(default_factory=list)
    _overflow: dict[str, Summary] = field(default_factory=dict)
    """Records beyond KEPT_EVENTS, by verdict, until taken (under _cond)."""
    _held: dict[str, Summary] = field(default_factory=dict)
    """Refusal records over the rate limit, by verdict, until reported (loop only)."""
    _bucket: _Bucket = field(default_factory=lambda: _Bucket(REFUSAL_BURST, REFUSAL_RATE))
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _closed: bool = False

    def events(self, settle: float = 0.0) -> list[NetworkEvent]:
        """Take the records of connections that ended since the last call.

        ``settle``: wait up to this many seconds for connections still open to end
        first (a cell that just read a response has usually closed its socket, but the
        relay may not have seen it yet). Connections open longer are reported by a
        later call, when they end. Refusals held back by the rate limit are reported
        now, as summaries, so the records taken account for every connection that
        ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._handling == 0, timeout=settle)
        self.proxy._report_held(self)
        with self._cond:
            taken, self._events = self._events, []
            overflow, self._overflow = self._overflow, {}
        return taken + [summary.event() for summary in overflow.values()]

    def close(self) -> None:
        """Stop listening, cut this sandbox's connections, remove its socket."""
        self.proxy._close_lease(self)

    # --- called on the proxy's loop -------------------------------------------------
    def _begin(self) -> None:
        with self._cond:
            self._handling += 1

    def _end(self, events: list[NetworkEvent], *, handled: bool = True) -> None:
        """Keep ``events`` (folding those beyond KEPT_EVENTS); ``handled``: one
        connection's handling is over."""
        with self._cond:
            for event in events:
                if len(self._events) < KEPT_EVENTS:
                    self._events.append(event)
                    continue
                why = f"more than {KEPT_EVENTS} records were waiting to be collected"
                self._overflow.setdefault(event.verdict, Summary(why)).add(event)
            if handled:
                self._handling -= 1
            self._cond.notify_all()

    def room(self, direction: str) -> int | None:
        """Bytes still allowed in ``direction`` ("in" or "out"), None: no cap."""
        if direction == "in":
            cap, used = self.policy.max_bytes_in, self.bytes_in
        else:
            cap, used = self.policy.max_bytes_out, self.bytes_out
        return None if cap is None else max(0, cap - used)


class EgressProxy:
    """The process-wide egress proxy (see the module docstring).

    :param resolver: how names are resolved on the host (default: the system's).
    :param on_event: called (on the proxy's thread) with every record, for an audit
        trail: each finished connection's :class:`NetworkEvent`, or, for refusals over
        the rate limit, the summary that counts them; must not block.
    :param connect_timeout: seconds to wait for a destination to accept.
    :param head_timeout: seconds a sandbox has to send its request head.
    :param ceiling: a policy every lease is held to as well as its own (an operator's
        limit on what sandboxes may be allowed, e.g. on a server): a connection must
        pass both. Its caps are not applied here; see
        :func:`sandlot.egress.check_within` to refuse a policy that asks for more.
    :param refusal_burst: refusal records (``refused``, ``failed``) each sandbox gets
        before the rate limit; the ones over it are folded into summary records.
    :param refusal_rate: refusal records per second each sandbox gets after its burst.
    """

    def __init__(
        self,
        *,
        resolver: Resolver | None = None,
        on_event: Callable[[NetworkEvent], None] | None = None,
        connect_timeout: float = 10.0,
        head_timeout: float = 30.0,
        ceiling: NetworkPolicy | None = None,
        refusal_burst: int = REFUSAL_BURST,
        refusal_rate: float = REFUSAL_RATE,
    ) -> None:
        if refusal_burst < 1 or not refusal_rate > 0:
            raise ValueError("refusal_burst must be at least 1 and refusal_rate above 0")
        self.refusal_burst = refusal_burst
        self.refusal_rate = refusal_rate
        self.resolver: Resolver = resolver or SystemResolver()
        self.ceiling = ceiling
        self.on_event = on_event
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dir: str | None = None
        self._leases: set[EgressLease] = set()

    # --- lifecycle (any thread) -----------------------------------------------------
    def open(
        self, sandbox: str, policy: NetworkPolicy, owner: tuple[int, int] | None = None
    ) -> EgressLease:
        """Start listening for one sandbox. ``owner``: (uid, gid) the socket is given
        to, when the sandbox runs as another host user than this process."""
        loop, directory = self._ensure_started()
        path = os.path.join(directory, f"{secrets.token_hex(8)}.sock")
        lease = EgressLease(self, sandbox, policy, path)
        lease._bucket = _Bucket(self.refusal_burst, self.refusal_rate)
        self._call(loop, self._listen(lease))
        try:
            if owner is not None:
                os.chown(path, *owner)
            os.chmod(path, 0o600)
        except OSError:
            lease.close()
            raise
        with self._lock:
            self._leases.add(lease)
        return lease

    def close(self) -> None:
        """Close every lease and stop the proxy's thread (it restarts on next use)."""
        with self._lock:
            leases = list(self._leases)
        for lease in leases:
            lease.close()
        with self._lock:
            loop, thread, directory = self._loop, self._thread, self._dir
            self._loop = self._thread = self._dir = None
        if loop is not None and thread is not None:
            # Finish every connection handler on the loop first: a coroutine left
            # suspended would be closed by the garbage collector, outside the loop.
            with contextlib.suppress(Exception):
                self._call(loop, _cancel_all())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def _ensure_started(self) -> tuple[asyncio.AbstractEventLoop, str]:
        with self._lock:
            if self._loop is None or self._dir is None:
                directory = tempfile.mkdtemp(prefix="sandlot-egress-")
                # Traversable (not listable) by the unprivileged uid sandboxes run as,
                # which must reach its own socket to mount it; each socket is 0600.
                os.chmod(directory, 0o711)
                atexit.register(shutil.rmtree, directory, True)
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="sandlot-egress", daemon=True
                )
                thread.start()
                self._loop, self._thread, self._dir = loop, thread, directory
            return self._loop, self._dir

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result(timeout=30)

    def _close_lease(self, lease: EgressLease) -> None:
        with self._lock:
            self._leases.discard(lease)
            loop = self._loop
        if loop is not None and not lease._closed:
            with contextlib.suppress(Exception):
                self._call(loop, self._stop(lease))
        with contextlib.suppress(OSError):
            os.unlink(lease.socket_path)

    # --- on the loop ----------------------------------------------------------------
    async def _listen(self, lease: EgressLease) -> None:
        lease._server = await asyncio.start_unix_server(
            lambda r, w: self._handle(lease, r, w), path=lease.socket_path, limit=HEAD_LIMIT
        )

    async def _stop(self, lease: EgressLease) -> None:
        lease._closed = True
        if lease._server is not None:
            lease._server.close()
        for writer in list(lease._writers):
            writer.close()
        if lease._server is not None:
            await lease._server.wait_closed()
        # Let the handlers see their closed sockets and write their records, so that a
        # closed lease has reported every connection; one stuck in a connect is cut.
        if lease._tasks:
            _, stuck = await asyncio.wait(list(lease._tasks), timeout=5.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self._emit(lease, [summary.event() for summary in _drain(lease._held)], handled=False)

    def _report_held(self, lease: EgressLease) -> None:
        """Report the refusals the rate limit holds back, as summaries (any thread)."""
        with self._lock:
            loop = self._loop

        async def report() -> None:
            held = [summary.event() for summary in _drain(lease._held)]
            if held:
                self._emit(lease, held, handled=False)

        if loop is not None and loop.is_running():
            with contextlib.suppress(Exception):
                self._call(loop, report())

    async def _handle(
        self, lease: EgressLease, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        lease._begin()
        conn = _Connection(time=time.time())
        task = asyncio.current_task()
        if task is not None:
            lease._tasks.add(task)
        lease._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        cap = lease.policy.max_connections
        # Counted from accept, before the request head arrives: a sandbox must not be
        # able to hold an unbounded number of host sockets by never finishing a request.
        counted = cap is None or lease.active < cap
        if counted:
            lease.active += 1
        try:
            try:
                if not counted:
                    raise _Refused(
                        403, "refused", f"the sandbox already has {cap} connections open"
                    )
                method, host, port, forward = await asyncio.wait_for(
                    self._read_request(reader, writer, conn), timeout=self.head_timeout
                )
                conn.method, conn.host, conn.port = method, host, port
                for direction in ("in", "out"):
                    if lease.room(direction) == 0:
                        raise _Refused(
                            403, "refused", f"the sandbox used up its max_bytes_{direction}"
                        )
                up_reader, upstream = await self._connect(lease, conn)
            except _Refused as refusal:
                conn.verdict, conn.reason = refusal.verdict, refusal.reason
                if conn.method == SOCKS:
                    writer.write(_socks_reply(refusal.socks))
                elif conn.method != SOCKS_GREETING:
                    writer.write(_refusal(refusal.status, refusal.reason))
                await writer.drain()
                await _linger(reader, writer)
                return
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                conn.reason = "no complete request head"
                return
            conn.verdict = "allowed"
            lease._writers.add(upstream)
            if method == SOCKS:
                writer.write(_socks_reply(0x00))
            elif forward is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.write(forward)
                _count(lease, conn, "out", len(forward))
            await self._relay(lease, conn, reader, writer, up_reader, upstream)
        except OSError:
            pass  # either side went away; the record says what was relayed until then
        finally:
            if counted:
                lease.active -= 1
            for w in (writer, upstream):
                if w is not None:
                    lease._writers.discard(w)
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
            self._record(lease, conn)
            lease._tasks.discard(task)

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection
    ) -> tuple[str, str, int, bytes | None]:
        """(method, host, port, head to send upstream or None for a tunnel)."""
        first = await reader.readexactly(1)
        if first == b"\x05":
            host, port = await _socks_request(reader, writer, conn)
            return SOCKS, host, port, None
        return _parse_head(first + await reader.readuntil(b"\r\n\r\n"))

    async def _connect(
        self, lease: EgressLease, conn: _Connection
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Decide, resolve and connect to the one address that was checked."""
        target = parse_host(conn.host)
        if target is None:
            raise _Refused(
                403, "refused", f"'{_shown(conn.host)}' is not a valid host name or address"
            )
        verdict = self._check(check_destination, lease.policy, target, conn.port)
        if not verdict.allowed:
            raise _Refused(403, "refused", verdict.reason)
        allowed_by = verdict.reason
        if isinstance(target, str):
            try:
                addresses = await asyncio.wait_for(
                    self.resolver.resolve(target), timeout=self.connect_timeout
                )
            except (OSError, TimeoutError) as exc:
                raise _Refused(502, "failed", f"cannot resolve {target}: {exc}", 0x04) from None
            if not addresses:
                raise _Refused(502, "failed", f"cannot resolve {target}", 0x04)
        else:
            addresses = [target]
        refusals: list[str] = []
        errors: list[str] = []
        for address in addresses:
            check = self._check(check_address, lease.policy, address, conn.port)
            if not check.allowed:
                refusals.append(check.reason)
                continue
            try:
                # A literal address: no second lookup that could answer differently.
                opened = await asyncio.wait_for(
                    asyncio.open_connection(str(address), conn.port, limit=CHUNK),
                    timeout=self.connect_timeout,
                )
            except (OSError, TimeoutError) as exc:
                errors.append(f"{address}: {exc or type(exc).__name__}")
                continue
            conn.address = str(address)
            conn.reason = allowed_by
            return opened
        if errors:
            raise _Refused(
                502,
                "failed",
                f"cannot connect to {conn.host}:{conn.port}: " + "; ".join(errors),
                0x05,
            )
        raise _Refused(403, "refused", f"{conn.host}: " + "; ".join(refusals))

    def _check(
        self,
        decide: Callable[[NetworkPolicy, Any, int], Verdict],
        policy: NetworkPolicy,
        target: Any,
        port: int,
    ) -> Verdict:
        """``decide`` under the lease's policy and then under the ceiling, if any."""
        verdict = decide(policy, target, port)
        if not verdict.allowed or self.ceiling is None:
            return verdict
        limit = decide(self.ceiling, target, port)
        if limit.allowed:
            return verdict
        return Verdict(False, f"{limit.reason} (the operator's egress limits)")

    async def _relay(
        self,
        lease: EgressLease,
        conn: _Connection,
        down_reader: asyncio.StreamReader,
        down: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up: asyncio.StreamWriter,
    ) -> None:
        pumps = [
            asyncio.create_task(_pump(lease, conn, down_reader, up, "out")),
            asyncio.create_task(_pump(lease, conn, up_reader, down, "in")),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in pumps:
                task.cancel()
            results = await asyncio.gather(*pumps, return_exceptions=True)
        for result in results:
            if isinstance(result, _Cut):
                conn.reason = str(result)

    def _record(self, lease: EgressLease, conn: _Connection) -> None:
        """The connection's record, escaped and capped, through the rate limit."""
        event = NetworkEvent(
            sandbox=lease.sandbox,
            host=escape(conn.host, HOST_LIMIT),
            port=conn.port,
            verdict=conn.verdict,
            reason=escape(conn.reason, REASON_LIMIT),
            address=conn.address,
            bytes_in=conn.bytes_in,
            bytes_out=conn.bytes_out,
            method=escape(conn.method, METHOD_LIMIT),
            time=conn.time,
        )
        emit: list[NetworkEvent] = []
        if event.verdict == "allowed":
            emit.append(event)
        else:
            # Held-back refusals first, when the limit allows: the summary comes
            # before the record that follows it.
            for verdict in list(lease._held):
                if not lease._bucket.take():
                    break
                emit.append(lease._held.pop(verdict).event())
            if not lease._held and lease._bucket.take():
                emit.append(event)
            else:
                why = (
                    f"rate limit on refusal records: {self.refusal_burst}, "
                    f"then {self.refusal_rate:g} per second"
                )
                lease._held.setdefault(event.verdict, Summary(why)).add(event)
        self._emit(lease, emit)

    def _emit(self, lease: EgressLease, events: list[NetworkEvent], handled: bool = True) -> None:
        """Log ``events``, keep them on the lease and pass them to ``on_event``."""
        for event in events:
            log.info(
                "egress %s %s %s %s:%s (%s) in=%d out=%d x%d: %s",
                event.sandbox,
                event.verdict,
                event.method or "-",
                event.host,
                event.port,
                event.address or "-",
                event.bytes_in,
                event.bytes_out,
                event.count,
                event.reason,
            )
        lease._end(events, handled=handled)
        if self.on_event is not None:
            for event in events:
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("egress on_event callback failed")


def _drain(held: dict[str, Summary]) -> list[Summary]:
    taken = list(held.values())
    held.clear()
    return taken


def _shown(text: str) -> str:
    """A sandbox-chosen host or target as a reason quotes it: escaped and capped."""
    return escape(text, HOST_LIMIT)


async def _pump(
    lease: EgressLease,
    conn: _Connection,
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter,
    direction: str,
) -> None:
    """Copy one direction, counting bytes against the sandbox's cap; half-close at EOF."""
    while True:
        data = await source.read(CHUNK)
        if not data:
            break
        room = lease.room(direction)
        cut = room is not None and len(data) > room
        if cut:
            data = data[:room]
        _count(lease, conn, direction, len(data))
        if data:
            sink.write(data)
            await sink.drain()
        if cut:
            cap = lease.policy.max_bytes_in if direction == "in" else lease.policy.max_bytes_out
            raise _Cut(f"cut: the sandbox reached max_bytes_{direction} ({cap} bytes)")
    if sink.can_write_eof():
        with contextlib.suppress(OSError):
            sink.write_eof()


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then read what the client already sent (briefly, boundedly): closing
    a socket with unread data resets it, and the client would lose the answer."""
    if writer.can_write_eof():
        writer.write_eof()
    budget = HEAD_LIMIT
    with contextlib.suppress(OSError, TimeoutError):
        while budget > 0:
            data = await asyncio.wait_for(reader.read(budget), timeout=1.0)
            if not data:
                break
            budget -= len(data)


def _count(lease: EgressLease, conn: _Connection, direction: str, n: int) -> None:
    if direction == "in":
        lease.bytes_in += n
        conn.bytes_in += n
    else:
        lease.bytes_out += n
        conn.bytes_out += n


SOCKS = "SOCKS5"
"""``NetworkEvent.method`` of a SOCKS5 CONNECT."""
SOCKS_GREETING = "SOCKS5 greeting"
"""Method recorded while (or when) the SOCKS5 greeting itself fails: nothing to reply."""


async def _socks_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection
) -> tuple[str, int]:
    """Read a SOCKS5 greeting and CONNECT request (the version byte is read already);
    return (host, port). Only "no authentication" and CONNECT are offered."""
    conn.method = SOCKS_GREETING
    methods = await reader.readexactly((await reader.readexactly(1))[0])
    if 0x00 not in methods:
        writer.write(b"\x05\xff")
        raise _Refused(400, "refused", "the SOCKS5 client offered no 'no authentication' method")
    writer.write(b"\x05\x00")
    version, command, _, kind = await reader.readexactly(4)
    conn.method = SOCKS
    if version != 5:
        raise _Refused(400, "refused", f"not a SOCKS5 request (version {version})")
    if kind == 0x01:
        host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
    elif kind == 0x04:
        host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
    elif kind == 0x03:
        name = await reader.readexactly((await reader.readexactly(1))[0])
        host = name.decode("latin-1").lower()
    else:
        raise _Refused(400, "refused", f"unknown SOCKS5 address type {kind}", 0x08)
    port = int.from_bytes(await reader.readexactly(2), "big")
    conn.host, conn.port = host, port
    if command != 0x01:
        raise _Refused(400, "refused", "only SOCKS5 CONNECT is supported (no BIND, no UDP)", 0x07)
    if port == 0:
        raise _Refused(400, "refused", "SOCKS5 CONNECT to port 0")
    return host, port


def _socks_reply(code: int) -> bytes:
    # The bound address is not meaningful here (and not the host's business to show).
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def _parse_head(head: bytes) -> tuple[str, str, int, bytes | None]:
    """(method, host, port, head to send upstream or None for CONNECT)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Refused(400, "refused", "not an HTTP proxy request")
    method, target, version = parts
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise _Refused(400, "refused", f"CONNECT needs host:port, not '{_shown(target)}'")
        return method, host.strip("[]").lower(), int(port), None
    url = urllib.parse.urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise _Refused(
            400,
            "refused",
            "plain requests must use an absolute http:// URL (use CONNECT for https)",
        )
    try:
        url_port = url.port or 80
    except ValueError:
        raise _Refused(400, "refused", f"bad port in '{_shown(target)}'") from None
    host = url.hostname.lower()
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    authority = f"[{host}]" if ":" in host else host
    if url.port:
        authority += f":{url.port}"
    headers = [
        line
        for line in lines[1:]
        if line and line.split(":", 1)[0].strip().lower() not in _HOP_HEADERS
    ]
    forward = "\r\n".join(
        [f"{method} {path} {version}", f"Host: {authority}", *headers, "Connection: close", "", ""]
    )
    return method, host, url_port, forward.encode("latin-1")


def _refusal(status: int, reason: str) -> bytes:
    title = (
        "Forbidden by sandlot egress policy" if status == 403 else "Bad Gateway (sandlot egress)"
    )
    if status == 400:
        title = "Bad Request (sandlot egress)"
    # The reason goes into the status line too: http.client reports a failed CONNECT
    # with only that line, and the code in the sandbox should see why.
    phrase = "".join(c if " " <= c <= "~" else "?" for c in f"{title}: {reason}")[:400]
    body = f"sandlot egress: {reason}\n".encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "X-Sandlot-Egress: refused\r\n"
        "\r\n"
    ).encode("latin-1") + body
