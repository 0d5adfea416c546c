"""Sandbox policy: inert data that every backend compiles into its own settings.

Nothing here has side effects. A backend turns a :class:`SandboxSpec` into native
configuration with a pure function (for bubblewrap, ``backends.bwrap._compile``),
which is golden-tested without privileges.

Every field states its default and what ``None`` means. Defaults are the safe,
conservative choice; anything that weakens isolation is named ``allow_*`` or
``unsafe_*`` and is off by default.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sandlot._exceptions import PolicyError

MiB = 1024 * 1024
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resources:
    """Limits for one sandbox. ``None`` means "no limit of this kind" (never the default).

    ``memory_mb``, ``pids`` and ``cpus`` hold for the sandbox as a whole (a cgroup);
    the per-process rlimits (``memory_mb`` again as address space, ``cpu_seconds``,
    ``file_size_mb``, ``open_files``) are a second layer. A sandbox whose cgroup
    limits cannot be applied does not start, unless the caller passes
    ``unsafe_best_effort_limits=True``.
    """

    memory_mb: int | None = 2048
    """Memory of the whole sandbox, MiB, swap off (cgroup ``memory.max``; files in the
    tmpfs workspace count too). Also each process's address space (RLIMIT_AS).
    Default 2048."""
    cpu_seconds: int | None = 600
    """CPU time per process over its life (RLIMIT_CPU), seconds. Default 600.
    The per-cell wall-clock ``timeout`` is the tighter bound in practice."""
    pids: int | None = 256
    """Processes and threads in the whole sandbox at once (cgroup ``pids.max``).
    Default 256."""
    cpus: float | None = 1.0
    """CPU bandwidth of the whole sandbox, in cores (cgroup CPU quota). Default 1.0."""
    disk_mb: int | None = 1024
    """Size of the writable workspace ``/home/user`` (a tmpfs), MiB. Default 1024."""
    tmp_mb: int | None = 256
    """Size of the private ``/tmp`` and of ``/dev/shm`` (tmpfs each), MiB. Default 256."""
    file_size_mb: int | None = 1024
    """Largest file any process may write (RLIMIT_FSIZE), MiB. Default 1024."""
    open_files: int | None = 1024
    """Open file descriptors per process (RLIMIT_NOFILE). Default 1024."""
    output_bytes: int | None = 1 * MiB
    """stdout + stderr a single cell or command may produce before it is truncated
    with a marker. Default 1 MiB."""
    max_results: int | None = 64
    """Rich results (displays, figures) per cell; extra ones are dropped with a marker."""
    result_bytes: int | None = 16 * MiB
    """Largest single rich result (e.g. one PNG), bytes. Default 16 MiB."""
    upload_bytes: int | None = 512 * MiB
    """Largest single ``files.write`` upload, bytes. Default 512 MiB. Checked by the host
    before sending (and as a stream grows) and again inside the sandbox; an upload over
    it raises InvalidArgumentError and leaves no partial file."""

    background_processes: int | None = 16
    """Background commands and terminals (``commands.run(background=True)``, ``pty``)
    alive at once in the sandbox; the next start raises ProcessLimitError. Default 16.
    They count against ``pids`` too."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cpus":
                if value is not None and (
                    not isinstance(value, int | float)
                    or isinstance(value, bool)
                    or not 0.01 <= value <= 1024
                ):
                    raise PolicyError(
                        f"resources.cpus must be a number of cores from 0.01 to 1024 or None, "
                        f"not {value!r}"
                    )
                continue
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise PolicyError(
                    f"resources.{f.name} must be a positive integer or None, not {value!r}"
                )

    @classmethod
    def coerce(cls, value: Resources | Mapping[str, Any] | None) -> Resources:
        """Accept a Resources, a mapping of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Resources):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise PolicyError(f"unknown resource(s) {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise PolicyError(f"resources must be a Resources or a mapping, not {type(value).__name__}")


# --- network ---------------------------------------------------------------------------

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


@dataclass(frozen=True, slots=True)
class NetworkRule:
    """One parsed ``allow_out`` / ``deny_out`` entry.

    Exactly one of ``domain`` and ``network`` is set. ``domain`` is a lower-case ASCII
    name, ``*.suffix`` (any name below ``suffix``, not ``suffix`` itself) or ``*`` (any
    name). ``network`` is an IP address or CIDR block; it matches only connections to
    that address (given literally, or a name that resolved to it), never a name.
    ``port`` None means any port.
    """

    entry: str
    """The entry as written (for messages)."""
    domain: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    @classmethod
    def parse(cls, entry: object, where: str) -> NetworkRule:
        if not isinstance(entry, str):
            raise PolicyError(f"{where}: entries are strings, not {type(entry).__name__}")
        text = entry.strip().lower()
        if not text:
            raise PolicyError(f"{where}: empty entry")
        if "://" in text:
            raise PolicyError(
                f"{where}: {entry!r} is not a host: write a name (pypi.org), a wildcard "
                f"(*.example.com), an IP or CIDR (10.0.0.0/8), each with an optional :port"
            )
        host, port = _split_port(text, entry, where)
        network = _ip_network(host, entry, where)
        if network is not None:
            return cls(entry, network=network, port=port)
        return cls(entry, domain=_domain_pattern(host, entry, where), port=port)

    def matches_name(self, host: str, port: int) -> bool:
        """Whether a connection to the (normalised) name ``host`` matches this rule."""
        if self.domain is None or (self.port is not None and self.port != port):
            return False
        if self.domain == "*":
            return True
        if self.domain.startswith("*."):
            return host.endswith(self.domain[1:])
        return host == self.domain

    def matches_address(
        self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
    ) -> bool:
        """Whether a connection to ``address`` matches this rule (IP/CIDR rules only)."""
        if self.network is None or (self.port is not None and self.port != port):
            return False
        return address.version == self.network.version and address in self.network


def _split_port(text: str, entry: str, where: str) -> tuple[str, int | None]:
    if text.startswith("["):  # [IPv6] or [IPv6/len], optional :port
        close = text.find("]")
        if close < 0:
            raise PolicyError(f"{where}: {entry!r} has an unclosed '['")
        host, rest = text[1:close], text[close + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise PolicyError(f"{where}: {entry!r}: expected ':port' after ']'")
        return host, _port(rest[1:], entry, where)
    if text.count(":") > 1:  # a bare IPv6 address or block: no port
        return text, None
    host, sep, port = text.partition(":")
    return host, _port(port, entry, where) if sep else None


def _port(text: str, entry: str, where: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise PolicyError(f"{where}: {entry!r}: the port must be a number from 1 to 65535")
    return int(text)


def _ip_network(host: str, entry: str, where: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(host, strict=True)
    except ValueError as exc:
        if "/" in host or ":" in host or re.fullmatch(r"[0-9.]+", host):
            # Looks like an address (or a URL path) but is not one: say so rather than
            # treat it as a host name that can never match.
            raise PolicyError(
                f"{where}: {entry!r} is not a host name, IP address or CIDR block ({exc})"
            ) from None
        return None


def _domain_pattern(host: str, entry: str, where: str) -> str:
    if host == "*":
        return "*"
    wildcard = host.startswith("*.")
    name = normalise_host(host[2:] if wildcard else host)
    if name is None or "*" in name:
        raise PolicyError(
            f"{where}: {entry!r} is not a valid host name (a wildcard may only be the "
            f"whole first label: *.example.com)"
        )
    return f"*.{name}" if wildcard else name


def normalise_host(host: str) -> str | None:
    """A host name in the form rules are matched in (lower case, ASCII/IDNA, no
    trailing dot), or None if it is not a valid DNS name."""
    host = host.strip().rstrip(".").lower()
    if not host or len(host) > 253:
        return None
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    labels = host.split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    return host


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkPolicy:
    """Where a sandbox may connect out, through sandlot's egress proxy.

    Empty ``allow_out`` (the default) means no network at all. Otherwise the sandbox
    still has no route out of its own network namespace; its only way out is the host's
    egress proxy, reached through a socket mounted into the sandbox, which allows a
    connection when the destination matches ``allow_out`` and nothing in ``deny_out``.

    Entries: ``"pypi.org"`` (that name), ``"*.example.com"`` (any name below it),
    ``"*"`` (any name), ``"10.1.2.3"`` / ``"10.0.0.0/8"`` / ``"[fd00::1]"`` (addresses),
    each with an optional ``:port`` (no port: any port). Names are resolved on the host;
    an address that is loopback, private, link-local, shared (CGNAT), multicast,
    reserved or a cloud metadata endpoint is refused unless an ``allow_out`` IP/CIDR
    entry inside that reserved range names it. A name entry never implies an address
    entry, nor the other way round.
    """

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    """Entries that are refused even when ``allow_out`` matches (checked first, and
    also against the addresses a name resolves to)."""
    max_bytes_out: int | None = 64 * MiB
    """Bytes the sandbox may send through the proxy over its life. Default 64 MiB."""
    max_bytes_in: int | None = 1024 * MiB
    """Bytes the sandbox may receive through the proxy over its life. Default 1 GiB."""
    max_connections: int | None = 32
    """Connections open through the proxy at once. Default 32."""
    allow_rules: tuple[NetworkRule, ...] = field(init=False, repr=False, compare=False)
    deny_rules: tuple[NetworkRule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("allow_out", "deny_out"):
            value = getattr(self, name)
            if isinstance(value, str | bytes) or not isinstance(value, Iterable):
                raise PolicyError(f"network.{name} must be a list of host entries")
            entries = tuple(value)
            rules = tuple(
                NetworkRule.parse(entry, f"network.{name}[{i}]") for i, entry in enumerate(entries)
            )
            object.__setattr__(self, name, entries)
            object.__setattr__(self, name.replace("_out", "_rules"), rules)
        for name in ("max_bytes_out", "max_bytes_in", "max_connections"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise PolicyError(f"network.{name} must be a positive integer or None")

    @property
    def enabled(self) -> bool:
        """True when the sandbox gets the egress proxy (``allow_out`` is not empty)."""
        return bool(self.allow_out)

    @classmethod
    def coerce(cls, value: NetworkPolicy | Mapping[str, Any] | None) -> NetworkPolicy:
        """Accept a NetworkPolicy, a mapping of its fields, or None (no network)."""
        if value is None:
            return cls()
        if isinstance(value, NetworkPolicy):
            return value
        if isinstance(value, Mapping):
            known = {"allow_out", "deny_out", "max_bytes_out", "max_bytes_in", "max_connections"}
            unknown = set(value) - known
            if unknown:
                raise PolicyError(
                    f"unknown network setting(s) {sorted(unknown)}; known: {sorted(known)}"
                )
            return cls(**value)
        raise PolicyError(
            f"network must be a NetworkPolicy or a mapping like "
            f'{{"allow_out": ["pypi.org"]}}, not {type(value).__name__}'
        )


DATA_STACK: tuple[str, ...] = ("numpy", "pandas", "matplotlib.pyplot")
"""What a warm pool or a zygote imports ahead of time: the data stack LLM-written cells
reach for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox."""

    template: str = "python-data"
    """Name of the template (the Python environment the sandbox sees read-only)."""
    resources: Resources = field(default_factory=Resources)
    envs: Mapping[str, str] = field(default_factory=dict)
    """Environment variables for everything in the sandbox, on top of the minimal
    ``PATH``, ``HOME`` and ``LANG``. Nothing from the host's environment is passed."""
    unsafe_best_effort_limits: bool = False
    """Start even when the host cannot enforce the whole-sandbox limits (no writable
    cgroup hierarchy): only the per-process rlimits then apply, and N processes can
    together use N times ``memory_mb``. Off by default: sandlot fails closed."""
    preload: tuple[str, ...] = ()
    """Modules the default kernel imports before the sandbox counts as ready (the warm
    pool's data stack). They land in ``sys.modules`` only, never in the user's
    namespace; a module that fails to import is skipped."""
    sandbox_id: str = ""
    """Names the sandbox in records (egress events); set by the SDK."""
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    """Where the sandbox may connect out. The default (empty ``allow_out``) is no
    network at all: a private network namespace with only its own loopback."""
    checkpointable: bool = False
    """Start the sandbox in the namespace layout CRIU can checkpoint, so that it can be
    paused, snapshotted and forked (docs/persistence.md). Needs root and CRIU 4.x; a
    bubblewrap cold start (not a zygote's fork); no network policy yet."""

    def __post_init__(self) -> None:
        for key, value in self.envs.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise PolicyError("envs must map str to str")
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise PolicyError(f"invalid environment variable name or value: {key!r}")
        if isinstance(self.preload, str) or not all(
            isinstance(name, str) and _MODULE_NAME.fullmatch(name) for name in self.preload
        ):
            raise PolicyError(f"preload must be a sequence of module names, not {self.preload!r}")
        object.__setattr__(self, "preload", tuple(self.preload))
        if not isinstance(self.network, NetworkPolicy):
            raise PolicyError("network must be a NetworkPolicy (use NetworkPolicy.coerce)")

    def with_resources(self, **changes: Any) -> SandboxSpec:
        return replace(self, resources=replace(self.resources, **changes))
