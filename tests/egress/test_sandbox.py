"""Egress from real sandboxes: the policy, the proxy and the forwarder end to end.

Every sandbox here shares the module's proxy (one per process, as in production),
whose resolver knows only the test names (conftest.py); all servers are on loopback.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from egress_helpers import WHEEL_NAME, Origin

from sandlot import AsyncSandbox, NetworkPolicy, Sandbox
from sandlot.backends.bwrap import BwrapBackend
from sandlot.egress import EgressProxy

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

SANDBOX_TIMEOUT = 600
CELL_TIMEOUT = 120


def run_json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(code, timeout=CELL_TIMEOUT)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout))


FETCH = """
import http.client, json, urllib.request, urllib.error
def fetch(url, data=None, proxied=False):
    try:
        if proxied:
            # Explicitly through the forwarder, even for loopback addresses, which
            # NO_PROXY (and so urllib) sends direct.
            connection = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
            connection.request("POST" if data else "GET", url, body=data)
            response = connection.getresponse()
            body = response.read().decode("latin-1")
            connection.close()
            if response.status >= 400:
                return {"status": response.status, "reason": response.reason, "body": body}
            return {"status": response.status, "body": body}
        with urllib.request.urlopen(url, data=data, timeout=60) as response:
            return {"status": response.status, "body": response.read().decode("latin-1")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "reason": exc.reason, "body": exc.read().decode()}
    except Exception as exc:
        return {"status": None, "error": repr(exc)}
"""


@pytest.fixture
def make(proxy: EgressProxy) -> Iterator[Callable[..., Sandbox]]:
    started: list[Sandbox] = []

    def start(*allow: str, **settings: Any) -> Sandbox:
        network = NetworkPolicy.coerce({"allow_out": list(allow), **settings})
        sbx = Sandbox(backend=BwrapBackend(egress=proxy), network=network, timeout=SANDBOX_TIMEOUT)
        started.append(sbx)
        return sbx

    try:
        yield start
    finally:
        for sbx in started:
            sbx.kill()


@pytest.fixture(scope="module")
def shared(proxy: EgressProxy, origin: Origin) -> Iterator[Sandbox]:
    """A sandbox allowed allowed.test, pypi.test, internal.test and metadata.test (and
    the origin's loopback address, named explicitly)."""
    network = NetworkPolicy(
        allow_out=("allowed.test", "pypi.test", "internal.test", "metadata.test", origin.entry)
    )
    sbx = Sandbox(backend=BwrapBackend(egress=proxy), network=network, timeout=SANDBOX_TIMEOUT)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_urllib_reaches_an_allowed_name_and_each_connection_is_recorded(
    shared: Sandbox, origin: Origin
) -> None:
    execution = shared.run_code(
        FETCH
        + f"""
print(json.dumps([
    fetch("http://allowed.test:{origin.port}/hello"),
    fetch("http://other.test:{origin.port}/hello"),
]))
""",
        timeout=CELL_TIMEOUT,
    )
    assert execution.error is None, execution.error
    allowed, refused = json.loads("".join(execution.logs.stdout))
    assert allowed == {"status": 200, "body": "hello from origin"}
    assert refused["status"] == 403
    assert "other.test" in refused["reason"] and "not in allow_out" in refused["reason"]
    assert "sandlot egress" in refused["body"]

    assert execution.network is not None
    by_host = {event.host: event for event in execution.network}
    assert set(by_host) == {"allowed.test", "other.test"}
    ok, no = by_host["allowed.test"], by_host["other.test"]
    assert (ok.verdict, ok.port, ok.address) == ("allowed", origin.port, "127.0.0.1")
    assert ok.bytes_in > len("hello from origin") and ok.bytes_out > 0
    assert no.verdict == "refused" and no.bytes_in == no.bytes_out == 0
    assert {event.sandbox for event in execution.network} == {shared.sandbox_id}
    # The next cell reports only its own connections.
    assert shared.run_code("1").network == []


def test_https_style_tunnel_through_connect(shared: Sandbox, origin: Origin) -> None:
    """CONNECT (what clients use for https): the bytes inside the tunnel are untouched."""
    outcome = run_json(
        shared,
        f"""
import http.client, json
connection = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
connection.set_tunnel("allowed.test", {origin.port})
payload = bytes(range(256)) * 16
connection.request("POST", "/echo", body=payload)
body = connection.getresponse().read()
connection.close()
print(json.dumps(body == payload))
""",
    )
    assert outcome is True


def test_pip_download_from_a_local_index(shared: Sandbox, origin: Origin) -> None:
    command = shared.commands.run(
        "python -m pip download --no-cache-dir --disable-pip-version-check --no-deps "
        f"--index-url http://pypi.test:{origin.port}/simple/ --trusted-host pypi.test "
        "-d /home/user/downloads sandlotdemo && sha256sum /home/user/downloads/*",
        timeout=CELL_TIMEOUT,
    )
    assert command.exit_code == 0, command.stderr + command.stdout
    assert f"{origin.wheel_sha256}  /home/user/downloads/{WHEEL_NAME}" in command.stdout
    served = [r["path"] for r in origin.requests]
    assert "/simple/sandlotdemo/" in served and f"/files/{WHEEL_NAME}" in served


def test_a_name_resolving_to_private_or_metadata_addresses_is_refused(
    shared: Sandbox,
) -> None:
    outcome = run_json(
        shared,
        FETCH
        + """
print(json.dumps([fetch("http://internal.test/"),
                  fetch("http://metadata.test/latest/meta-data/")]))
""",
    )
    private, metadata = outcome
    assert private["status"] == 403 and "10.0.0.7 is a private address" in private["reason"]
    assert metadata["status"] == 403
    assert "169.254.169.254 is a cloud metadata address" in metadata["reason"]


def _host_addresses() -> list[str]:
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


def test_direct_connections_that_ignore_the_proxy_fail(shared: Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        targets = [(address, port) for address in _host_addresses()]
        targets += [("10.0.0.7", 80), ("169.254.169.254", 80)]
        outcome = run_json(
            shared,
            f"""
import json, socket
outcome = {{}}
for host, port in {targets!r}:
    try:
        socket.create_connection((host, port), timeout=10).close()
        outcome[host] = "CONNECTED"
    except OSError as exc:
        outcome[host] = exc.errno
print(json.dumps(outcome))
""",
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert outcome and all(value == errno.ENETUNREACH for value in outcome.values()), outcome


def test_the_sandbox_cannot_resolve_names_itself(shared: Sandbox) -> None:
    outcome = run_json(
        shared,
        """
import json, os, socket
def _sockets():
    import stat as _stat
    found = []
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "usr")]
        if root == "/opt/sandlot" and "template" in dirs:
            dirs.remove("template")
        for name in files:
            path = os.path.join(root, name)
            try:
                if _stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
            except OSError:
                pass
    return sorted(found)
resolved = {}
for name in ("allowed.test", "pypi.test", "localhost.localdomain.test", "example.com"):
    try:
        resolved[name] = str(socket.getaddrinfo(name, 80))
    except OSError:
        resolved[name] = None
print(json.dumps({"resolved": resolved, "resolv.conf": os.path.exists("/etc/resolv.conf"),
                  "sockets": _sockets()}))
""",
    )
    assert all(value is None for value in outcome["resolved"].values()), outcome
    assert outcome["resolv.conf"] is False
    # Its only door out: one socket (in its whole file system), its own.
    assert outcome["sockets"] == ["/opt/sandlot/egress.sock"]


def test_two_sandboxes_on_one_proxy_keep_their_own_allowances(
    make: Callable[..., Sandbox], origin: Origin, tmp_path_factory: pytest.TempPathFactory
) -> None:
    second_origin = Origin(tmp_path_factory.mktemp("second-origin"))
    try:
        first = make("allowed.test", origin.entry)
        second = make("other.test", second_origin.entry)
        urls = {
            "mine": f"http://allowed.test:{origin.port}/hello",
            "theirs": f"http://other.test:{second_origin.port}/hello",
            "their ip": f"http://127.0.0.1:{second_origin.port}/hello",
        }
        code = (
            FETCH + f"print(json.dumps({{k: fetch(u, proxied=True) for k, u in {urls!r}.items()}}))"
        )
        seen_first = run_json(first, code)
        assert seen_first["mine"]["status"] == 200
        assert seen_first["theirs"]["status"] == 403
        assert seen_first["their ip"]["status"] == 403

        urls = {
            "mine": f"http://other.test:{second_origin.port}/hello",
            "theirs": f"http://allowed.test:{origin.port}/hello",
            "their ip": f"http://127.0.0.1:{origin.port}/hello",
        }
        code = (
            FETCH + f"print(json.dumps({{k: fetch(u, proxied=True) for k, u in {urls!r}.items()}}))"
        )
        seen_second = run_json(second, code)
        assert seen_second["mine"]["status"] == 200
        assert seen_second["theirs"]["status"] == 403
        assert seen_second["their ip"]["status"] == 403
    finally:
        second_origin.close()


def test_byte_and_connection_caps_hold(make: Callable[..., Sandbox], origin: Origin) -> None:
    sbx = make("allowed.test", origin.entry, max_bytes_in=200_000, max_connections=2)
    execution = sbx.run_code(
        FETCH
        + f"""
import socket
big = fetch("http://allowed.test:{origin.port}/bytes/5000000")
after = fetch("http://allowed.test:{origin.port}/hello")
print(json.dumps({{"big": big.get("error") or len(big.get("body", "")), "after": after}}))
""",
        timeout=CELL_TIMEOUT,
    )
    assert execution.error is None, execution.error
    outcome = json.loads("".join(execution.logs.stdout))
    assert isinstance(outcome["big"], str) and "IncompleteRead" in outcome["big"], outcome
    assert outcome["after"]["status"] == 403
    assert "max_bytes_in" in outcome["after"]["reason"]
    assert execution.network is not None
    assert sum(event.bytes_in for event in execution.network) == 200_000

    capped = make("allowed.test", origin.entry, max_connections=2)
    outcome = run_json(
        capped,
        FETCH
        + f"""
import http.client
held = []
for _ in range(2):
    tunnel = http.client.HTTPConnection("127.0.0.1", 3128, timeout=60)
    tunnel.set_tunnel("allowed.test", {origin.port})
    tunnel.connect()
    held.append(tunnel)
third = fetch("http://allowed.test:{origin.port}/hello")
for tunnel in held:
    tunnel.close()
print(json.dumps(third))
""",
    )
    assert outcome["status"] == 403 and "already has 2 connections open" in outcome["reason"]


def test_without_a_policy_there_is_no_door(make: Callable[..., Sandbox]) -> None:
    sbx = make()  # empty allow_out: no network, as before this feature
    outcome = run_json(
        sbx,
        """
import json, os, socket
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=5).close()
    forwarder = "CONNECTED"
except OSError as exc:
    forwarder = exc.errno
print(json.dumps({"run": os.path.exists("/opt/sandlot/egress.sock"), "forwarder": forwarder,
                  "proxy_env": sorted(k for k in os.environ if "proxy" in k.lower())}))
""",
    )
    assert outcome == {"run": False, "forwarder": errno.ECONNREFUSED, "proxy_env": []}
    assert sbx.run_code("1").network is None


def test_async_sandbox_takes_a_network_policy(proxy: EgressProxy, origin: Origin) -> None:
    async def main() -> tuple[str, list[str]]:
        sbx = await AsyncSandbox.create(
            backend=BwrapBackend(egress=proxy),
            network={"allow_out": ["allowed.test", origin.entry]},
            timeout=SANDBOX_TIMEOUT,
        )
        try:
            execution = await sbx.run_code(
                FETCH + f"fetch('http://allowed.test:{origin.port}/hello')['body']",
                timeout=CELL_TIMEOUT,
            )
            return execution.text or "", [e.verdict for e in execution.network or []]
        finally:
            await sbx.kill()

    text, verdicts = asyncio.run(main())
    assert text == "'hello from origin'"
    assert verdicts == ["allowed"]


def test_cli_allow_out(origin: Origin) -> None:
    """``sandlot run --allow-out``, with the real process-wide proxy and resolver: an IP
    literal on loopback, which only an explicit entry can open."""
    code = FETCH + (
        f"print(json.dumps([fetch('http://127.0.0.1:{origin.port}/hello', proxied=True), "
        f"fetch('http://127.0.0.2:{origin.port}/hello', proxied=True)]))"
    )
    result = subprocess.run(
        [
            *(sys.executable, "-m", "sandlot", "run", "--json"),
            *("--allow-out", origin.entry, "--deny-out", "127.0.0.2", "-c", code),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    allowed, denied = json.loads(outcome["stdout"])
    assert allowed["body"] == "hello from origin"
    assert denied["status"] == 403 and "deny_out" in denied["reason"]
    assert sorted(event["verdict"] for event in outcome["network"]) == ["allowed", "refused"]


def test_socks5h_from_inside_the_sandbox(shared: Sandbox, origin: Origin) -> None:
    """A SOCKS5 client (remote DNS) on the forwarder's port: the same door, the same
    decisions; the name travels to the host, which resolves it."""
    outcome = run_json(
        shared,
        f"""
import json, socket
def socks5h(host, port, request):
    with socket.create_connection(("127.0.0.1", 3128), timeout=60) as s:
        s.sendall(b"\\x05\\x01\\x00")
        assert s.recv(2) == b"\\x05\\x00"
        name = host.encode()
        s.sendall(b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"))
        reply = s.recv(10)
        if reply[1] != 0:
            return reply[1]
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data.decode("latin-1")
request = b"GET /hello HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n"
print(json.dumps([socks5h("allowed.test", {origin.port}, request),
                  socks5h("other.test", {origin.port}, request)]))
""",
    )
    allowed, refused = outcome
    assert allowed.endswith("hello from origin")
    assert refused == 2  # "connection not allowed by ruleset"
