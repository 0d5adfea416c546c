"""NetworkPolicy (inert data, validated) and the pure egress decisions."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest

from sandlot import NetworkPolicy, PolicyError
from sandlot.egress import check_address, check_destination, check_within
from sandlot.egress._decide import parse_host, reserved
from sandlot.policy import NetworkRule, SandboxSpec


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


# --- the policy as data ---------------------------------------------------------------


def test_default_is_no_network() -> None:
    assert NetworkPolicy().enabled is False
    assert SandboxSpec().network == NetworkPolicy()
    assert SandboxSpec().network.enabled is False
    assert NetworkPolicy.coerce(None) == NetworkPolicy()
    # A deny list alone opens nothing.
    assert NetworkPolicy(deny_out=["evil.example"]).enabled is False


def test_coerce_mapping_and_lists_become_tuples() -> None:
    policy = NetworkPolicy.coerce(
        {"allow_out": ["PyPI.org", "*.files.example:443"], "max_connections": 4}
    )
    assert policy.allow_out == ("PyPI.org", "*.files.example:443")
    assert policy.enabled and policy.max_connections == 4
    assert [r.domain for r in policy.allow_rules] == ["pypi.org", "*.files.example"]
    assert [r.port for r in policy.allow_rules] == [None, 443]
    assert NetworkPolicy.coerce(policy) is policy


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"allow": ["x.example"]}, "unknown network setting"),
        ({"allow_out": "pypi.org"}, "must be a list"),
        ({"allow_out": [42]}, "entries are strings"),
        ({"allow_out": [""]}, "empty entry"),
        ({"allow_out": ["https://pypi.org"]}, "not a host"),
        ({"allow_out": ["pypi.org/simple"]}, "not a host name, IP address or CIDR"),
        ({"allow_out": ["pypi.org:0"]}, "port must be"),
        ({"allow_out": ["pypi.org:99999"]}, "port must be"),
        ({"allow_out": ["pypi.org:http"]}, "port must be"),
        ({"allow_out": ["files.*.example"]}, "wildcard may only be"),
        ({"allow_out": ["*example.com"]}, "not a valid host name"),
        ({"allow_out": ["bad_label-.example"]}, "not a valid host name"),
        ({"allow_out": ["10.0.0.1/8"]}, "not a host name, IP address or CIDR"),
        ({"allow_out": ["300.1.1.1"]}, "not a host name, IP address or CIDR"),
        ({"allow_out": ["[fd00::1"]}, "unclosed"),
        ({"deny_out": ["a..b"]}, "network.deny_out[0]"),
        ({"max_bytes_in": 0}, "positive integer"),
        ({"max_connections": True}, "positive integer"),
        ([], "must be a NetworkPolicy or a mapping"),
    ],
    ids=repr,
)
def test_bad_policies_are_refused_with_the_field(value: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NetworkPolicy.coerce(value)


def test_spec_refuses_a_network_that_is_not_a_policy() -> None:
    with pytest.raises(PolicyError, match="NetworkPolicy"):
        SandboxSpec(network={"allow_out": ["x.example"]})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("entry", "domain", "network", "port"),
    [
        ("pypi.org", "pypi.org", None, None),
        ("PyPI.Org.", "pypi.org", None, None),
        ("api.internal.example:8443", "api.internal.example", None, 8443),
        ("*.files.example", "*.files.example", None, None),
        ("*", "*", None, None),
        ("*:443", "*", None, 443),
        ("bücher.example", "xn--bcher-kva.example", None, None),
        ("10.0.0.0/8", None, "10.0.0.0/8", None),
        ("10.1.2.3:80", None, "10.1.2.3/32", 80),
        ("fd00::/8", None, "fd00::/8", None),
        ("[fd00:ec2::254]:80", None, "fd00:ec2::254/128", 80),
        ("[::1]", None, "::1/128", None),
    ],
)
def test_entries_parse(
    entry: str, domain: str | None, network: str | None, port: int | None
) -> None:
    rule = NetworkRule.parse(entry, "test")
    assert rule.domain == domain
    assert (None if rule.network is None else str(rule.network)) == network
    assert rule.port == port


def test_wildcards_match_below_the_suffix_only() -> None:
    rule = NetworkRule.parse("*.files.example", "t")
    assert rule.matches_name("a.files.example", 443)
    assert rule.matches_name("b.a.files.example", 80)
    assert not rule.matches_name("files.example", 443)
    assert not rule.matches_name("evilfiles.example", 443)
    assert not rule.matches_name("files.example.evil", 443)
    ported = NetworkRule.parse("api.example:8443", "t")
    assert ported.matches_name("api.example", 8443)
    assert not ported.matches_name("api.example", 443)


# --- decisions before resolution ------------------------------------------------------


POLICY = NetworkPolicy(
    allow_out=["pypi.org", "*.files.example:443", "203.0.114.0/24", "10.9.0.0/16:5432", "*.corp"],
    deny_out=["secret.corp", "203.0.114.66"],
)


@pytest.mark.parametrize(
    ("host", "port", "allowed", "reason"),
    [
        ("pypi.org", 443, True, "'pypi.org'"),
        ("pypi.org", 8080, True, "'pypi.org'"),
        ("x.files.example", 443, True, "'*.files.example:443'"),
        ("x.files.example", 80, False, "not in allow_out"),
        ("files.example", 443, False, "not in allow_out"),
        ("evil.example", 443, False, "not in allow_out"),
        ("a.corp", 22, True, "'*.corp'"),
        ("secret.corp", 443, False, "deny_out entry 'secret.corp'"),
        ("203.0.114.10", 443, True, "'203.0.114.0/24'"),
        ("203.0.114.66", 443, False, "deny_out"),
        ("10.9.1.1", 5432, True, "'10.9.0.0/16:5432'"),
        ("10.9.1.1", 80, False, "never by a name"),
        # A name entry never implies an address, nor an address a name.
        ("151.101.0.223", 443, False, "never by a name"),
    ],
)
def test_check_destination(host: str, port: int, allowed: bool, reason: str) -> None:
    target = parse_host(host)
    assert target is not None
    verdict = check_destination(POLICY, target, port)
    assert verdict.allowed is allowed
    assert reason in verdict.reason


def test_unparseable_hosts_are_none() -> None:
    assert parse_host("exa mple.com") is None
    assert parse_host("a" * 300) is None
    assert parse_host("[::1]") == ip("::1")
    assert parse_host("Example.COM.") == "example.com"


# --- decisions on resolved addresses --------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.20.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "CGNAT"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "this network"),
        ("::", "unspecified"),
        ("255.255.255.255", "reserved"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        # IPv6 forms of internal IPv4 addresses are checked as the IPv4 address.
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:a00:1::1", "private"),
    ],
)
def test_internal_addresses_are_refused_by_default(address: str, kind: str) -> None:
    policy = NetworkPolicy(allow_out=["*"])
    verdict = check_address(policy, ip(address), 443)
    assert not verdict.allowed
    assert kind in verdict.reason


@pytest.mark.parametrize("address", ["151.101.0.223", "2a04:4e42::223", "8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert check_address(NetworkPolicy(allow_out=["*"]), ip(address), 443).allowed
    assert reserved(ip(address))[0] is None


def test_an_explicit_entry_inside_the_range_opens_an_internal_address() -> None:
    policy = NetworkPolicy(allow_out=["db.corp", "10.9.0.0/16:5432", "127.0.0.1:8080"])
    assert check_address(policy, ip("10.9.3.4"), 5432).allowed
    assert not check_address(policy, ip("10.9.3.4"), 80).allowed
    assert not check_address(policy, ip("10.10.0.1"), 5432).allowed
    assert check_address(policy, ip("127.0.0.1"), 8080).allowed
    assert not check_address(policy, ip("127.0.0.2"), 8080).allowed


def test_broad_blocks_never_open_loopback_private_or_metadata() -> None:
    policy = NetworkPolicy(allow_out=["0.0.0.0/0", "::/0", "169.254.0.0/16"])
    for address in ("127.0.0.1", "10.0.0.1", "::1", "169.254.169.254", "fd00:ec2::254"):
        assert not check_address(policy, ip(address), 80).allowed, address
    # 169.254.0.0/16 opens link-local, but the metadata endpoint needs its own entry.
    assert check_address(policy, ip("169.254.1.1"), 80).allowed
    assert not check_address(policy, ip("169.254.169.254"), 80).allowed
    named = NetworkPolicy(allow_out=["169.254.169.254"])
    assert check_address(named, ip("169.254.169.254"), 80).allowed


def test_deny_out_addresses_apply_to_resolved_addresses() -> None:
    policy = NetworkPolicy(allow_out=["*"], deny_out=["151.101.0.0/16"])
    verdict = check_address(policy, ip("151.101.0.223"), 443)
    assert not verdict.allowed and "deny_out" in verdict.reason


def test_container_runtimes_that_cannot_reach_the_socket_refuse_a_network_policy() -> None:
    """gVisor (without --host-uds) and VM runtimes cannot connect to a host unix socket:
    rather than run the code without the network its policy promises, the backend refuses
    before touching the engine or the proxy."""
    from sandlot import IsolationUnavailable
    from sandlot.backends.docker import DockerBackend, PodmanBackend

    spec = SandboxSpec(network=NetworkPolicy(allow_out=("pypi.org",)))
    for backend in (DockerBackend(runtime="runsc"), PodmanBackend(runtime="kata-runtime")):
        with pytest.raises(IsolationUnavailable, match="network policy"):
            backend.start(spec)


# --- a ceiling (the operator's limit on what a policy may allow) -------------------------


@pytest.mark.parametrize(
    ("ceiling", "asked"),
    [
        (["pypi.org"], ["pypi.org", "PyPI.org."]),
        (["pypi.org"], []),
        (["*.example.com"], ["a.example.com", "*.a.example.com", "*.example.com"]),
        (["*"], ["anything.test", "*.test", "*"]),
        (["pypi.org"], ["pypi.org:443"]),  # a port narrows
        (["10.0.0.0/8"], ["10.1.2.3", "10.9.0.0/16:8080"]),
        (["127.0.0.1:8080"], ["127.0.0.1:8080"]),
        (["169.254.169.254"], ["169.254.169.254:80"]),
        (["0.0.0.0/0"], ["8.8.8.8", "1.0.0.0/8"]),
    ],
)
def test_check_within_accepts_what_the_ceiling_covers(ceiling: list[str], asked: list[str]) -> None:
    assert check_within(NetworkPolicy(allow_out=asked), NetworkPolicy(allow_out=ceiling)) == []


@pytest.mark.parametrize(
    ("ceiling", "asked"),
    [
        ([], "pypi.org"),  # no ceiling entries: no network at all
        (["pypi.org"], "evil.test"),
        (["pypi.org:443"], "pypi.org"),  # any port is more than one port
        (["*.example.com"], "example.com"),
        (["*.example.com"], "*"),
        (["*"], "10.0.0.1"),  # a name entry never covers an address
        (["10.0.0.0/8"], "internal.test"),  # nor the other way round
        (["10.0.0.0/16"], "10.0.0.0/8"),
        # A broad block opens no reserved range, so it cannot let a tenant open one.
        (["0.0.0.0/0"], "127.0.0.1"),
        (["0.0.0.0/0"], "10.0.0.0/8"),
        (["169.254.0.0/16"], "169.254.169.254"),  # metadata needs its own entry
        (["::/0"], "fd00::1"),
    ],
)
def test_check_within_refuses_what_the_ceiling_does_not_cover(
    ceiling: list[str], asked: str
) -> None:
    problems = check_within(NetworkPolicy(allow_out=[asked]), NetworkPolicy(allow_out=ceiling))
    assert len(problems) == 1 and f"allow_out[0]: {asked!r} is not within" in problems[0]


def test_check_within_caps() -> None:
    ceiling = NetworkPolicy(allow_out=["*"], max_bytes_in=1000, max_connections=4)
    assert check_within(NetworkPolicy(allow_out=["a.test"], max_bytes_in=1000), ceiling) == [
        "network.max_connections: 32 is more than the allowed 4"
    ]
    unlimited = check_within(
        NetworkPolicy(allow_out=["a.test"], max_bytes_in=None, max_connections=2), ceiling
    )
    assert unlimited == ["network.max_bytes_in: None is more than the allowed 1000"]
    no_caps = NetworkPolicy(allow_out=["*"], max_bytes_in=None, max_bytes_out=None)
    assert check_within(NetworkPolicy(allow_out=["a.test"], max_bytes_in=None), no_caps) == []


def test_container_body_mounts_the_egress_socket_and_keeps_network_none() -> None:
    from sandlot.backends._runner_config import EGRESS_PORT, EGRESS_SOCKET_GUEST, egress_env
    from sandlot.backends.docker._compile import (
        ContainerLayout,
        build_create_body,
        runner_config,
    )

    layout = ContainerLayout(
        image="sandlot/python-data:x",
        protocol_dir="/host/protocol",
        runner_dir="/host/runner",
        seccomp="{}",
        sandbox_id="abc",
        owner="host:1",
        uid=100001,
        gid=100001,
        accounts_dir="/run/sandlot/host-ids/container-etc/100001",
    )
    spec = SandboxSpec(network=NetworkPolicy(allow_out=("pypi.org",)), envs={"NO_PROXY": "x"})
    with pytest.raises(ValueError, match="egress socket"):
        build_create_body(spec, layout)
    with_socket = dataclasses.replace(layout, egress_socket="/tmp/sandlot-egress-1/ab.sock")
    body = build_create_body(spec, with_socket)
    plain = build_create_body(SandboxSpec(), with_socket)
    host, plain_host = body["HostConfig"], plain["HostConfig"]
    assert host["NetworkMode"] == plain_host["NetworkMode"] == "none"
    assert body["NetworkDisabled"] is True
    added = [m for m in host["Mounts"] if m not in plain_host["Mounts"]]
    assert added == [
        {
            "Type": "bind",
            "Source": "/tmp/sandlot-egress-1/ab.sock",
            "Target": EGRESS_SOCKET_GUEST,
            "ReadOnly": True,
        }
    ]
    config = runner_config(spec)
    assert config["egress"] == {"socket": EGRESS_SOCKET_GUEST, "port": EGRESS_PORT}
    assert config["envs"] == {**egress_env(spec), "NO_PROXY": "x"}  # the caller's win
    assert "egress" not in runner_config(SandboxSpec())
