"""Egress through ``sandlot serve``: the API takes a network policy within the operator's
ceiling, remote mode returns ``Execution.network`` as local mode does, and every
connection lands in the server's audit trail.

A real server subprocess on loopback; its proxy resolves names only from a hosts file
(``--egress-hosts``) that maps the test names to loopback and internal addresses, so
nothing is ever looked up outside. The origin is a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from egress_helpers import TEST_NAMES, WHEEL_NAME, Origin

from _fetch import FETCH
from _server_harness import ServerProcess
from sandlot import PolicyError, Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

CELL_TIMEOUT = 120


class EgressServer:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.alice = server.key("alice")
        self.bob = server.key("bob")

    def sandbox(self, key: str, network: dict[str, Any]) -> Sandbox:
        return Sandbox(api_url=self.server.url, api_key=key, network=network, timeout=600)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def audit(self, sandbox_id: str, count: int) -> list[dict[str, Any]]:
        """The sandbox's network rows in the audit trail, once there are ``count``."""
        deadline = time.monotonic() + 30
        while True:
            done = self.server.cli("audit", "--network", "--json", "--sandbox", sandbox_id)
            rows = [json.loads(line) for line in done.stdout.splitlines()]
            if len(rows) >= count or time.monotonic() > deadline:
                return rows
            time.sleep(0.2)


def hosts_file(path: Path) -> Path:
    path.write_text("".join(f"{address} {name}\n" for name, address in TEST_NAMES.items()))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, origin: Origin) -> Iterator[EgressServer]:
    state = tmp_path_factory.mktemp("egress-server")
    server = ServerProcess(
        state,
        *("--egress-hosts", str(hosts_file(state / "hosts"))),
        *("--egress-allow", "allowed.test", "--egress-allow", "other.test"),
        *("--egress-allow", "pypi.test", "--egress-allow", "internal.test"),
        *("--egress-allow", origin.entry, "--egress-deny", "other.test:1"),
        *("--egress-max-connections", "8"),
    ).start()
    try:
        yield EgressServer(server)
    finally:
        server.stop()


def test_remote_mode_returns_the_network_records_and_the_audit_trail_keeps_them(
    served: EgressServer, origin: Origin
) -> None:
    with served.sandbox(served.alice, {"allow_out": ["allowed.test", origin.entry]}) as sbx:
        # The policy in force, as the server applied it: its cap and deny_out added.
        assert sbx.network.allow_out == ("allowed.test", origin.entry)
        assert sbx.network.deny_out == ("other.test:1",)
        assert sbx.network.max_connections == 8
        execution = sbx.run_code(
            FETCH + f"print(json.dumps([fetch('http://allowed.test:{origin.port}/hello'), "
            f"fetch('http://other.test:{origin.port}/hello')]))",
            timeout=CELL_TIMEOUT,
        )
        assert execution.error is None, execution.error
        allowed, refused = json.loads("".join(execution.logs.stdout))
        assert allowed == {"status": 200, "body": "hello from origin"}
        assert refused["status"] == 403 and "not in allow_out" in refused["reason"]

        assert execution.network is not None
        events = {event.host: event for event in execution.network}
        assert set(events) == {"allowed.test", "other.test"}
        ok, no = events["allowed.test"], events["other.test"]
        assert (ok.verdict, ok.port, ok.address, ok.method) == (
            "allowed",
            origin.port,
            "127.0.0.1",
            "GET",
        )
        assert ok.bytes_in > len("hello from origin") and ok.bytes_out > 0
        assert no.verdict == "refused" and "not in allow_out" in no.reason
        assert {event.sandbox for event in execution.network} == {sbx.sandbox_id}
        assert sbx.run_code("1").network == []

        rows = served.audit(sbx.sandbox_id, 2)
    by_host = {row["host"]: row for row in rows}
    assert set(by_host) == {"allowed.test", "other.test"}
    row = by_host["allowed.test"]
    assert row["tenant"] == "alice" and row["sandbox_id"] == sbx.sandbox_id
    assert (row["port"], row["verdict"], row["address"]) == (origin.port, "allowed", "127.0.0.1")
    assert (row["bytes_in"], row["bytes_out"]) == (ok.bytes_in, ok.bytes_out)
    assert row["reason"] == ok.reason
    assert by_host["other.test"]["verdict"] == "refused"
    assert by_host["other.test"]["reason"] == no.reason


def test_pip_download_through_the_server(served: EgressServer, origin: Origin) -> None:
    policy = {"allow_out": ["pypi.test", origin.entry]}
    with served.sandbox(served.alice, policy) as sbx:
        command = sbx.commands.run(
            "python -m pip download --no-cache-dir --disable-pip-version-check --no-deps "
            f"--index-url http://pypi.test:{origin.port}/simple/ --trusted-host pypi.test "
            "-d /home/user/downloads sandlotdemo && sha256sum /home/user/downloads/*",
            timeout=CELL_TIMEOUT,
        )
        assert command.exit_code == 0, command.stderr + command.stdout
        assert f"{origin.wheel_sha256}  /home/user/downloads/{WHEEL_NAME}" in command.stdout
        # A command's connections are reported with the next cell, as in local mode.
        network = sbx.run_code("1").network
        assert network and {event.host for event in network} == {"pypi.test"}
        assert all(event.verdict == "allowed" for event in network)


def test_tenants_cannot_use_each_others_allowances(served: EgressServer, origin: Origin) -> None:
    alice = served.sandbox(served.alice, {"allow_out": ["allowed.test", origin.entry]})
    bob = served.sandbox(served.bob, {"allow_out": ["other.test", origin.entry]})
    try:
        code = FETCH + (
            f"print(json.dumps([fetch('http://allowed.test:{origin.port}/hello')['status'], "
            f"fetch('http://other.test:{origin.port}/hello')['status']]))"
        )
        assert json.loads(alice.run_code(code).logs.stdout[0]) == [200, 403]
        assert json.loads(bob.run_code(code).logs.stdout[0]) == [403, 200]
        tenants = {row["tenant"] for row in served.audit(bob.sandbox_id, 2)}
        assert tenants == {"bob"}
    finally:
        alice.kill()
        bob.kill()


def test_a_name_resolving_to_an_internal_address_is_refused(
    served: EgressServer, origin: Origin
) -> None:
    # internal.test is within the ceiling as a name, but resolves to 10.0.0.7, which no
    # entry names: refused after resolution on the host.
    with served.sandbox(served.alice, {"allow_out": ["internal.test"]}) as sbx:
        outcome = sbx.run_code(FETCH + "fetch('http://internal.test/')").results[0].text
    assert "403" in str(outcome) and "10.0.0.7 is a private address" in str(outcome)


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ({"allow_out": ["evil.test"]}, "allow_out[0]: 'evil.test' is not within"),
        ({"allow_out": ["allowed.test", "127.0.0.1"]}, "allow_out[1]: '127.0.0.1' is not within"),
        ({"allow_out": ["*"]}, "allow_out[0]: '*' is not within"),
        ({"allow_out": ["allowed.test"], "max_connections": 9}, "max_connections: 9 is more"),
        ({"allow_out": ["allowed.test"], "max_bytes_in": None}, "max_bytes_in: None is more"),
        ({"allow_out": ["http://allowed.test/"]}, "is not a host"),
    ],
)
def test_policies_beyond_the_ceiling_or_invalid_are_400(
    served: EgressServer, network: dict[str, Any], message: str
) -> None:
    with served.client(served.alice) as client:
        response = client.post("/v1/sandboxes", json={"network": network})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "PolicyError"
    assert message in response.json()["message"]
    # The SDK raises the same error, typed.
    with pytest.raises(PolicyError, match=r"not within|more than|not a host"):
        served.sandbox(served.alice, network)


def test_malformed_network_fields_are_422(served: EgressServer) -> None:
    with served.client(served.alice) as client:
        unknown = client.post("/v1/sandboxes", json={"network": {"allow": ["allowed.test"]}})
        typed = client.post("/v1/sandboxes", json={"network": {"allow_out": "allowed.test"}})
    assert unknown.status_code == typed.status_code == 422


def test_no_policy_means_no_network_on_the_server(served: EgressServer) -> None:
    with served.client(served.alice) as client:
        response = client.post("/v1/sandboxes", json={})
        assert response.status_code == 201
        info = response.json()
        assert info["network"] is None
        client.delete(f"/v1/sandboxes/{info['sandbox_id']}")


def test_without_egress_allow_a_server_lets_no_tenant_enable_network(
    tmp_path: Path,
) -> None:
    server = ServerProcess(tmp_path / "closed").start()
    try:
        key = server.key("alice")
        with pytest.raises(PolicyError, match="none: network access is not allowed"):
            Sandbox(api_url=server.url, api_key=key, network={"allow_out": ["pypi.org"]})
    finally:
        server.stop()


def test_a_tenant_list_narrows_the_servers(served: EgressServer, origin: Origin) -> None:
    """``sandlot keys create --egress-allow``: the tenant's own list, within the server's."""
    carol = served.server.key(
        "carol", "--egress-allow", "allowed.test", "--egress-allow", origin.entry
    )
    dave = served.server.key("dave", "--no-egress")
    with served.client(carol) as client:
        beyond = client.post("/v1/sandboxes", json={"network": {"allow_out": ["other.test"]}})
        assert beyond.status_code == 400
        assert "'other.test' is not within" in beyond.json()["message"]
        assert "this tenant's own list" in beyond.json()["message"]
    with served.sandbox(carol, {"allow_out": ["allowed.test", origin.entry]}) as sbx:
        code = FETCH + f"fetch('http://allowed.test:{origin.port}/hello')['status']"
        assert sbx.run_code(code).text == "200"
    with pytest.raises(PolicyError, match="this tenant's own list"):
        served.sandbox(dave, {"allow_out": ["allowed.test"]})
    with served.client(dave) as client:  # no policy: a sandbox without network, as always
        response = client.post("/v1/sandboxes", json={})
        assert response.status_code == 201
        client.delete(f"/v1/sandboxes/{response.json()['sandbox_id']}")
