"""Egress from a microVM: no network device, the host's proxy through the egress port.

A VM restored with a network policy reaches the host's egress proxy (a real one, on
this process, resolving only the test names) through its second virtio-serial port,
multiplexed (backends/microvm/egress_mux.py): pid 1 in the guest listens at the proxy
port on the guest's loopback. The proxy decides: an allowed name is reached, another
is refused with a 403, and each connection is recorded. Nothing else leaves the VM: no
network device, a direct connection fails, raw sockets are refused, and user code
cannot open the port itself. The mux's framing is checked against a hostile peer
without a VM.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from _fetch import FETCH
from sandlot import NetworkPolicy, Sandbox
from sandlot.backends.microvm import MicroVMBackend, egress_mux
from sandlot.egress import EgressProxy, StaticResolver

CELL_TIMEOUT = 120


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from origin"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def proxy() -> Iterator[EgressProxy]:
    names = {"allowed.test": "127.0.0.1", "other.test": "127.0.0.1"}
    egress = EgressProxy(resolver=StaticResolver(names), connect_timeout=5.0)
    try:
        yield egress
    finally:
        egress.close()


@pytest.fixture(scope="module")
def vm(proxy: EgressProxy, origin: int) -> Iterator[Sandbox]:
    # The origin's loopback address named explicitly: the proxy refuses a name that
    # resolves to loopback otherwise.
    network = NetworkPolicy(allow_out=("allowed.test", f"127.0.0.1:{origin}"))
    sbx = Sandbox(backend=MicroVMBackend(egress=proxy), network=network, timeout=900)
    try:
        yield sbx
    finally:
        sbx.kill()


def _json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(code, timeout=CELL_TIMEOUT)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


@pytest.mark.requires_microvm
@pytest.mark.slow
class TestInVM:
    def test_an_allowed_name_is_reached_and_another_refused(self, vm: Sandbox, origin: int) -> None:
        execution = vm.run_code(
            FETCH
            + f"""
print(json.dumps([fetch("http://allowed.test:{origin}/hello"),
                  fetch("http://other.test:{origin}/hello")]))
""",
            timeout=CELL_TIMEOUT,
        )
        assert execution.error is None, execution.error
        allowed, refused = json.loads("".join(execution.logs.stdout))
        assert allowed == {"status": 200, "body": "hello from origin"}
        assert refused["status"] == 403 and "not in allow_out" in refused["reason"]
        assert execution.network is not None
        verdicts = {event.host: event.verdict for event in execution.network}
        assert verdicts == {"allowed.test": "allowed", "other.test": "refused"}

    def test_many_connections_at_once_each_get_their_answer(self, vm: Sandbox, origin: int) -> None:
        got = _json(
            vm,
            FETCH
            + f"""
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(8) as pool:
    answers = list(pool.map(fetch, ["http://allowed.test:{origin}/hello"] * 16))
print(json.dumps(sorted({{a["status"] for a in answers}})))
""",
        )
        assert got == [200]

    def test_nothing_else_leaves_the_vm(self, vm: Sandbox, origin: int) -> None:
        got = _json(
            vm,
            f"""
import glob, json, os, socket
def attempt(make, address=None):
    try:
        s = make()
        if address is not None:
            s.settimeout(3)
            s.connect(address)
        return "open"
    except OSError as exc:
        return type(exc).__name__
ports = [p.rsplit("/", 1)[-1] for p in glob.glob("/sys/class/virtio-ports/*")]
print(json.dumps({{
    "links": sorted(os.listdir("/sys/class/net")),
    "direct": attempt(socket.socket, ("127.0.0.1", {origin})),
    "outside": attempt(socket.socket, ("10.0.2.2", 80)),
    "raw": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)),
    "packet": attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)),
    "ports": [attempt(lambda p=p: open("/dev/" + p, "r+b")) for p in ports],
}}))
""",
        )
        assert got["links"] == ["lo"]
        assert got["direct"] == "ConnectionRefusedError"  # the guest's own loopback
        assert got["outside"] in ("OSError", "TimeoutError")  # no route at all
        assert got["raw"] == got["packet"] == "PermissionError"
        assert got["ports"] and set(got["ports"]) == {"PermissionError"}

    def test_without_a_policy_there_is_no_door(self, origin: int) -> None:
        with Sandbox(backend=MicroVMBackend(), timeout=900) as sbx:
            got = _json(
                sbx,
                """
import json, os, socket
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=3)
    door = "open"
except OSError as exc:
    door = type(exc).__name__
print(json.dumps({"door": door, "proxy": os.environ.get("http_proxy")}))
""",
            )
        assert got == {"door": "ConnectionRefusedError", "proxy": None}


# --- the mux against a hostile peer, without a VM ---------------------------------------
def _host_mux(connect: Any) -> tuple[socket.socket, threading.Thread]:
    guest, host = socket.socketpair()
    mux = egress_mux.Mux(host.fileno(), connect=connect)

    def serve() -> None:
        try:
            mux.serve_forever()
        finally:
            host.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return guest, thread


def _frame(sid: int, kind: int, payload: bytes = b"") -> bytes:
    return egress_mux.HEADER.pack(sid, kind, len(payload)) + payload


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    head = b""
    while len(head) < egress_mux.HEADER.size:
        head += sock.recv(egress_mux.HEADER.size - len(head))
    sid, kind, length = egress_mux.HEADER.unpack(head)
    payload = b""
    while len(payload) < length:
        payload += sock.recv(length - len(payload))
    return sid, kind, payload


def test_mux_relays_a_stream_both_ways_with_half_close() -> None:
    upstream_here, upstream_there = socket.socketpair()
    guest, thread = _host_mux(lambda: upstream_there)
    guest.settimeout(10)
    upstream_here.settimeout(10)
    guest.sendall(_frame(7, egress_mux.OPEN) + _frame(7, egress_mux.DATA, b"ping"))
    guest.sendall(_frame(7, egress_mux.EOF))
    assert upstream_here.recv(4) == b"ping"
    assert upstream_here.recv(1) == b""  # the guest's half-close arrives as EOF
    upstream_here.sendall(b"pong")
    upstream_here.shutdown(socket.SHUT_WR)
    seen: dict[int, bytes] = {}
    while egress_mux.EOF not in seen:
        sid, kind, payload = _read_frame(guest)
        assert sid == 7
        seen[kind] = seen.get(kind, b"") + payload
    assert seen[egress_mux.DATA] == b"pong"
    assert struct.unpack(">I", seen[egress_mux.ACK])[0] == 4
    guest.close()
    thread.join(10)
    upstream_here.close()
    assert not thread.is_alive()


@pytest.mark.parametrize(
    "attack",
    [
        _frame(1, egress_mux.DATA, b"x")[:5] + struct.pack(">I", egress_mux.MAX_FRAME + 1),
        _frame(1, 99),
        _frame(1, egress_mux.OPEN)
        + b"".join(_frame(1, egress_mux.DATA, b"x" * egress_mux.MAX_FRAME) for _ in range(5)),
    ],
    ids=["oversized-frame", "unknown-kind", "past-the-window"],
)
def test_mux_closes_the_door_on_a_framing_violation(attack: bytes) -> None:
    upstream_here, upstream_there = socket.socketpair()
    upstream_here.setblocking(False)  # never read: the window is what bounds the host
    # Filled before the attack: had the host room to pass data on upstream, it would
    # acknowledge it, and more data past that would be within the window (no violation).
    upstream_there.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            upstream_there.send(b"\0" * 65536)
    guest, thread = _host_mux(lambda: upstream_there)
    guest.sendall(attack)
    thread.join(10)
    assert not thread.is_alive()
    for sock in (upstream_here, upstream_there, guest):
        sock.close()


def test_mux_refuses_streams_past_the_cap() -> None:
    made: list[socket.socket] = []

    def connect() -> socket.socket:
        here, there = socket.socketpair()
        made.append(here)
        return there

    guest, thread = _host_mux(connect)
    guest.settimeout(10)
    opens = b"".join(_frame(n, egress_mux.OPEN) for n in range(1, egress_mux.MAX_STREAMS + 2))
    guest.sendall(opens)
    assert _read_frame(guest) == (egress_mux.MAX_STREAMS + 1, egress_mux.CLOSE, b"")
    assert len(made) == egress_mux.MAX_STREAMS
    guest.close()
    thread.join(10)
    for sock in made:
        sock.close()
