"""The server with its key store and audit trail on a real PostgreSQL (a throwaway
cluster on a unix socket), including a SIGKILL and restart."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

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
    with postgres("audit", prefix="pg-test-", settings="-c fsync=on") as url:
        yield url


def test_audit_and_keys_on_postgresql_survive_a_crash(postgres_url: str, tmp_path: Path) -> None:
    import psycopg

    env = {"SANDLOT_DATABASE_URL": postgres_url}
    server = ServerProcess(tmp_path / "state", env=env).start()
    try:
        key = server.key("pg-tenant")
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
            sandbox_id = client.post("/v1/sandboxes", json={}).json()["sandbox_id"]
            answer = client.post(f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "6 * 7"})
            assert '"text": "42"' in answer.text
            with client.stream(
                "POST",
                f"/v1/sandboxes/{sandbox_id}/execute",
                json={"code": "import time\nprint('go', flush=True)\ntime.sleep(600)"},
            ) as response:
                next(response.iter_lines())
                server.stop(signal.SIGKILL)
        server.start()
        out = server.cli("audit", "--sandbox", sandbox_id, "--json").stdout
        rows = [json.loads(line) for line in out.splitlines()]
        assert [row["outcome"] for row in rows] == ["ok", "killed"]
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
            assert client.get("/v1/sandboxes").json() == []  # the key still works
    finally:
        server.stop()
    # The rows are in PostgreSQL (not in a SQLite file in the state directory).
    assert not (tmp_path / "state" / "sandlot.db").exists()
    conninfo = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo) as conn:
        count = conn.execute(
            "select count(*) from executions where sandbox_id = %s", (sandbox_id,)
        ).fetchone()
        assert count is not None and count[0] == 2


def test_audit_bounds_and_retention_on_postgresql(postgres_url: str) -> None:
    from audit_store_checks import (
        check_bounds_and_retention,
        check_old_database_gets_the_count_column,
        check_operations,
    )

    check_old_database_gets_the_count_column(postgres_url)
    # The same database: the tables exist and hold rows; the checks use their own ids.
    check_bounds_and_retention(postgres_url)
    check_operations(postgres_url)
