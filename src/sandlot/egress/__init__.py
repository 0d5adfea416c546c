"""Egress: the only way out of a sandbox that has a network policy.

::

    sandbox (own network namespace, loopback only)
      code ──HTTP_PROXY──▶ 127.0.0.1:3128 (forwarder thread in the supervisor)
                               │ unix socket, mounted into this sandbox only
    host                       ▼
      EgressProxy ── policy of the lease the socket belongs to ── resolve on the host
                  ── check the address ── connect to exactly that address ── relay

The policy is :class:`sandlot.NetworkPolicy` (inert data in :mod:`sandlot.policy`);
the decisions are pure functions in :mod:`._decide`; the proxy and its per-sandbox
leases are in :mod:`._proxy`. One proxy per process serves every sandbox
(:func:`default_proxy`); pass your own to the backend
(``BwrapBackend(egress=EgressProxy(resolver=...))``) to change how names resolve or
to receive every record (``on_event``) for an audit trail. Records are escaped, capped
and, for refusals, rate-limited per sandbox into :class:`Summary` records that keep the
count (see :mod:`._proxy`).
"""

from __future__ import annotations

import threading

from sandlot.egress._decide import (
    METADATA,
    RESERVED,
    Verdict,
    check_address,
    check_destination,
    check_within,
)
from sandlot.egress._proxy import (
    SUMMARY,
    EgressLease,
    EgressProxy,
    Resolver,
    StaticResolver,
    Summary,
    SystemResolver,
)

__all__ = [
    "METADATA",
    "RESERVED",
    "SUMMARY",
    "EgressLease",
    "EgressProxy",
    "Resolver",
    "StaticResolver",
    "Summary",
    "SystemResolver",
    "Verdict",
    "check_address",
    "check_destination",
    "check_within",
    "default_proxy",
]

_DEFAULT: EgressProxy | None = None
_DEFAULT_LOCK = threading.Lock()


def default_proxy() -> EgressProxy:
    """The process-wide proxy (started on first use; its thread is a daemon)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = EgressProxy()
        return _DEFAULT
