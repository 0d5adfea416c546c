"""The host-side egress proxy, driven through its unix sockets (no sandbox needed).

A client here stands where the sandbox's forwarder stands: it connects to a lease's
unix socket and speaks HTTP proxy requests. The destinations are real servers on
loopback (see conftest.py).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator

import pytest
from egress_helpers import Origin

from sandlot import NetworkEvent, NetworkPolicy
from sandlot.egress import EgressLease, EgressProxy, StaticResolver

TIMEOUT = 30.0


def exchange(lease: EgressLease, request: bytes) -> bytes:
    """Send ``request`` on a new connection to the lease; return everything answered."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(TIMEOUT)
        client.connect(lease.socket_path)
        client.sendall(request)
        return read_all(client)


def read_all(client: socket.socket) -> bytes:
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


def get(lease: EgressLease, url: str) -> bytes:
    return exchange(lease, f"GET {url} HTTP/1.1\r\nHost: ignored\r\n\r\n".encode())


def status(response: bytes) -> str:
    return response.split(b"\r\n", 1)[0].decode()


@pytest.fixture
def lease_for(proxy: EgressProxy) -> Iterator[object]:
    opened: list[EgressLease] = []

    def open_lease(*allow: str, **settings: object) -> EgressLease:
        policy = NetworkPolicy.coerce({"allow_out": list(allow), **settings})
        lease = proxy.open(f"sbx{len(opened)}", policy)
        opened.append(lease)
        return lease

    try:
        yield open_lease
    finally:
        for lease in opened:
            lease.close()


def test_plain_http_reaches_the_checked_address_in_origin_form(
    lease_for: object, origin: Origin
) -> None:
    lease = lease_for("allowed.test", origin.entry)  # type: ignore[operator]
    before = len(origin.requests)
    response = exchange(
        lease,
        f"GET http://allowed.test:{origin.port}/hello?x=1 HTTP/1.1\r\n"
        "Host: internal.test\r\nProxy-Authorization: Basic eDp5\r\n"
        "Proxy-Connection: keep-alive\r\n\r\n".encode(),
    )
    assert status(response).startswith("HTTP/1.0 200")
    assert response.endswith(b"hello from origin")
    seen = origin.requests[before]
    assert seen["path"] == "/hello?x=1"
    # The Host header is the URL's authority, whatever the client claimed.
    assert seen["headers"]["Host"] == f"allowed.test:{origin.port}"
    assert "Proxy-Authorization" not in seen["headers"]
    assert "Proxy-Connection" not in seen["headers"]
    assert seen["headers"]["Connection"] == "close"
    [event] = lease.events(settle=TIMEOUT)
    assert event.verdict == "allowed"
    assert (event.host, event.port, event.address) == ("allowed.test", origin.port, "127.0.0.1")
    assert event.method == "GET" and event.sandbox == "sbx0"
    assert event.bytes_in == len(response) and event.bytes_out > 0


def test_connect_tunnels_bytes_untouched(lease_for: object, origin: Origin) -> None:
    lease = lease_for("allowed.test", origin.entry)  # type: ignore[operator]
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(TIMEOUT)
        client.connect(lease.socket_path)
        client.sendall(f"CONNECT allowed.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
        assert client.recv(4096) == b"HTTP/1.1 200 Connection established\r\n\r\n"
        payload = bytes(range(256)) * 64
        client.sendall(
            b"POST /echo HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )
        response = read_all(client)
    assert response.endswith(payload)
    [event] = lease.events(settle=TIMEOUT)
    assert event.method == "CONNECT" and event.verdict == "allowed"
    assert event.bytes_out > len(payload) and event.bytes_in == len(response)


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("http://other.test:{port}/hello", "other.test:{port} is not in allow_out"),
        ("http://allowed.test.evil:{port}/hello", "is not in allow_out"),
        ("http://127.0.0.1:{port}/hello", "is not in allow_out"),
        ("http://localhost:{port}/hello", "is not in allow_out"),
        ("http://[::1]:{port}/hello", "is not in allow_out"),
        ("http://internal.test/", "10.0.0.7 is a private address"),
        ("http://metadata.test/latest/meta-data/", "169.254.169.254 is a cloud metadata address"),
        ("http://metadata6.test/", "fd00:ec2::254 is a cloud metadata address"),
        ("http://169.254.169.254/latest/meta-data/", "is not in allow_out"),
    ],
)
def test_refusals_are_403_with_the_reason(
    lease_for: object, origin: Origin, target: str, reason: str
) -> None:
    # allowed.test resolves to 127.0.0.1, which this policy does not name: refused too.
    lease = lease_for(  # type: ignore[operator]
        "allowed.test", "internal.test", "metadata.test", "metadata6.test"
    )
    before = len(origin.requests)
    response = get(lease, target.format(port=origin.port))
    expected = reason.format(port=origin.port)
    assert status(response).startswith("HTTP/1.1 403 Forbidden by sandlot egress policy")
    assert expected in status(response)
    assert expected in response.decode()
    assert len(origin.requests) == before
    [event] = lease.events(settle=TIMEOUT)
    assert event.verdict == "refused" and expected in event.reason
    assert event.bytes_in == event.bytes_out == 0 and event.address is None


def test_a_name_resolving_to_loopback_is_refused_unless_the_ip_is_named(
    lease_for: object, origin: Origin
) -> None:
    url = f"http://allowed.test:{origin.port}/hello"
    refused = get(lease_for("allowed.test"), url)  # type: ignore[operator]
    assert "127.0.0.1 is a loopback address" in status(refused)
    broad = get(lease_for("allowed.test", "0.0.0.0/0"), url)  # type: ignore[operator]
    assert "127.0.0.1 is a loopback address" in status(broad)
    allowed = get(lease_for("allowed.test", origin.entry), url)  # type: ignore[operator]
    assert allowed.endswith(b"hello from origin")


def test_deny_out_wins(lease_for: object, origin: Origin) -> None:
    lease = lease_for(  # type: ignore[operator]
        "*.test", origin.entry, deny_out=["other.test"]
    )
    assert get(lease, f"http://allowed.test:{origin.port}/hello").endswith(b"origin")
    refused = get(lease, f"http://other.test:{origin.port}/hello")
    assert "matches deny_out entry 'other.test'" in status(refused)


def test_leases_on_one_proxy_keep_their_own_policies(lease_for: object, origin: Origin) -> None:
    first = lease_for("allowed.test", origin.entry)  # type: ignore[operator]
    second = lease_for("other.test", origin.entry)  # type: ignore[operator]
    assert first.socket_path != second.socket_path
    ok = f"http://allowed.test:{origin.port}/hello"
    other = f"http://other.test:{origin.port}/hello"
    assert get(first, ok).endswith(b"origin")
    assert "not in allow_out" in status(get(first, other))
    assert get(second, other).endswith(b"origin")
    assert "not in allow_out" in status(get(second, ok))
    assert {e.sandbox for e in first.events(settle=TIMEOUT)} == {"sbx0"}
    assert {e.sandbox for e in second.events(settle=TIMEOUT)} == {"sbx1"}


def test_bytes_in_cap_cuts_the_connection_and_then_refuses(
    lease_for: object, origin: Origin
) -> None:
    cap = 100_000
    lease = lease_for("allowed.test", origin.entry, max_bytes_in=cap)  # type: ignore[operator]
    response = get(lease, f"http://allowed.test:{origin.port}/bytes/1000000")
    assert len(response) == cap  # exactly the cap, then the connection was closed
    [event] = lease.events(settle=TIMEOUT)
    assert event.bytes_in == cap and "max_bytes_in" in event.reason
    assert lease.bytes_in == cap
    after = get(lease, f"http://allowed.test:{origin.port}/hello")
    assert "used up its max_bytes_in" in status(after)


def test_bytes_out_cap(lease_for: object, origin: Origin) -> None:
    cap = 50_000
    lease = lease_for("allowed.test", origin.entry, max_bytes_out=cap)  # type: ignore[operator]
    body = b"y" * 200_000
    request = (
        f"POST http://allowed.test:{origin.port}/echo HTTP/1.1\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(TIMEOUT)
        client.connect(lease.socket_path)
        with pytest.raises(OSError):  # the proxy stops reading, then closes
            client.sendall(request)
            client.shutdown(socket.SHUT_WR)
            read_all(client)
            raise BrokenPipeError("the proxy read everything")
    [event] = lease.events(settle=TIMEOUT)
    assert event.bytes_out == cap and "max_bytes_out" in event.reason
    assert lease.bytes_out == cap


def test_connection_cap(lease_for: object, origin: Origin) -> None:
    lease = lease_for("allowed.test", origin.entry, max_connections=2)  # type: ignore[operator]
    held: list[socket.socket] = []
    try:
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX)
            held.append(client)
            client.settimeout(TIMEOUT)
            client.connect(lease.socket_path)
            client.sendall(f"CONNECT allowed.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
        third = get(lease, f"http://allowed.test:{origin.port}/hello")
        assert "already has 2 connections open" in status(third)
    finally:
        for client in held:
            client.close()
    # Closed tunnels free their slots.
    lease.events(settle=TIMEOUT)
    assert get(lease, f"http://allowed.test:{origin.port}/hello").endswith(b"origin")


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (b"GET /relative HTTP/1.1\r\n\r\n", "400 Bad Request"),
        (b"GET https://allowed.test/ HTTP/1.1\r\n\r\n", "use CONNECT for https"),
        (b"CONNECT allowed.test HTTP/1.1\r\n\r\n", "CONNECT needs host:port"),
        (b"hello\r\n\r\n", "not an HTTP proxy request"),
        (b"CONNECT exa_mple..test:443 HTTP/1.1\r\n\r\n", "not a valid host name"),
    ],
)
def test_malformed_requests_are_refused(
    lease_for: object, request_bytes: bytes, expected: str
) -> None:
    lease = lease_for("*")  # type: ignore[operator]
    response = exchange(lease, request_bytes)
    assert expected in response.decode()
    [event] = lease.events(settle=TIMEOUT)
    assert event.verdict == "refused"


def test_unresolvable_and_unreachable_destinations_fail_with_502(lease_for: object) -> None:
    lease = lease_for("*.test", "127.0.0.1")  # type: ignore[operator]
    unknown = get(lease, "http://nowhere.test/")
    assert status(unknown).startswith("HTTP/1.1 502") and "cannot resolve" in status(unknown)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, not listening: connection refused
        closed = get(lease, f"http://allowed.test:{port}/")
    assert status(closed).startswith("HTTP/1.1 502") and "cannot connect" in status(closed)
    verdicts = [e.verdict for e in lease.events(settle=TIMEOUT)]
    assert verdicts == ["failed", "failed"]


def test_socket_is_private_and_closing_the_lease_cuts_everything(origin: Origin) -> None:
    events: list[NetworkEvent] = []
    proxy = EgressProxy(
        resolver=StaticResolver({"allowed.test": "127.0.0.1"}), on_event=events.append
    )
    try:
        lease = proxy.open("sbx", NetworkPolicy(allow_out=("allowed.test", origin.entry)))
        mode = os.stat(lease.socket_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(lease.socket_path)).st_mode) == 0o711
        client = socket.socket(socket.AF_UNIX)
        client.settimeout(TIMEOUT)
        client.connect(lease.socket_path)
        client.sendall(f"CONNECT allowed.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        closer = threading.Thread(target=lease.close)
        closer.start()
        closer.join(TIMEOUT)
        assert read_all(client) == b""  # the tunnel was cut
        client.close()
        assert not os.path.exists(lease.socket_path)
        with socket.socket(socket.AF_UNIX) as late, pytest.raises(OSError):
            late.connect(lease.socket_path)
        assert [e.verdict for e in events] == ["allowed"]
    finally:
        proxy.close()


def test_a_ceiling_bounds_every_lease_of_its_proxy(origin: Origin) -> None:
    """An operator's ceiling (a server's egress allowlist) applies on top of each lease's
    own policy, at connect time: a lease cannot open what the ceiling does not."""
    ceiling = NetworkPolicy(allow_out=("allowed.test", origin.entry), deny_out=("127.0.0.2",))
    proxy = EgressProxy(
        resolver=StaticResolver({"allowed.test": "127.0.0.1", "other.test": "127.0.0.1"}),
        ceiling=ceiling,
    )
    try:
        lease = proxy.open("sbx", NetworkPolicy(allow_out=("*", "127.0.0.0/8")))
        assert get(lease, f"http://allowed.test:{origin.port}/hello").endswith(b"origin")
        beyond = get(lease, f"http://other.test:{origin.port}/hello")
        assert "403" in status(beyond) and "the operator's egress limits" in status(beyond)
        # The lease names all of loopback; the ceiling only the origin's port.
        port_beyond = get(lease, f"http://127.0.0.1:{origin.port - 1}/")
        assert "403" in status(port_beyond) and "operator" in status(port_beyond)
        denied = get(lease, f"http://127.0.0.2:{origin.port}/hello")
        assert "matches deny_out entry '127.0.0.2'" in status(denied)
        verdicts = [(e.host, e.verdict) for e in lease.events(settle=TIMEOUT)]
        assert verdicts == [
            ("allowed.test", "allowed"),
            ("other.test", "refused"),
            ("127.0.0.1", "refused"),
            ("127.0.0.2", "refused"),
        ]
    finally:
        proxy.close()


# --- SOCKS5 on the same socket ------------------------------------------------------


def socks_connect(
    lease: EgressLease,
    host: str | bytes,
    port: int,
    *,
    kind: int = 3,
    methods: bytes = b"\x00",
    command: int = 1,
) -> tuple[bytes, socket.socket]:
    """A SOCKS5 greeting and request on a new connection: (the replies, the socket)."""
    client = socket.socket(socket.AF_UNIX)
    client.settimeout(TIMEOUT)
    client.connect(lease.socket_path)
    client.sendall(b"\x05" + bytes([len(methods)]) + methods)
    greeting = client.recv(2)
    if greeting != b"\x05\x00":
        return greeting, client
    if kind == 3:
        name = host.encode() if isinstance(host, str) else host
        address = bytes([len(name)]) + name
    else:
        address = socket.inet_pton(socket.AF_INET if kind == 1 else socket.AF_INET6, str(host))
    client.sendall(bytes([5, command, 0, kind]) + address + port.to_bytes(2, "big"))
    reply = b""
    while len(reply) < 10:
        chunk = client.recv(10 - len(reply))
        if not chunk:
            break
        reply += chunk
    return greeting + reply, client


def test_socks5_connect_to_an_allowed_name_is_resolved_on_the_host(
    lease_for: object, origin: Origin
) -> None:
    lease = lease_for("allowed.test", origin.entry)  # type: ignore[operator]
    replies, client = socks_connect(lease, "allowed.test", origin.port)
    with client:
        assert replies == b"\x05\x00" + bytes([5, 0, 0, 1, 0, 0, 0, 0, 0, 0])
        client.sendall(b"GET /hello HTTP/1.0\r\nHost: allowed.test\r\n\r\n")
        assert read_all(client).endswith(b"hello from origin")
    (event,) = lease.events(settle=TIMEOUT)
    assert (event.method, event.host, event.port) == ("SOCKS5", "allowed.test", origin.port)
    assert (event.verdict, event.address) == ("allowed", "127.0.0.1")
    assert event.bytes_in > len("hello from origin") and event.bytes_out > 0


@pytest.mark.parametrize(
    ("host", "kind", "code", "reason"),
    [
        ("other.test", 3, 2, "other.test:{port} is not in allow_out"),
        ("internal.test", 3, 2, "10.0.0.7 is a private address"),
        ("127.0.0.2", 1, 2, "is not in allow_out"),
        ("::1", 4, 2, "is not in allow_out"),
        ("nowhere.test", 3, 4, "cannot resolve nowhere.test"),
        ("bad name!", 3, 2, "is not a valid host name"),
    ],
)
def test_socks5_refusals_use_the_same_decisions(
    lease_for: object, origin: Origin, host: str, kind: int, code: int, reason: str
) -> None:
    lease = lease_for(  # type: ignore[operator]
        "allowed.test", "internal.test", "nowhere.test", origin.entry
    )
    replies, client = socks_connect(lease, host, origin.port, kind=kind)
    with client:
        assert replies[:2] == b"\x05\x00" and replies[2:4] == bytes([5, code])
        assert read_all(client) == b""
    (event,) = lease.events(settle=TIMEOUT)
    assert event.method == "SOCKS5" and event.verdict in ("refused", "failed")
    assert reason.format(port=origin.port) in event.reason


def test_socks5_other_commands_and_authentication_are_refused(
    lease_for: object, origin: Origin
) -> None:
    lease = lease_for("allowed.test", origin.entry)  # type: ignore[operator]
    replies, client = socks_connect(lease, "allowed.test", origin.port, methods=b"\x02")
    client.close()
    assert replies == b"\x05\xff"  # only "no authentication" is offered
    replies, client = socks_connect(lease, "allowed.test", origin.port, command=2)  # BIND
    client.close()
    assert replies[2:4] == b"\x05\x07"
    replies, client = socks_connect(lease, "allowed.test", origin.port, command=3)  # UDP
    client.close()
    assert replies[2:4] == b"\x05\x07"
    with socket.socket(socket.AF_UNIX) as raw:
        raw.settimeout(TIMEOUT)
        raw.connect(lease.socket_path)
        raw.sendall(b"\x05\x01\x00\x05\x01\x00\x09")  # address type 9 does not exist
        assert read_all(raw)[2:4] == b"\x05\x08"
    events = lease.events(settle=TIMEOUT)
    assert [e.verdict for e in events] == ["refused"] * 4
    assert all(e.bytes_in == e.bytes_out == 0 for e in events)
