"""A sandbox attacking the egress records: floods of refusals with huge names, and names
that forge log lines. Real bwrap and Docker sandboxes on the module's proxy (see
conftest.py).

The records must stay bounded (a rate limit per sandbox, aggregated "N more" records
that keep the count) and every sandbox-chosen string in them and in the log must be
escaped and capped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from egress_helpers import Origin
from flood_code import ASK, FLOOD, FLOOD_SECONDS, FORGED, INJECT

from sandlot import NetworkEvent, NetworkPolicy, Sandbox
from sandlot.backends.bwrap import BwrapBackend
from sandlot.backends.docker import DockerBackend
from sandlot.egress import EgressProxy

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

BURST, RATE = 20, 1.0
"""EgressProxy's documented defaults: refusal records per sandbox before the rate limit,
then records per second."""
HOST_LIMIT, REASON_LIMIT = 255, 1024
KEPT = 1000
"""Records a lease keeps until they are collected (the rest are folded)."""
ESCAPED = FORGED.lower().replace("\n", "\\n").replace("\t", "\\t").replace("\x1b", "\\x1b")
"""The forged name as the records show it (the proxy lower-cases host names)."""


@pytest.fixture(
    params=[
        pytest.param(BwrapBackend, id="bwrap"),
        pytest.param(DockerBackend, marks=pytest.mark.requires_docker, id="docker"),
    ]
)
def sandbox(request: pytest.FixtureRequest, proxy: EgressProxy) -> Iterator[Sandbox]:
    # The records are bounded in the host's proxy, which every backend's sandboxes reach
    # through their own socket: a container's flood must be bounded the same way.
    network = NetworkPolicy(allow_out=("allowed.test",))
    sbx = Sandbox(backend=request.param(egress=proxy), network=network, timeout=600)
    try:
        yield sbx
    finally:
        sbx.kill()


def printable(text: str) -> bool:
    return text.isprintable()


def test_a_refusal_flood_gives_bounded_records_that_keep_the_count(
    sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sandlot.egress")
    execution = sandbox.run_code(FLOOD, timeout=120)
    assert execution.error is None, execution.error
    counts = json.loads(execution.logs.stdout[-1])
    attempts = counts["connect"] + counts["socks5"]
    assert counts["other"] == 0, counts
    # Without a bound this is thousands of records (one per connection).
    assert attempts > 4 * (BURST + RATE * FLOOD_SECONDS), f"the flood was too slow: {counts}"
    events: list[NetworkEvent] = execution.network or []
    bound = BURST + RATE * (counts["seconds"] + 2) + 2  # + one summary per verdict
    assert len(events) <= bound, f"{len(events)} records for {attempts} refusals"
    # Nothing is silently lost: the summaries carry the rest of the count.
    assert sum(event.count for event in events) == attempts
    assert all(event.verdict == "refused" for event in events)
    summaries = [event for event in events if event.count > 1]
    assert summaries and all("rate limit" in event.reason for event in summaries)
    for event in events:
        assert len(event.host) <= HOST_LIMIT and len(event.reason) <= REASON_LIMIT
    assert any(event.host.endswith(" chars]") for event in events)  # cut, and says so
    # The log is the same records, bounded the same way.
    logged = [r.getMessage() for r in caplog.records if r.name == "sandlot.egress"]
    assert len(logged) == len(events)
    assert all(len(message) <= 2 * HOST_LIMIT + REASON_LIMIT + 200 for message in logged)


def test_the_next_cell_starts_with_no_leftover_count(sandbox: Sandbox) -> None:
    """The summary of a cell's flood is reported with that cell, not later."""
    first = sandbox.run_code(FLOOD, timeout=120)
    counts = json.loads(first.logs.stdout[-1])
    assert sum(event.count for event in first.network or []) == (
        counts["connect"] + counts["socks5"]
    )
    assert sandbox.run_code("1").network == []


def test_forged_names_are_escaped_in_records_and_log(
    sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sandlot.egress")
    execution = sandbox.run_code(INJECT, timeout=120)
    assert execution.error is None, execution.error
    assert json.loads(execution.logs.stdout[-1]) == [True, True]
    events = execution.network or []
    assert sorted(event.method for event in events) == ["CONNECT", "SOCKS5"]
    for event in events:
        assert printable(event.host) and printable(event.reason), event
        assert event.host == ESCAPED
    logged = [r.getMessage() for r in caplog.records if r.name == "sandlot.egress"]
    assert len(logged) == 2
    for message in logged:
        assert printable(message), message
        assert ESCAPED in message


def test_a_lease_keeps_a_bounded_number_of_uncollected_records(
    proxy: EgressProxy, origin: Origin
) -> None:
    """Allowed connections are not rate-limited, but one cell cannot pile up more than
    KEPT records on the host: the rest are folded into a summary with their count."""
    network = NetworkPolicy(allow_out=(origin.entry,))
    tunnels = KEPT + 50
    code = (
        ASK
        + f"""
def tunnel():
    with socket.create_connection(("127.0.0.1", 3128), timeout=60) as s:
        s.sendall(b"CONNECT {origin.entry} HTTP/1.1\\r\\n\\r\\n")
        return s.recv(64).startswith(b"HTTP/1.1 200 ")
print(json.dumps(sum(tunnel() for _ in range({tunnels}))))
"""
    )
    with Sandbox(backend=BwrapBackend(egress=proxy), network=network, timeout=600) as sbx:
        execution = sbx.run_code(code, timeout=120)
        assert execution.error is None, execution.error
        assert json.loads(execution.logs.stdout[-1]) == tunnels
        events = execution.network or []
        assert len(events) <= KEPT + 1, len(events)
        counted = sum(event.count for event in events)
        for _ in range(10):  # a tunnel the relay had not seen closed yet comes next time
            if counted >= tunnels:
                break
            counted += sum(event.count for event in sbx.run_code("1").network or [])
        assert counted == tunnels
        assert all(event.verdict == "allowed" for event in events)
        (summary,) = [event for event in events if event.count > 1]
        assert summary.method == "SUMMARY" and "waiting to be collected" in summary.reason
