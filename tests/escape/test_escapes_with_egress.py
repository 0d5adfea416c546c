"""The escape suite again, with the egress proxy on: every sandbox has a network policy.

Every test of the escape modules listed in ``SUITE`` runs here a second time, against
sandboxes that have a socket to the host's egress proxy and the forwarder in their
supervisor (the fixtures below replace the plain ones). ``test_resources.py`` (bombs and
floods, nothing network-related) is left out to keep the suite's time bounded. Then the
attacks that only exist with the proxy: using it to reach the host's loopback, private
and metadata addresses by every spelling, and reaching another sandbox's socket.

The proxy's resolver is a fixed table (no outside lookups): ``allowed.test`` is on
every policy here and resolves to 127.0.0.1, which no policy here names, so even the
allowed name must be refused.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_controls
import test_environment
import test_filesystem
import test_network
import test_privilege
import test_python_tricks
import test_seccomp_abi
from escape_helpers import cell_json, host_ipv4_addresses, nothing_accepted

from sandlot import NetworkPolicy, Sandbox
from sandlot.backends.bwrap import BwrapBackend
from sandlot.egress import EgressProxy, StaticResolver

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

FIXTURE_TIMEOUT = 900
POLICY = NetworkPolicy(allow_out=("allowed.test", "*.allowed.test", "metadata.test", "*:443"))
NAMES = {
    "allowed.test": "127.0.0.1",
    "v6.allowed.test": "::1",
    "mapped.allowed.test": "::ffff:127.0.0.1",
    "private.allowed.test": "192.168.1.1",
    "metadata.test": "169.254.169.254",
}

SUITE = (
    test_controls,
    test_environment,
    test_filesystem,
    test_network,
    test_privilege,
    test_python_tricks,
    test_seccomp_abi,
)

# Every test (and module fixture) of those modules, collected again in this module,
# where the sandbox fixtures below take precedence over the ones in tests/conftest.py.
for _module in SUITE:
    for _name, _value in vars(_module).items():
        if _name.startswith("test_") or _name in ("host_secrets", "probed", "new_calls"):
            assert _name not in globals(), f"{_name} is defined twice in the escape suite"
            globals()[_name] = _value


@pytest.fixture(scope="module")
def egress_proxy() -> Iterator[EgressProxy]:
    proxy = EgressProxy(resolver=StaticResolver(NAMES), connect_timeout=5.0)
    try:
        yield proxy
    finally:
        proxy.close()


def _start(proxy: EgressProxy, **kwargs: Any) -> Sandbox:
    kwargs.setdefault("timeout", FIXTURE_TIMEOUT)
    kwargs.setdefault("network", POLICY)
    return Sandbox(backend=BwrapBackend(egress=proxy), **kwargs)


@pytest.fixture(scope="module")
def sandbox(egress_proxy: EgressProxy) -> Iterator[Sandbox]:
    sbx = _start(egress_proxy)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def fresh_sandbox(egress_proxy: EgressProxy) -> Iterator[Sandbox]:
    sbx = _start(egress_proxy)
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def make_sandbox(egress_proxy: EgressProxy) -> Iterator[Callable[..., Sandbox]]:
    started: list[Sandbox] = []

    def make(**kwargs: Any) -> Sandbox:
        sbx = _start(egress_proxy, **kwargs)
        started.append(sbx)
        return sbx

    try:
        yield make
    finally:
        for sbx in started:
            sbx.kill()


def test_the_fixtures_here_have_the_proxy(sandbox: Sandbox) -> None:
    """Control: this module really runs the suite with the egress proxy on."""
    assert sandbox.network == POLICY
    assert sandbox.commands.run("test -S /opt/sandlot/egress.sock").exit_code == 0


ATTACK = """
import json, socket
def ask(target, via):
    if via == "forwarder":
        s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect("/opt/sandlot/egress.sock")
    try:
        s.sendall(b"CONNECT " + target.encode() + b" HTTP/1.1\\r\\n\\r\\n")
        return s.recv(4096).split(b"\\r\\n", 1)[0].decode()
    except OSError as exc:
        return repr(exc)
    finally:
        s.close()
print(json.dumps({via + " " + t: ask(t, via) for t in TARGETS for via in ("forwarder", "socket")}))
"""


def test_the_proxy_refuses_every_spelling_of_host_internal_addresses(sandbox: Sandbox) -> None:
    with contextlib.ExitStack() as stack:
        loopback = stack.enter_context(socket.socket())
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        anywhere = stack.enter_context(socket.socket())
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        p = loopback.getsockname()[1]
        q = anywhere.getsockname()[1]
        targets = [
            f"127.0.0.1:{p}",
            f"localhost:{p}",
            f"127.1:{p}",
            f"2130706433:{p}",
            f"0x7f000001:{p}",
            f"[::1]:{p}",
            f"[::ffff:127.0.0.1]:{p}",
            f"0.0.0.0:{q}",
            f"allowed.test:{p}",  # allowed name, loopback address not named
            f"v6.allowed.test:{p}",
            f"mapped.allowed.test:{p}",
            "private.allowed.test:443",
            "metadata.test:80",
            "169.254.169.254:80",
            "[fd00:ec2::254]:80",
            "127.0.0.1:443",  # "*:443" is a name entry: it never opens an address
            *(f"{address}:{q}" for address in host_ipv4_addresses()),
        ]
        outcome = cell_json(sandbox, f"TARGETS = {targets!r}\n" + ATTACK, timeout=120)
        assert len(outcome) == 2 * len(targets)
        for attempt, answer in outcome.items():
            assert answer.startswith("HTTP/1.1 403 "), (attempt, answer)
        assert nothing_accepted(loopback)
        assert nothing_accepted(anywhere)


def test_a_sandbox_reaches_only_its_own_socket(
    make_sandbox: Callable[..., Sandbox], egress_proxy: EgressProxy
) -> None:
    first = make_sandbox()
    second = make_sandbox(network=NetworkPolicy(allow_out=("other.test",)))
    leases = {lease.sandbox: lease for lease in egress_proxy._leases}
    theirs = leases[second.sandbox_id].socket_path
    outcome = cell_json(
        first,
        f"""
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
outcome = {{"sockets": _sockets(),
            "proxy dir": os.path.exists({os.path.dirname(theirs)!r})}}
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({theirs!r})
    outcome["theirs"] = "CONNECTED"
except OSError as exc:
    outcome["theirs"] = exc.errno
print(json.dumps(outcome))
""",
    )
    assert outcome["sockets"] == ["/opt/sandlot/egress.sock"]
    assert outcome["proxy dir"] is False
    assert outcome["theirs"] != "CONNECTED"
    # And the host tells them apart by socket: the first sandbox's requests carry its
    # own id and policy, whatever they claim.
    execution = first.run_code(
        "import socket; s = socket.create_connection(('127.0.0.1', 3128), timeout=30);"
        "s.sendall(b'CONNECT other.test:80 HTTP/1.1\\r\\nX-Sandbox: "
        + second.sandbox_id
        + "\\r\\n\\r\\n'); s.recv(100); s.close()"
    )
    assert execution.error is None, execution.error
    assert [(e.sandbox, e.host, e.verdict) for e in execution.network or []] == [
        (first.sandbox_id, "other.test", "refused")
    ]
    assert leases[second.sandbox_id].events() == []


def test_killing_a_sandbox_closes_its_door(
    make_sandbox: Callable[..., Sandbox], egress_proxy: EgressProxy
) -> None:
    sbx = make_sandbox()
    [lease] = [lease for lease in egress_proxy._leases if lease.sandbox == sbx.sandbox_id]
    assert os.path.exists(lease.socket_path)
    sbx.kill()
    assert not os.path.exists(lease.socket_path)
    assert lease not in egress_proxy._leases
