"""The HTTP API against a real ``sandlot serve`` subprocess on loopback.

Keys, tenants and quotas; clear 4xx errors for bad input (never a 500); the audit
trail; metrics; the OpenAPI document; a client that disconnects mid-cell.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import sandlot
from _server_harness import ServerProcess
from sandlot import AsyncSandbox, Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

REPO = Path(__file__).resolve().parents[2]
OPENAPI = REPO / "docs" / "openapi.json"


class Api:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.alice = server.key("alice")
        self.bob = server.key("bob")
        self.tiny = server.key(
            "tiny", "--max-sandboxes", "1", "--max-memory-mb", "4096", "--creates-per-minute", "3"
        )

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.server.url, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    server = ServerProcess(
        tmp_path_factory.mktemp("api"), "--idle-ttl", "600", "--ceiling", "memory_mb=8192"
    ).start()
    try:
        yield Api(server)
    finally:
        server.stop()


@pytest.fixture
def alice(api: Api) -> Iterator[httpx.Client]:
    with api.client(api.alice) as client:
        yield client


def _create(client: httpx.Client, **body: Any) -> str:
    response = client.post("/v1/sandboxes", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["sandbox_id"])


def _run(client: httpx.Client, sandbox_id: str, code: str, **extra: Any) -> list[dict[str, Any]]:
    response = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": code, **extra})
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def _error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert body["type"] and body["message"], body
    return body


# --- keys and tenants -------------------------------------------------------------------


def test_keys_create_prints_the_key_alone_on_the_last_line(api: Api) -> None:
    done = api.server.cli("keys", "create", "--tenant", "printer")
    key = done.stdout.strip().splitlines()[-1]
    assert key.startswith("sl_") and " " not in key
    with api.client(key) as client:
        assert client.get("/v1/sandboxes").json() == []
    listed = api.server.cli("keys", "list").stdout
    assert "printer" in listed and key.split("_", 2)[2] not in listed  # the secret is not stored
    database = (api.server.state_dir / "sandlot.db").read_bytes()
    assert key.split("_", 2)[2].encode() not in database


def test_health_needs_no_key_and_everything_else_does(api: Api) -> None:
    with api.client(None) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for method, path in [
            ("GET", "/v1/sandboxes"),
            ("POST", "/v1/sandboxes"),
            ("GET", "/v1/sandboxes/abc"),
            ("DELETE", "/v1/sandboxes/abc"),
            ("POST", "/v1/sandboxes/abc/execute"),
            ("GET", "/v1/sandboxes/abc/files?path=x"),
            ("GET", "/metrics"),
            ("POST", "/e2b/execute"),
        ]:
            response = anonymous.request(method, path, json={})
            assert response.status_code == 401, (method, path, response.text)
            assert _error_of(response)["type"] == "AuthenticationError"
            assert response.headers["www-authenticate"].startswith("Bearer")
    wrong = api.alice[:-4] + ("AAAA" if not api.alice.endswith("AAAA") else "BBBB")
    for key in (wrong, "sl_0000000000000000_nope", "not-a-key", "Bearer"):
        with api.client(key) as client:
            assert client.get("/v1/sandboxes").status_code == 401


def test_key_is_accepted_as_bearer_x_api_key_or_basic_password(api: Api) -> None:
    url = api.server.url
    assert httpx.get(f"{url}/v1/sandboxes", headers={"X-API-Key": api.alice}).status_code == 200
    assert httpx.get(f"{url}/v1/sandboxes", auth=("sandlot", api.alice)).status_code == 200
    assert httpx.get(f"{url}/v1/sandboxes", auth=("sandlot", "wrong")).status_code == 401


def test_revoked_key_is_refused(api: Api) -> None:
    key = api.server.key("revoked")
    with api.client(key) as client:
        assert client.get("/v1/sandboxes").status_code == 200
        api.server.cli("keys", "revoke", key.split("_")[1])
        assert client.get("/v1/sandboxes").status_code == 401


def test_another_tenants_sandbox_is_not_found(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice)
    try:
        with api.client(api.bob) as bob:
            for method, path, body in [
                ("GET", f"/v1/sandboxes/{sandbox_id}", None),
                ("DELETE", f"/v1/sandboxes/{sandbox_id}", None),
                ("POST", f"/v1/sandboxes/{sandbox_id}/execute", {"code": "1"}),
                ("GET", f"/v1/sandboxes/{sandbox_id}/files?path=x", None),
                ("POST", f"/v1/sandboxes/{sandbox_id}/timeout", {"timeout": 5}),
                ("POST", f"/e2b/sandboxes/{sandbox_id}/execute", {"code": "1"}),
            ]:
                response = bob.request(method, path, json=body)
                assert response.status_code == 404, (method, path, response.text)
                assert _error_of(response)["type"] == "SandboxNotFound"
            assert bob.get("/v1/sandboxes").json() == []
        assert alice.get(f"/v1/sandboxes/{sandbox_id}").status_code == 200  # untouched
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


# --- bad input is a clear 4xx, never a 500 -----------------------------------------------


def test_malformed_and_unknown_input_get_clear_4xx(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice)
    try:
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("POST", "/v1/sandboxes", {"content": b"{not json"}, 422, "JSON"),
            ("POST", "/v1/sandboxes", {"json": {"templte": "x"}}, 422, "templte"),
            ("POST", "/v1/sandboxes", {"json": {"timeout": -1}}, 422, "timeout"),
            ("POST", "/v1/sandboxes", {"json": {"resources": {"gpus": 1}}}, 422, "gpus"),
            ("POST", "/v1/sandboxes", {"json": {"resources": {"memory_mb": 0}}}, 422, "memory"),
            ("POST", "/v1/sandboxes", {"json": {"resources": {"pids": 10**9}}}, 422, "pids"),
            ("POST", "/v1/sandboxes", {"json": {"resources": {"memory_mb": None}}}, 400, "memory"),
            ("POST", "/v1/sandboxes", {"json": {"envs": {"A=B": "x"}}}, 400, "environment"),
            ("POST", "/v1/sandboxes", {"json": {"template": "no-such"}}, 400, "no-such"),
            ("POST", "/v1/sandboxes", {"json": {"timeout": 10**9}}, 400, "timeout"),
            ("POST", "/v1/sandboxes", {"json": [1, 2]}, 422, "body"),
            ("POST", f"/v1/sandboxes/{sandbox_id}/execute", {"json": {"cod": "1"}}, 422, "cod"),
            (
                "POST",
                f"/v1/sandboxes/{sandbox_id}/execute",
                {"json": {"code": "1", "language": "r"}},
                400,
                "language",
            ),
            (
                "POST",
                f"/v1/sandboxes/{sandbox_id}/execute",
                {"json": {"code": "1", "env_vars": {"": "x"}}},
                400,
                "environment",
            ),
            ("GET", f"/v1/sandboxes/{sandbox_id}/files?path=a%00b", {}, 400, "path"),
            ("GET", f"/v1/sandboxes/{sandbox_id}/files", {}, 422, "path"),
            ("GET", f"/v1/sandboxes/{sandbox_id}/files?path=missing.txt", {}, 404, "missing"),
            ("DELETE", f"/v1/sandboxes/{sandbox_id}/contexts/nope", {}, 404, "nope"),
            ("POST", f"/v1/sandboxes/{sandbox_id}/commands", {"json": {"cmd": " "}}, 400, "cmd"),
            ("POST", f"/v1/sandboxes/{sandbox_id}/timeout", {"json": {}}, 422, "timeout"),
        ]
        for method, path, kwargs, status, mention in cases:
            headers = {"content-type": "application/json"} if "content" in kwargs else {}
            response = alice.request(method, path, headers=headers, **kwargs)
            assert response.status_code == status, (path, kwargs, response.text)
            assert mention.lower() in _error_of(response)["message"].lower(), response.text
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


def test_oversized_uploads_and_bodies_get_413(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice, resources={"disk_mb": 1})
    try:
        big = b"x" * (2 * 1024 * 1024)
        response = alice.post(f"/v1/sandboxes/{sandbox_id}/files?path=big.bin", content=big)
        assert response.status_code == 413, response.text
        assert "disk_mb" in _error_of(response)["message"]

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(4):
                yield b"y" * (1024 * 1024)

        response = alice.post(f"/v1/sandboxes/{sandbox_id}/files?path=big.bin", content=chunked())
        assert response.status_code == 413, response.text
        huge_code = {"code": "#" * (9 * 1024 * 1024)}
        response = alice.post(f"/v1/sandboxes/{sandbox_id}/execute", json=huge_code)
        assert response.status_code == 413
        assert _error_of(response)["type"] == "InvalidArgumentError"

        def chunked_cell() -> Iterator[bytes]:  # the same, not announced
            yield b'{"code": "'
            for _ in range(9):
                yield b"#" * (1024 * 1024)
            yield b'"}'

        response = alice.post(
            f"/v1/sandboxes/{sandbox_id}/execute",
            content=chunked_cell(),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 413, response.text
        assert _error_of(response)["type"] == "InvalidArgumentError"
        # Nothing was written, and the sandbox still works.
        assert alice.get(f"/v1/sandboxes/{sandbox_id}/files?path=big.bin").status_code == 404
        assert _run(alice, sandbox_id, "1 + 1")[0]["text"] == "2"
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


def test_downloads_are_never_rendered_by_a_browser(api: Api, alice: httpx.Client) -> None:
    """A sandbox chooses a file's bytes, and the server's origin also serves the web app:
    a download is an attachment a browser neither sniffs nor runs as a page."""
    sandbox_id = _create(alice)
    try:
        page = b"<html><script>parent.pwned = 1</script></html>"
        assert alice.post(f"/v1/sandboxes/{sandbox_id}/files?path=p.html", content=page).is_success
        response = alice.get(f"/v1/sandboxes/{sandbox_id}/files?path=p.html")
        assert response.content == page
        assert response.headers["content-type"] == "application/octet-stream"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["content-disposition"] == "attachment"
        assert response.headers["content-security-policy"].startswith("sandbox")
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


# --- quotas ----------------------------------------------------------------------------


def test_tenant_quotas_answer_429(api: Api) -> None:
    with api.client(api.tiny) as tiny:
        first = _create(tiny, resources={"memory_mb": 1024})
        response = tiny.post("/v1/sandboxes", json={"resources": {"memory_mb": 1024}})
        assert response.status_code == 429
        assert "quota: 1" in _error_of(response)["message"]
        tiny.delete(f"/v1/sandboxes/{first}")
        response = tiny.post("/v1/sandboxes", json={"resources": {"memory_mb": 8192}})
        assert response.status_code == 429
        assert "MiB" in _error_of(response)["message"]
        second = _create(tiny, resources={"memory_mb": 1024})
        tiny.delete(f"/v1/sandboxes/{second}")
        # Three creations (one refused for memory does not count) in this minute.
        third = _create(tiny, resources={"memory_mb": 1024})
        tiny.delete(f"/v1/sandboxes/{third}")
        response = tiny.post("/v1/sandboxes", json={"resources": {"memory_mb": 1024}})
        assert response.status_code == 429
        assert "per minute" in _error_of(response)["message"]
    with pytest.raises(sandlot.QuotaExceeded):
        Sandbox(api_url=api.server.url, api_key=api.tiny)


# --- cells, audit, metrics ---------------------------------------------------------------


def test_execute_streams_e2b_messages_and_is_audited(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice, metadata={"purpose": "audit"})
    try:
        secret_code = "print('audited')\nsecret_value = 6 * 7\nsecret_value"
        messages = _run(alice, sandbox_id, secret_code)
        assert [m["type"] for m in messages] == [
            "stdout",
            "result",
            "number_of_executions",
            "end_of_execution",
        ]
        assert messages[1]["text"] == "42" and messages[1]["is_main_result"] is True
        end = messages[-1]
        assert end["status"] == "ok" and end["error"] is None
        failed = _run(alice, sandbox_id, "1/0")
        assert failed[0]["type"] == "error" and failed[0]["name"] == "ZeroDivisionError"
        timed_out = _run(alice, sandbox_id, "while True: pass", timeout=1)
        assert timed_out[-1]["status"] == "timeout"
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")
    rows = [
        json.loads(line)
        for line in api.server.cli("audit", "--sandbox", sandbox_id, "--json").stdout.splitlines()
    ]
    assert [row["outcome"] for row in rows] == ["ok", "error", "timeout"]
    first = rows[0]
    assert first["tenant"] == "alice" and first["code"] == secret_code
    assert first["code_bytes"] == len(secret_code) and len(first["code_sha256"]) == 64
    assert first["stdout_bytes"] == len("audited\n") and first["result_count"] == 1
    assert first["duration"] > 0 and first["finished_at"] >= first["started_at"]
    assert rows[1]["error_name"] == "ZeroDivisionError"
    # The advisory pre-check report and the sandbox's resource use are recorded too.
    assert first["precheck"]["flagged"] is False and first["precheck"]["syntax_ok"] is True
    assert first["usage"] is not None and first["usage"]["memory_peak_bytes"] > 0
    table = api.server.cli("audit", "--tenant", "alice").stdout
    assert sandbox_id in table
    # Info-level logs name cells and sandboxes, never the code or its output.
    log = api.server.log()
    assert "secret_value" not in log and "audited" not in log
    assert "ended: timeout" in log


def test_metrics_count_sandboxes_and_outcomes(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice)
    try:
        _run(alice, sandbox_id, "1")
        text = alice.get("/metrics").text
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")
    for name in (
        "sandlot_sandboxes_live",
        'sandlot_executions_total{outcome="ok"}',
        "sandlot_execution_seconds_bucket",
        "sandlot_sandbox_start_seconds_bucket",
        'sandlot_pool_requests_total{result="miss"}',
    ):
        assert name in text, name


def test_client_disconnect_interrupts_the_cell(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice)
    try:
        body = {
            "code": "import time\nprint('started', flush=True)\ntime.sleep(600)",
            "timeout": 900,
        }
        with alice.stream("POST", f"/v1/sandboxes/{sandbox_id}/execute", json=body) as response:
            for line in response.iter_lines():
                assert json.loads(line)["text"] == "started\n"
                break
        # The connection is closed: the server interrupts the cell (KeyboardInterrupt).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = api.server.cli("audit", "--sandbox", sandbox_id, "--json").stdout.splitlines()
            if rows and json.loads(rows[-1])["outcome"] != "running":
                break
            time.sleep(0.5)
        row = json.loads(rows[-1])
        assert row["outcome"] == "killed" and row["status"] == "interrupted", row
        # The context is free again at once (the sleeping cell is gone).
        assert _run(alice, sandbox_id, "'free'", timeout=30)[0]["text"] == "'free'"
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")


def test_sandbox_expires_after_its_timeout(api: Api, alice: httpx.Client) -> None:
    sandbox_id = _create(alice, timeout=1)
    deadline = time.monotonic() + 120
    while alice.get(f"/v1/sandboxes/{sandbox_id}").status_code == 200:
        assert time.monotonic() < deadline, "the reaper did not expire the sandbox"
        time.sleep(0.3)
    assert alice.get(f"/v1/sandboxes/{sandbox_id}").status_code == 404


def test_remote_sandbox_timeout_and_kill(api: Api) -> None:
    sbx = Sandbox(api_url=api.server.url, api_key=api.alice, timeout=300)
    assert sbx.is_running()
    sbx.set_timeout(1)
    deadline = time.monotonic() + 120
    while sbx.is_running():
        assert time.monotonic() < deadline
        time.sleep(0.3)
    with pytest.raises(sandlot.SandboxClosed):
        sbx.run_code("1")
    sbx.kill()


def test_remote_mode_from_the_environment(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_API_URL", api.server.url)
    monkeypatch.setenv("SANDLOT_API_KEY", api.alice)
    with Sandbox() as sbx:
        assert sbx.run_code("6 * 7").text == "42"
        with api.client(api.alice) as client:
            assert sbx.sandbox_id in [s["sandbox_id"] for s in client.get("/v1/sandboxes").json()]
    monkeypatch.setenv("SANDLOT_API_KEY", "sl_0000000000000000_wrong")
    with pytest.raises(sandlot.AuthenticationError):
        Sandbox()
    monkeypatch.delenv("SANDLOT_API_KEY")
    with pytest.raises(sandlot.InvalidArgumentError, match="SANDLOT_API_KEY"):
        Sandbox()


def test_async_sandbox_in_remote_mode(api: Api) -> None:
    async def scenario() -> None:
        lines: list[str] = []
        sbx = await AsyncSandbox.create(api_url=api.server.url, api_key=api.alice)
        async with sbx:
            assert await sbx.is_running()
            execution = await sbx.run_code(
                "print('hello')\n40 + 2", on_stdout=lambda m: lines.append(m.line)
            )
            assert execution.text == "42" and lines == ["hello\n"]
            ctx = await sbx.create_code_context()
            both = await asyncio.gather(
                sbx.run_code("import time; time.sleep(0.5); 'a'"),
                sbx.run_code("import time; time.sleep(0.5); 'b'", context=ctx),
            )
            assert [e.text for e in both] == ["'a'", "'b'"]
            await sbx.files.write("async/data.bin", b"\x00\xff" * 1000)
            assert await sbx.files.read("async/data.bin", format="bytes") == b"\x00\xff" * 1000
            command = await sbx.commands.run("echo ok; exit 4")
            assert (command.stdout, command.exit_code) == ("ok\n", 4)
        assert not await sbx.is_running()

    asyncio.run(scenario())


def test_openapi_document_is_served_and_checked_in_current(api: Api) -> None:
    from sandlot.server.openapi import document

    current = document()
    checked_in = json.loads(OPENAPI.read_text())
    assert checked_in == current, (
        "docs/openapi.json is stale; regenerate it with: "
        "python -m sandlot.server.openapi > docs/openapi.json"
    )
    assert httpx.get(f"{api.server.url}/openapi.json").status_code == 401
    with api.client(api.alice) as client:
        assert client.get("/openapi.json").json() == current


def test_precheck_policy_applies_in_remote_mode(api: Api) -> None:
    with Sandbox(api_url=api.server.url, api_key=api.alice, precheck="refuse") as sbx:
        refused = sbx.run_code("import ctypes")
        assert refused.status == "error" and refused.error is not None
        assert refused.error.name == "PrecheckRefused"
        assert refused.precheck is not None and refused.precheck.flagged
        fine = sbx.run_code("6 * 7")
        assert fine.text == "42" and fine.precheck is not None and not fine.precheck.flagged
        assert fine.usage is not None and fine.usage.memory_peak_bytes
    rows = _audit_rows(api, sbx.sandbox_id)
    assert [row["code"] for row in rows] == ["6 * 7"]  # the refused cell never reached it


def _audit_rows(api: Api, sandbox_id: str) -> list[dict[str, Any]]:
    out = api.server.cli("audit", "--sandbox", sandbox_id, "--json").stdout
    return [json.loads(line) for line in out.splitlines()]


def test_cell_code_that_is_not_unicode_text_is_a_400(api: Api, alice: httpx.Client) -> None:
    """JSON may spell a lone surrogate (``\\ud800``), which no UTF-8 text holds: the
    cell is refused before it starts (a typed 400), not answered as a server error."""
    sandbox_id = _create(alice)
    try:
        for body in (
            b'{"code": "print(\\"\\ud800\\")"}',
            b'{"code": "1", "env_vars": {"A": "\\udfff"}}',
        ):
            response = alice.post(
                f"/v1/sandboxes/{sandbox_id}/execute",
                content=body,
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, response.text
            assert _error_of(response)["type"] == "InvalidArgumentError"
        assert _run(alice, sandbox_id, "print('still fine')")[0]["text"] == "still fine\n"
    finally:
        alice.delete(f"/v1/sandboxes/{sandbox_id}")
