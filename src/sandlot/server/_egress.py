"""The server's egress: one proxy for all its sandboxes, the operator's ceiling, the audit.

A tenant asks for a network policy when it creates a sandbox. The server accepts it
only within the operator's ceiling (``ServerSettings.egress``, ``sandlot serve
--egress-allow``) and, when the operator gave the tenant a narrower list of its own
(``sandlot keys create --egress-allow``), within that too: each ``allow_out`` entry must
be covered by a ceiling entry and each cap must be at most the ceiling's, else the
request is a 400 naming the entry.
The ceiling's ``deny_out`` is added to the sandbox's policy, and the server's proxy
holds every connection to the ceiling as well (so the up-front check is not the only
line). With the default, empty ceiling no tenant can enable network access.

Every connection the proxy finishes is written to the ``network_events`` table of the
audit trail by one writer thread (the proxy's callback must not block on a database),
in batches, through a bounded queue: when the writer falls behind by
:data:`AUDIT_QUEUE` records, further ones are folded into one summary row per sandbox
and verdict (their count kept) until it catches up. The proxy has already escaped,
capped and rate-limited what a sandbox can put in a record (see
:mod:`sandlot.egress`), so neither the queue nor the table can be flooded.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandlot import NetworkEvent, NetworkPolicy, PolicyError
from sandlot.egress import EgressProxy, StaticResolver, Summary, check_within
from sandlot.server._settings import ServerSettings
from sandlot.server._store import Store

log = logging.getLogger("sandlot.server")

CAPS = ("max_bytes_out", "max_bytes_in", "max_connections")
AUDIT_QUEUE = 10_000
"""Egress records waiting for the audit writer, at most (a few MiB: records are capped)."""
AUDIT_BATCH = 500
"""Records the writer puts in one transaction."""
_DEFAULT = NetworkPolicy()


class ServerEgress:
    """The proxy every network-enabled sandbox of this server uses, and its audit writer."""

    def __init__(self, settings: ServerSettings, store: Store) -> None:
        self.ceiling = settings.egress
        self.store = store
        resolver = None if settings.egress_hosts is None else StaticResolver(settings.egress_hosts)
        self.proxy = EgressProxy(
            resolver=resolver, on_event=self._queue_event, ceiling=self.ceiling
        )
        self._queue: queue.Queue[NetworkEvent | None] = queue.Queue(maxsize=AUDIT_QUEUE)
        self._behind: dict[tuple[str, str], Summary] = {}
        """Records that found the queue full, folded per (sandbox, verdict)."""
        self._behind_lock = threading.Lock()
        self._writer = threading.Thread(
            target=self._write_forever, name="sandlot-egress-audit", daemon=True
        )
        self._writer.start()

    def policy_for(
        self, requested: Mapping[str, Any] | None, tenant_allow: list[str] | None = None
    ) -> NetworkPolicy:
        """The policy a sandbox gets for what its tenant asked (the fields it set).

        Raises :class:`PolicyError` (400) for an invalid policy or one beyond the
        ceiling or the tenant's own allowlist (``tenant_allow``, None: none). Caps the
        tenant left out take the default or the ceiling's, whichever is lower; the
        ceiling's ``deny_out`` is appended.
        """
        if not requested or not requested.get("allow_out"):
            if requested:
                NetworkPolicy.coerce(requested)  # still refuse nonsense
            return _DEFAULT
        policy = NetworkPolicy.coerce(requested)
        lowered = {
            name: _lower(getattr(_DEFAULT, name), getattr(self.ceiling, name))
            for name in CAPS
            if name not in requested
        }
        policy = replace(
            policy,
            deny_out=(*policy.deny_out, *self.ceiling.deny_out),
            **lowered,  # type: ignore[arg-type]
        )
        problems = check_within(policy, self.ceiling)
        if not problems and tenant_allow is not None:
            own = NetworkPolicy(
                allow_out=tuple(tenant_allow),
                max_bytes_in=None,
                max_bytes_out=None,
                max_connections=None,
            )
            problems = [
                f"{problem} (this tenant's own list)" for problem in check_within(policy, own)
            ]
        if problems:
            raise PolicyError(
                "this server does not allow that network policy: "
                + "; ".join(problems)
                + " (the operator sets what tenants may allow: sandlot serve --egress-allow)"
            )
        return policy

    def close(self) -> None:
        """Close the proxy (every lease), then write what is queued and stop the writer."""
        self.proxy.close()
        self._queue.put(None)
        self._writer.join(timeout=30)

    def _queue_event(self, event: NetworkEvent) -> None:
        """The proxy's callback, on its loop: never blocks."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            why = f"the audit writer was {AUDIT_QUEUE} records behind"
            with self._behind_lock:
                self._behind.setdefault((event.sandbox, event.verdict), Summary(why)).add(event)

    def _write_forever(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while len(batch) < AUDIT_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            events = [event for event in batch if event is not None]
            # Records fold into _behind only while the queue is full, so the writer is
            # always woken again after them and writes their summary here.
            with self._behind_lock:
                behind, self._behind = self._behind, {}
            events += [summary.event() for summary in behind.values()]
            try:
                self.store.network_events([event.to_dict() for event in events])
            except Exception:
                log.exception("could not write %d egress records", len(events))


def policy_dict(policy: NetworkPolicy) -> dict[str, Any] | None:
    """The policy as the API shows it; None for no network."""
    if not policy.enabled:
        return None
    return {
        "allow_out": list(policy.allow_out),
        "deny_out": list(policy.deny_out),
        **{name: getattr(policy, name) for name in CAPS},
    }


def _lower(default: int | None, cap: int | None) -> int | None:
    if default is None:
        return cap
    return default if cap is None else min(default, cap)
