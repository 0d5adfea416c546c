"""The egress decisions, as pure functions of a :class:`NetworkPolicy` (no I/O).

A connection is decided twice:

1. :func:`check_destination` on what the sandbox asked for (``CONNECT host:port`` or
   the host of an absolute URI), before anything is resolved: ``deny_out`` first, then
   ``allow_out``. A name matches only name entries, an IP literal only IP/CIDR entries.
2. :func:`check_address` on each address the name resolved to on the host, right
   before connecting to exactly that address: ``deny_out`` IP/CIDR entries, then the
   reserved ranges below (loopback, private, link-local, CGNAT, multicast, metadata...),
   which only an ``allow_out`` IP/CIDR entry lying inside the range can open. So a
   public name that resolves (or is re-pointed, "DNS rebinding") to an internal address
   is refused, and ``0.0.0.0/0`` never opens loopback or the metadata endpoint.

A proxy may also have a *ceiling* (the operator's policy on a server): every decision
is then made against both policies, and :func:`check_within` tells up front whether a
requested policy asks for anything the ceiling does not allow.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from sandlot.policy import IPNetwork, NetworkPolicy, NetworkRule, normalise_host

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_N = ipaddress.ip_network

METADATA: tuple[IPNetwork, ...] = (
    _N("169.254.169.254/32"),  # AWS, GCP, Azure, OpenStack, DigitalOcean, ...
    _N("169.254.170.2/32"),  # AWS ECS task credentials
    _N("100.100.100.200/32"),  # Alibaba Cloud
    _N("fd00:ec2::254/128"),  # AWS over IPv6
)
"""Cloud metadata endpoints: credentials for the host's cloud identity live there."""

RESERVED: tuple[tuple[IPNetwork, str], ...] = (
    *((net, "a cloud metadata address") for net in METADATA),
    (_N("0.0.0.0/8"), "a 'this network' address"),
    (_N("10.0.0.0/8"), "a private address"),
    (_N("100.64.0.0/10"), "a shared (CGNAT) address"),
    (_N("127.0.0.0/8"), "a loopback address"),
    (_N("169.254.0.0/16"), "a link-local address"),
    (_N("172.16.0.0/12"), "a private address"),
    (_N("192.0.0.0/24"), "an IETF protocol address"),
    (_N("192.0.2.0/24"), "a documentation address"),
    (_N("192.88.99.0/24"), "a 6to4 relay address"),
    (_N("192.168.0.0/16"), "a private address"),
    (_N("198.18.0.0/15"), "a benchmarking address"),
    (_N("198.51.100.0/24"), "a documentation address"),
    (_N("203.0.113.0/24"), "a documentation address"),
    (_N("224.0.0.0/4"), "a multicast address"),
    (_N("240.0.0.0/4"), "a reserved address"),
    (_N("::/128"), "the unspecified address"),
    (_N("::1/128"), "a loopback address"),
    (_N("100::/64"), "a discard address"),
    (_N("2001::/23"), "an IETF protocol address"),
    (_N("2001:db8::/32"), "a documentation address"),
    (_N("fc00::/7"), "a private (unique local) address"),
    (_N("fe80::/10"), "a link-local address"),
    (_N("fec0::/10"), "a site-local address"),
    (_N("ff00::/8"), "a multicast address"),
)
"""Address ranges refused unless an ``allow_out`` IP/CIDR entry inside them names the
address. Anything else that is not globally routable is refused as well."""

_NAT64 = _N("64:ff9b::/96")


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    reason: str


def parse_host(host: str) -> str | IPAddress | None:
    """A requested host as an address (IP literal) or a normalised name; None if it is
    neither (the request is refused)."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return normalise_host(text)


def check_destination(policy: NetworkPolicy, host: str | IPAddress, port: int) -> Verdict:
    """Decide on the destination as requested, before any name is resolved."""
    if isinstance(host, str):
        for rule in policy.deny_rules:
            if rule.matches_name(host, port):
                return Verdict(False, f"{host}:{port} matches deny_out entry {rule.entry!r}")
        for rule in policy.allow_rules:
            if rule.matches_name(host, port):
                return Verdict(True, f"allow_out entry {rule.entry!r}")
        return Verdict(False, f"{host}:{port} is not in allow_out")
    address = _unwrap(host)
    for rule in policy.deny_rules:
        if rule.matches_address(address, port):
            return Verdict(False, f"{host} matches deny_out entry {rule.entry!r}")
    for rule in policy.allow_rules:
        if rule.matches_address(address, port):
            return Verdict(True, f"allow_out entry {rule.entry!r}")
    return Verdict(
        False,
        f"{host}:{port} is not in allow_out (an IP address is only allowed by an IP/CIDR "
        f"entry, never by a name)",
    )


def check_address(policy: NetworkPolicy, address: IPAddress, port: int) -> Verdict:
    """Decide on one resolved (or literal) address right before connecting to it."""
    address = _unwrap(address)
    for rule in policy.deny_rules:
        if rule.matches_address(address, port):
            return Verdict(False, f"{address} matches deny_out entry {rule.entry!r}")
    kind, block = reserved(address)
    if kind is None:
        return Verdict(True, "a public address")
    for rule in policy.allow_rules:
        if (
            rule.network is not None
            and rule.matches_address(address, port)
            and _inside(rule.network, block)
        ):
            return Verdict(True, f"{kind}, named by allow_out entry {rule.entry!r}")
    return Verdict(
        False,
        f"{address} is {kind}; only an allow_out IP/CIDR entry within {block} can open it",
    )


def check_within(policy: NetworkPolicy, ceiling: NetworkPolicy) -> list[str]:
    """Why ``policy`` asks for more than ``ceiling`` allows; [] when it does not.

    Every ``allow_out`` entry must be covered by one ``ceiling.allow_out`` entry (a name
    by that name, a wildcard above it or ``*``; an address or block by a block holding
    it, and, inside a reserved range, only by a block that itself lies in that range,
    as :func:`check_address` would open it), and every cap must be at most the
    ceiling's (no cap counts as infinite). ``deny_out`` entries only narrow a policy.
    """
    problems = []
    for index, rule in enumerate(policy.allow_rules):
        if not any(_covers(outer, rule) for outer in ceiling.allow_rules):
            problems.append(
                f"network.allow_out[{index}]: {rule.entry!r} is not within {_ceiling(ceiling)}"
            )
    for name in ("max_bytes_out", "max_bytes_in", "max_connections"):
        asked, cap = getattr(policy, name), getattr(ceiling, name)
        if cap is not None and (asked is None or asked > cap):
            problems.append(f"network.{name}: {asked} is more than the allowed {cap}")
    return problems


def _ceiling(ceiling: NetworkPolicy) -> str:
    if not ceiling.allow_out:
        return "the allowed destinations (none: network access is not allowed)"
    return f"the allowed destinations {list(ceiling.allow_out)}"


def _covers(outer: NetworkRule, inner: NetworkRule) -> bool:
    """Whether everything ``inner`` can open, ``outer`` opens too."""
    if outer.port is not None and outer.port != inner.port:
        return False
    if inner.domain is not None:
        if outer.domain is None:
            return False
        if outer.domain == "*":
            return True
        if outer.domain.startswith("*.") and inner.domain != "*":
            below = inner.domain[2:] if inner.domain.startswith("*.") else inner.domain
            return inner.domain == outer.domain or below.endswith(outer.domain[1:])
        return inner.domain == outer.domain
    if outer.network is None or inner.network is None:
        return False
    if not _inside(inner.network, outer.network):
        return False
    block = _reserved_block(inner.network)
    return block is None or _inside(outer.network, block)


def _reserved_block(network: IPNetwork) -> IPNetwork | None:
    """The reserved range an entry lies in (the one :func:`check_address` would name)."""
    for net, _ in RESERVED:
        if _inside(network, net):
            return net
    if network.num_addresses == 1:
        kind, block = reserved(network.network_address)
        return None if kind is None else block
    return None


def reserved(address: IPAddress) -> tuple[str | None, IPNetwork]:
    """(what kind of non-public address this is, its range), or (None, /32) if public."""
    address = _unwrap(address)
    for net, kind in RESERVED:
        if address.version == net.version and address in net:
            return kind, net
    single = ipaddress.ip_network(address)
    if not address.is_global or address.is_multicast:
        return "not a globally routable address", single
    return None, single


def _inside(rule: IPNetwork, block: IPNetwork) -> bool:
    return rule.version == block.version and rule.subnet_of(block)  # type: ignore[arg-type]


def _unwrap(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address stands for (mapped, NAT64, 6to4), if any: the
    checks apply to where packets actually go."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address
