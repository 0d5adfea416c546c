"""Egress from Docker and Podman sandboxes: the container keeps ``NetworkMode: none``,
and the lease's socket, bind-mounted read-only, is its only way out.

The same proxy and test names as the bwrap tests (conftest.py); the origin is a real
server on the host's loopback, reached only through the proxy.
"""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest
from egress_helpers import Origin

from _fetch import FETCH
from sandlot import Sandbox
from sandlot.backends.docker import DockerBackend, PodmanBackend
from sandlot.egress import EgressProxy

pytestmark = [pytest.mark.requires_template]

ENGINES = [
    pytest.param(DockerBackend, marks=pytest.mark.requires_docker, id="docker"),
    pytest.param(PodmanBackend, marks=pytest.mark.requires_podman, id="podman"),
]
CELL_TIMEOUT = 120

PROBE = (
    FETCH
    + """
import os, socket
def direct(host, port):
    try:
        socket.create_connection((host, port), timeout=10).close()
        return "CONNECTED"
    except OSError as exc:
        return exc.errno
def resolves(name):
    try:
        socket.getaddrinfo(name, 80)
        return True
    except OSError:
        return False
print(json.dumps({
    "allowed": fetch("http://allowed.test:%d/hello" % PORT),
    "other": fetch("http://other.test:%d/hello" % PORT),
    "direct": direct("10.0.0.7", 80),
    "resolves": resolves("allowed.test"),
    "interfaces": sorted(line.split(":")[0].strip()
                         for line in open("/proc/net/dev").read().splitlines()[2:]),
}))
"""
)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_container_reaches_allowed_names_only_through_its_socket(
    engine: Any, proxy: EgressProxy, origin: Origin
) -> None:
    backend = engine(egress=proxy)
    network = {"allow_out": ["allowed.test", origin.entry]}
    with Sandbox(backend=backend, network=network, timeout=600) as sbx:
        execution = sbx.run_code(PROBE.replace("PORT", str(origin.port)), timeout=CELL_TIMEOUT)
    assert execution.error is None, execution.error
    outcome = json.loads("".join(execution.logs.stdout))
    assert outcome["allowed"] == {"status": 200, "body": "hello from origin"}
    assert outcome["other"]["status"] == 403
    assert "not in allow_out" in outcome["other"]["reason"]
    assert outcome["direct"] == errno.ENETUNREACH  # still NetworkMode none: no route
    assert outcome["resolves"] is False
    assert outcome["interfaces"] == ["lo"]
    assert execution.network is not None
    verdicts = sorted((event.host, event.verdict) for event in execution.network)
    assert verdicts == [("allowed.test", "allowed"), ("other.test", "refused")]
    assert {event.sandbox for event in execution.network} == {sbx.sandbox_id}
