"""E2B's wire, attacked: a tenant must not reach, or learn of, another tenant's sandbox
through any of its paths, and its inputs stay bounded.

Raw HTTP against a real ``sandlot serve`` (two tenants, their own keys), as a hostile
client would send it: no SDK smoothing anything over.
"""

from __future__ import annotations

import gzip
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

UNKNOWN_ID = "0123456789abcdef"
"""Shaped like a sandbox id; no sandbox has it."""
DISK_MB = 8
"""The workspace ceiling: an upload's inflated size must stop here."""


class Attack:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.url = server.url
        self.key_a = server.key("victim")
        self.key_b = server.key("attacker")

    def create(self, key: str) -> tuple[str, str]:
        """A sandbox through E2B's control plane: (id, access token)."""
        return self.server.e2b_create(key)

    def kill(self, key: str, sandbox_id: str) -> None:
        httpx.delete(f"{self.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": key}, timeout=60)

    def plane(
        self,
        method: str,
        path: str,
        sandbox_id: str,
        *,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        sent = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", **(headers or {})}
        return httpx.request(method, f"{self.url}{path}", headers=sent, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Attack]:
    server = ServerProcess(
        tmp_path_factory.mktemp("e2b-attacks"), "--ceiling", f"disk_mb={DISK_MB}"
    ).start()
    try:
        yield Attack(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def victim(attack: Attack) -> Iterator[tuple[str, str]]:
    """Tenant A's sandbox (id, token), holding a secret file."""
    sandbox_id, token = attack.create(attack.key_a)
    wrote = attack.plane(
        "POST",
        "/files",
        sandbox_id,
        headers={"X-Access-Token": token},
        params={"path": "secret.txt"},
        content=b"A-SECRET",
    )
    assert wrote.status_code == 200, wrote.text
    try:
        yield sandbox_id, token
    finally:
        attack.kill(attack.key_a, sandbox_id)


def _same_as_unknown(response: httpx.Response, unknown: httpx.Response, sandbox_id: str) -> None:
    """Another tenant's sandbox must answer exactly as an id that does not exist."""
    assert response.status_code == unknown.status_code, (response.text, unknown.text)
    assert response.text.replace(sandbox_id, UNKNOWN_ID) == unknown.text


# --- the sandbox plane --------------------------------------------------------------------


def test_a_wrong_token_does_not_tell_a_sandbox_exists(
    attack: Attack, victim: tuple[str, str]
) -> None:
    """A garbage token, or the attacker's own sandbox's token, on the victim's id answers
    as for an id nobody has: no oracle for which sandbox ids are live."""
    victim_id, _ = victim
    own_id, own_token = attack.create(attack.key_b)
    try:
        for token in ("garbage", own_token, "x" * 43):
            headers = {"X-Access-Token": token}
            unknown = attack.plane(
                "GET", "/files", UNKNOWN_ID, headers=headers, params={"path": "secret.txt"}
            )
            probe = attack.plane(
                "GET", "/files", victim_id, headers=headers, params={"path": "secret.txt"}
            )
            assert "A-SECRET" not in probe.text
            _same_as_unknown(probe, unknown, victim_id)
            rpc = {
                "headers": {**headers, "Content-Type": "application/json"},
                "json": {"path": "secret.txt"},
            }
            unknown = attack.plane("POST", "/filesystem.Filesystem/Stat", UNKNOWN_ID, **rpc)
            probe = attack.plane("POST", "/filesystem.Filesystem/Stat", victim_id, **rpc)
            _same_as_unknown(probe, unknown, victim_id)
        # the traffic token header is the same door
        unknown = attack.plane(
            "GET", "/health", UNKNOWN_ID, headers={"E2B-Traffic-Access-Token": own_token}
        )
        probe = attack.plane(
            "GET", "/health", victim_id, headers={"E2B-Traffic-Access-Token": own_token}
        )
        _same_as_unknown(probe, unknown, victim_id)
    finally:
        attack.kill(attack.key_b, own_id)


def test_another_tenants_key_reaches_nothing(attack: Attack, victim: tuple[str, str]) -> None:
    victim_id, _ = victim
    key = {"X-API-Key": attack.key_b}
    for method, path, extra in (
        ("GET", "/files", {"params": {"path": "secret.txt"}}),
        ("POST", "/files", {"params": {"path": "planted.txt"}, "content": b"x"}),
        ("GET", "/health", {}),
        ("GET", "/contexts", {}),
        ("POST", "/execute", {"json": {"code": "open('secret.txt').read()"}}),
    ):
        unknown = attack.plane(method, path, UNKNOWN_ID, headers=key, **extra)
        probe = attack.plane(method, path, victim_id, headers=key, **extra)
        assert "A-SECRET" not in probe.text
        _same_as_unknown(probe, unknown, victim_id)
    # the debug-mode prefix, by path and by header, HTTP and Connect
    basic = httpx.BasicAuth("sandlot", attack.key_b)
    for path in ("/e2b/sandboxes/{id}/files", "/e2b/sandboxes/{id}/filesystem.Filesystem/Stat"):
        kwargs: dict[str, Any] = {"auth": basic, "timeout": 60}
        if "Stat" in path:
            kwargs["json"] = {"path": "secret.txt"}
            method = "POST"
        else:
            kwargs["params"] = {"path": "secret.txt"}
            method = "GET"
        unknown = httpx.request(method, attack.url + path.format(id=UNKNOWN_ID), **kwargs)
        probe = httpx.request(method, attack.url + path.format(id=victim_id), **kwargs)
        assert "A-SECRET" not in probe.text
        _same_as_unknown(probe, unknown, victim_id)
    for path in ("/e2b/files", "/e2b/filesystem.Filesystem/Stat"):
        kwargs = {"auth": basic, "timeout": 60}
        if "Stat" in path:
            kwargs["json"] = {"path": "secret.txt"}
        else:
            kwargs["params"] = {"path": "secret.txt"}
        method = "POST" if "Stat" in path else "GET"
        unknown = httpx.request(
            method, attack.url + path, headers={"E2b-Sandbox-Id": UNKNOWN_ID}, **kwargs
        )
        probe = httpx.request(
            method, attack.url + path, headers={"E2b-Sandbox-Id": victim_id}, **kwargs
        )
        _same_as_unknown(probe, unknown, victim_id)
    # the victim's file is as it was
    own = attack.plane(
        "GET",
        "/files",
        victim_id,
        headers={"X-Access-Token": victim[1]},
        params={"path": "planted.txt"},
    )
    assert own.status_code == 404


def test_two_sandbox_id_headers_never_mix_tenants(attack: Attack, victim: tuple[str, str]) -> None:
    """One id the attacker's (with its token), one the victim's, in either order: the
    request acts on one sandbox, authenticated for that one."""
    victim_id, _ = victim
    own_id, own_token = attack.create(attack.key_b)
    try:
        for ids in ((victim_id, own_id), (own_id, victim_id)):
            headers = [("E2b-Sandbox-Id", i) for i in ids] + [("X-Access-Token", own_token)]
            got = httpx.get(
                f"{attack.url}/files", params={"path": "secret.txt"}, headers=headers, timeout=60
            )
            assert "A-SECRET" not in got.text
            rpc = httpx.post(
                f"{attack.url}/filesystem.Filesystem/ListDir",
                json={"path": "."},
                timeout=60,
                headers=[*headers, ("Content-Type", "application/json")],
            )
            assert "secret.txt" not in rpc.text
    finally:
        attack.kill(attack.key_b, own_id)


def test_a_sandbox_header_opens_no_native_route(attack: Attack, victim: tuple[str, str]) -> None:
    """The victim's own id and token do not stand in for an API key on /v1 or /metrics."""
    victim_id, token = victim
    headers = {"X-Access-Token": token}
    for path in ("/v1/sandboxes", f"/v1/sandboxes/{victim_id}", "/metrics", "/openapi.json"):
        got = attack.plane("GET", path, victim_id, headers=headers)
        assert got.status_code in (401, 404), (path, got.status_code, got.text)
        assert "sandlot_" not in got.text and "sandbox_id" not in got.text


def test_a_killed_sandboxs_token_is_dead(attack: Attack) -> None:
    sandbox_id, token = attack.create(attack.key_a)
    attack.kill(attack.key_a, sandbox_id)
    got = attack.plane("GET", "/health", sandbox_id, headers={"X-Access-Token": token})
    assert got.status_code == 502 and "was not found" in got.text
    # a new sandbox has a new id and a new token; the old token opens neither
    fresh_id, _ = attack.create(attack.key_a)
    try:
        got = attack.plane("GET", "/health", fresh_id, headers={"X-Access-Token": token})
        assert got.status_code == 502
    finally:
        attack.kill(attack.key_a, fresh_id)


# --- paths and bodies ---------------------------------------------------------------------


def test_files_paths_stay_inside_the_sandbox(attack: Attack, victim: tuple[str, str]) -> None:
    """Upward paths and a symlink to a host file (the server's own log, which the sandbox
    cannot see) read nothing of the host's."""
    victim_id, token = victim
    auth = {"X-Access-Token": token}
    log = str(attack.server.log_path)
    ran = attack.plane(
        "POST",
        "/execute",
        victim_id,
        headers=auth,
        json={"code": f"import os\nos.symlink({log!r}, 'log-link')\nos.symlink('/', 'root-link')"},
    )
    assert ran.status_code == 200 and '"type": "error"' not in ran.text, ran.text
    for path in ("log-link", "root-link" + log, "../" * 12 + log.lstrip("/"), log):
        got = attack.plane("GET", "/files", victim_id, headers=auth, params={"path": path})
        assert got.status_code != 200 or "running on http" not in got.text, path
        rpc = attack.plane(
            "POST",
            "/filesystem.Filesystem/Stat",
            victim_id,
            headers={**auth, "Content-Type": "application/json"},
            json={"path": path},
        )
        assert rpc.status_code != 200 or json.loads(rpc.text)["entry"]["size"] != len(
            attack.server.log().encode()
        ), path


def test_a_gzip_bomb_upload_stops_at_the_workspace_size(
    attack: Attack, victim: tuple[str, str]
) -> None:
    victim_id, token = victim
    bomb = gzip.compress(b"\0" * (4 * DISK_MB << 20), 9)
    assert len(bomb) < 1 << 20
    got = attack.plane(
        "POST",
        "/files",
        victim_id,
        params={"path": "bomb.bin"},
        content=bomb,
        headers={
            "X-Access-Token": token,
            "Content-Encoding": "gzip",
            "Content-Type": "application/octet-stream",
        },
    )
    assert got.status_code == 413, got.text
    stat = attack.plane(
        "POST",
        "/filesystem.Filesystem/Stat",
        victim_id,
        headers={"X-Access-Token": token, "Content-Type": "application/json"},
        json={"path": "bomb.bin"},
    )
    assert stat.status_code == 404


def test_a_compressed_connect_message_is_capped_after_inflating(
    attack: Attack, victim: tuple[str, str]
) -> None:
    """A Connect request of a few KiB that inflates past the server's body limit is
    refused, not inflated into memory."""
    victim_id, token = victim
    message = b'{"path": "' + b"a" * (16 << 20) + b'"}'
    got = attack.plane(
        "POST",
        "/filesystem.Filesystem/Stat",
        victim_id,
        content=gzip.compress(message, 9),
        headers={
            "X-Access-Token": token,
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        },
    )
    assert got.status_code != 200 and got.json()["code"] == "resource_exhausted", got.text
    # the same for an enveloped (streaming) call: Process.Start
    packed = gzip.compress(b"\0" * (16 << 20), 9)
    envelope = struct.pack(">BI", 1, len(packed)) + packed
    got = attack.plane(
        "POST",
        "/process.Process/Start",
        victim_id,
        content=envelope,
        headers={
            "X-Access-Token": token,
            "Content-Type": "application/connect+proto",
            "Connect-Content-Encoding": "gzip",
        },
    )
    assert got.status_code == 200  # Connect streams answer errors in the end message
    assert b"resource_exhausted" in got.content or b"invalid_argument" in got.content


# --- the control plane --------------------------------------------------------------------


def test_control_plane_calls_on_another_tenants_sandbox(
    attack: Attack, victim: tuple[str, str]
) -> None:
    victim_id, _ = victim
    key = {"X-API-Key": attack.key_b}
    for method, path, body in (
        ("GET", "/sandboxes/{id}", None),
        ("DELETE", "/sandboxes/{id}", None),
        ("POST", "/sandboxes/{id}/timeout", {"timeout": 1}),
        ("POST", "/sandboxes/{id}/refreshes", {"duration": 1}),
        ("POST", "/sandboxes/{id}/connect", {"timeout": 1}),
        ("POST", "/v2/sandboxes/{id}/connect", {"timeout": 1}),
        ("GET", "/sandboxes/{id}/metrics", None),
        ("POST", "/sandboxes/{id}/pause", None),
    ):
        kwargs: dict[str, Any] = {"headers": key, "timeout": 60}
        if body is not None:
            kwargs["json"] = body
        unknown = httpx.request(method, attack.url + path.format(id=UNKNOWN_ID), **kwargs)
        probe = httpx.request(method, attack.url + path.format(id=victim_id), **kwargs)
        assert victim[1] not in probe.text
        _same_as_unknown(probe, unknown, victim_id)
    # still alive, its life not shortened
    info = httpx.get(f"{attack.url}/sandboxes/{victim_id}", headers={"X-API-Key": attack.key_a})
    assert info.status_code == 200
    # the attacker's list, and a forged page token, show nothing of the victim's
    forged = __import__("base64").urlsafe_b64encode(b"9e99|zzzzzzzzzzzzzzzz").decode()
    for params in ({}, {"nextToken": forged}, {"metadata": "a=b"}, {"limit": 1000}):
        listed = httpx.get(f"{attack.url}/v2/sandboxes", params=params, headers=key)
        assert listed.status_code == 200 and victim_id not in listed.text


def test_internet_access_cannot_name_destinations_beyond_the_tenant(attack: Attack) -> None:
    for body in (
        {"allow_internet_access": True},
        {"allow_internet_access": True, "network": {"allowOut": ["127.0.0.1"]}},
        {"network": {"allowOut": ["0.0.0.0/0"]}},
        {"network": {"allowOut": ["*"], "denyOut": []}},
    ):
        made = httpx.post(
            f"{attack.url}/sandboxes",
            json={"templateID": "base", **body},
            headers={"X-API-Key": attack.key_b},
            timeout=120,
        )
        assert made.status_code == 400, (body, made.text)


def test_template_names_are_the_operators(attack: Attack) -> None:
    for name in ("../python-data", "/etc", "python-data/../../x", "minimal", "base/../x"):
        made = httpx.post(
            f"{attack.url}/sandboxes",
            json={"templateID": name},
            headers={"X-API-Key": attack.key_b},
            timeout=120,
        )
        assert made.status_code in (400, 404), (name, made.text)


def test_cells_over_the_wire_are_audited_for_the_sandboxs_tenant(
    attack: Attack, victim: tuple[str, str]
) -> None:
    victim_id, token = victim
    ran = attack.plane(
        "POST",
        "/execute",
        victim_id,
        headers={"X-Access-Token": token},
        json={"code": "print('audited\\x1b[31m')"},
    )
    assert ran.status_code == 200
    rows = [
        json.loads(line)
        for line in attack.server.cli("audit", "--json", "--sandbox", victim_id).stdout.splitlines()
    ]
    assert rows and all(row["tenant"] == "victim" for row in rows)
    assert any("audited" in (row.get("code") or "") for row in rows), rows
    assert "\x1b" not in attack.server.log()  # the cell's text reached no log raw


def test_creates_through_the_wire_count_against_the_tenants_quota(attack: Attack) -> None:
    key = attack.server.key("one-sandbox", "--max-sandboxes", "1")
    sandbox_id, _ = attack.create(key)
    try:
        again = httpx.post(
            f"{attack.url}/v2/sandboxes",
            json={"templateID": "base"},
            headers={"X-API-Key": key},
            timeout=120,
        )
        assert again.status_code == 429 and "quota" in again.json()["message"], again.text
    finally:
        attack.kill(key, sandbox_id)


def test_absurd_timeouts_are_refused_not_a_server_error(
    attack: Attack, victim: tuple[str, str]
) -> None:
    """Seconds too large for a float: a 400 the client can act on, never a 500."""
    victim_id, _ = victim
    huge = b"9" * 400
    headers = {"X-API-Key": attack.key_a, "Content-Type": "application/json"}
    for path, body in (
        ("/sandboxes", b'{"templateID": "base", "timeout": ' + huge + b"}"),
        (f"/sandboxes/{victim_id}/connect", b'{"timeout": ' + huge + b"}"),
        (f"/sandboxes/{victim_id}/timeout", b'{"timeout": ' + huge + b"}"),
        (f"/sandboxes/{victim_id}/refreshes", b'{"duration": ' + huge + b"}"),
    ):
        got = httpx.post(attack.url + path, content=body, headers=headers, timeout=60)
        assert got.status_code == 400, (path, got.status_code, got.text)
        assert got.json()["code"] == 400


def test_internet_access_never_exceeds_the_tenants_own_list(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A server that allows two destinations; one tenant may reach one of them, another
    none: E2B's switch and its allowOut cannot reach past either list."""
    server = ServerProcess(
        tmp_path_factory.mktemp("e2b-egress"),
        "--egress-allow",
        "example.com",
        "--egress-allow",
        "example.org",
    ).start()
    try:
        narrow = server.key("narrow", "--egress-allow", "example.com")
        closed = server.key("closed", "--no-egress")
        for key, body in (
            (narrow, {"network": {"allowOut": ["example.org"]}}),
            (narrow, {"allow_internet_access": True, "network": {"allowOut": ["*.org"]}}),
            (closed, {"allow_internet_access": True}),
            (closed, {"network": {"allowOut": ["example.com"]}}),
        ):
            made = httpx.post(
                f"{server.url}/sandboxes",
                json={"templateID": "base", **body},
                headers={"X-API-Key": key},
                timeout=120,
            )
            assert made.status_code == 400, (body, made.text)
        made = httpx.post(
            f"{server.url}/sandboxes",
            json={"templateID": "base"},
            headers={"X-API-Key": closed},
            timeout=120,
        )
        assert made.status_code == 201, made.text
        info = httpx.get(
            f"{server.url}/sandboxes/{made.json()['sandboxID']}", headers={"X-API-Key": closed}
        )
        assert info.json()["allowInternetAccess"] is False
    finally:
        server.stop()


def _calls_in_progress(server: ServerProcess, key: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": key}, timeout=60).text
    for line in text.splitlines():
        if line.startswith("sandlot_sandbox_calls_in_progress "):
            return float(line.split()[1])
    raise AssertionError("no sandlot_sandbox_calls_in_progress in /metrics")


def test_a_vanished_command_client_lets_its_sandbox_go_idle(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A client that starts a silent command over Connect and disconnects must not keep
    its sandbox leased (a server thread held) until the command or the sandbox's life
    ends: the server notices the disconnect. The running command itself keeps the
    sandbox from the idle reaper (the server's rule for background processes); once it
    is killed, nothing holds the sandbox and the reaper takes it."""
    server = ServerProcess(tmp_path_factory.mktemp("e2b-vanish"), "--idle-ttl", "2").start()
    try:
        key = server.key("vanishing")
        made = httpx.post(
            f"{server.url}/sandboxes",
            json={"templateID": "base", "timeout": 600},
            headers={"X-API-Key": key},
            timeout=120,
        )
        sandbox_id, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
        headers = {"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token}
        start = json.dumps(
            {"process": {"cmd": "/bin/sh", "args": ["-c", "echo started; exec sleep 3600"]}}
        ).encode()
        with httpx.stream(
            "POST",
            f"{server.url}/process.Process/Start",
            content=struct.pack(">BI", 0, len(start)) + start,
            headers={**headers, "Content-Type": "application/connect+json"},
            timeout=60,
        ) as response:
            received = b""
            for chunk in response.iter_raw():
                received += chunk
                if b"c3RhcnRlZAo=" in received:  # "started\n": the command is running
                    assert _calls_in_progress(server, key) == 1  # this stream, counted
                    break  # and gone (leaving the loop closes the response)
        (length,) = struct.unpack(">I", received[1:5])
        pid = json.loads(received[5 : 5 + length])["event"]["start"]["pid"]
        # Gone. Its command still runs, which keeps the sandbox from the idle reaper (the
        # rule for background processes), but the vanished call must hold nothing: the
        # server's count of calls in progress drops to zero while the command runs. Had
        # the call kept its lease, it would stay until the command's hour; 60 s is only
        # the bound of a busy machine.
        deadline = time.monotonic() + 60
        while _calls_in_progress(server, key) != 0:
            assert time.monotonic() < deadline, "the call stayed leased after its client left"
            time.sleep(0.25)
        listed = httpx.post(
            f"{server.url}/process.Process/List", json={}, headers=headers, timeout=60
        )
        assert pid in [p["pid"] for p in listed.json()["processes"]], listed.text
        # Killed (a new call), nothing holds the sandbox: idle for 2 s, it is reaped.
        killed = httpx.post(
            f"{server.url}/process.Process/SendSignal",
            json={"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
            headers=headers,
            timeout=60,
        )
        assert killed.status_code == 200, killed.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = httpx.get(f"{server.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": key})
            if got.status_code == 404:
                break
            time.sleep(0.25)
        else:
            pytest.fail("the sandbox was not reaped once its command ended")
    finally:
        server.stop()


def test_multipart_uploads_are_bounded_in_parts_and_names(
    attack: Attack, victim: tuple[str, str]
) -> None:
    victim_id, token = victim
    headers = {"X-Access-Token": token, "Content-Type": "multipart/form-data; boundary=XX"}

    def part(name: bytes) -> bytes:
        return (
            b'--XX\r\nContent-Disposition: form-data; name="file"; filename="%s"\r\n\r\nx\r\n'
            % (name)
        )

    for body in (
        part(b"n" * (1 << 20)) + b"--XX--\r\n",
        b"".join(part(b"f%d" % i) for i in range(1001)) + b"--XX--\r\n",
    ):
        got = attack.plane("POST", "/files", victim_id, headers=headers, content=body)
        assert got.status_code == 400, got.text
    listed = attack.plane(
        "POST",
        "/filesystem.Filesystem/ListDir",
        victim_id,
        headers={"X-Access-Token": token, "Content-Type": "application/json"},
        json={"path": "."},
    )
    assert '"f0"' not in listed.text and "nnnn" not in listed.text


def test_malformed_execute_calls_answer_in_e2bs_shape(
    attack: Attack, victim: tuple[str, str]
) -> None:
    """``/execute`` is served on a short path (no routing, no dependency solving); a
    call that is not well formed must still get the plane's typed answer, never a 500
    or a cell that runs."""
    victim_id, token = victim
    sent = {"X-Access-Token": token, "E2b-Sandbox-Port": "49999"}
    as_json = {**sent, "Content-Type": "application/json"}
    cases: list[tuple[dict[str, str], bytes | Iterator[bytes], int]] = [
        (as_json, b"print('ran')", 400),  # not JSON
        (as_json, b'{"code": 1}', 400),  # code is not text
        (as_json, b'{"code": "print(\'ran\')", "bogus": 1}', 400),
        (as_json, b'{"code": "print(\'ran\')", "language": "r"}', 400),
        (as_json, b'{"code": "print(\'ran\')", "timeout": 1e400}', 400),
        (as_json, b'{"code": "print(\'ran\')", "env_vars": {"A": 1}}', 400),
        # Over the body limit, announced and not: refused before a cell exists.
        (as_json, b'{"code": "' + b"#" * (9 * 1024 * 1024) + b'"}', 413),
        (as_json, iter([b'{"code": "', *[b"#" * (1024 * 1024)] * 9, b'"}']), 413),
    ]
    for headers, body, status in cases:
        got = attack.plane("POST", "/execute", victim_id, headers=headers, content=body)
        shown = body[:60] if isinstance(body, bytes) else "a chunked body"
        assert got.status_code == status, (shown, got.status_code, got.text[:300])
        assert got.json()["message"], (shown, got.text[:300])
    # Plain text is not a JSON call: the plane's own answer (a 400), not the short path's.
    got = attack.plane(
        "POST",
        "/execute",
        victim_id,
        headers={**sent, "Content-Type": "text/plain"},
        content=b'{"code": "print(\'ran\')"}',
    )
    assert got.status_code < 500, got.text
    ran = attack.plane(
        "POST", "/execute", victim_id, headers=as_json, content=b'{"code": "print(\'ran\')"}'
    )
    assert ran.status_code == 200
    printed = [json.loads(line) for line in ran.text.splitlines()]
    assert [m["text"] for m in printed if m["type"] == "stdout"] == ["ran\n"], printed
