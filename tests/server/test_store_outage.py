"""The key store down (PostgreSQL stopped under a running server): every way in
answers a typed 503 (``StoreUnavailable``), not a bare 500; back up, it serves again.

The cell routes' short path (:mod:`sandlot.server._shortcut`) looks the key up before
the app does: it answered a plain-text 500 (the exception escaped to the ASGI server)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from _postgres import postgres
from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
    pytest.mark.requires_postgres,
]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres("outage", prefix="pg-outage-") as url:
        yield url


def _pg_ctl(url: str, *args: str) -> None:
    """``pg_ctl`` on the fixture's cluster (its data directory sits beside its socket)."""
    sock = Path(parse_qs(urlsplit(url).query)["host"][0])
    bindir = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
    subprocess.run(
        ["runuser", "-u", "postgres", "--", bindir / "pg_ctl", "-D", sock.parent / "data", *args],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _typed_503(response: httpx.Response) -> None:
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert response.json()["type"] == "StoreUnavailable", response.text


def test_a_key_store_outage_is_a_typed_503(postgres_url: str, tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "state", env={"SANDLOT_DATABASE_URL": postgres_url})
    server.start()
    try:
        key = server.key("outage")
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as client:
            sandbox_id = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
            execute = f"/v1/sandboxes/{sandbox_id}/execute"
            assert '"text": "2"' in client.post(execute, json={"code": "1+1"}).text
            _pg_ctl(postgres_url, "-m", "immediate", "-w", "stop")
            try:
                _typed_503(client.post(execute, json={"code": "1+1"}))  # the short path
                _typed_503(client.get("/v1/sandboxes"))  # the app's routes
            finally:
                sock = Path(parse_qs(urlsplit(postgres_url).query)["host"][0])
                options = f"-k {sock} -c listen_addresses=''"
                _pg_ctl(postgres_url, "-o", options, "-l", str(sock.parent / "log"), "-w", "start")
            assert '"text": "2"' in client.post(execute, json={"code": "1+1"}).text
    finally:
        server.stop()
