"""The server's egress audit trail under attack from a tenant's sandbox: a flood of
refusals with huge names, and names that forge audit lines. A real ``sandlot serve``
subprocess (names resolve only from its hosts file; nothing leaves the machine).

The rows must stay bounded while keeping the count of every connection, the server's
memory must not follow the flood, and ``sandlot audit --network`` must print one
escaped line per row.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from egress_helpers import TEST_NAMES
from flood_code import ASK, FLOOD, FORGED, INJECT

from _server_harness import ServerProcess
from sandlot import Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

BURST, RATE = 20, 1.0
"""The proxy's documented refusal-record limit per sandbox: a burst, then per second."""
MiB = 1024 * 1024
ESCAPED = FORGED.lower().replace("\n", "\\n").replace("\t", "\\t").replace("\x1b", "\\x1b")


def start(state: Path, *args: str) -> ServerProcess:
    hosts = state / "hosts"
    state.mkdir(parents=True, exist_ok=True)
    hosts.write_text("".join(f"{address} {name}\n" for name, address in TEST_NAMES.items()))
    return ServerProcess(
        state, "--egress-hosts", str(hosts), "--egress-allow", "allowed.test", *args
    ).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start(tmp_path_factory.mktemp("audit-server"))
    try:
        yield process
    finally:
        process.stop()


def sandbox(server: ServerProcess, key: str) -> Sandbox:
    return Sandbox(
        api_url=server.url, api_key=key, network={"allow_out": ["allowed.test"]}, timeout=600
    )


def rows_of(server: ServerProcess, sandbox_id: str, connections: int) -> list[dict[str, Any]]:
    """The sandbox's audit rows once they account for ``connections`` (or after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        out = server.cli(
            "audit", "--network", "--json", "--limit", "1000000", "--sandbox", sandbox_id
        ).stdout
        rows = [json.loads(line) for line in out.splitlines()]
        if sum(row.get("count", 1) for row in rows) >= connections:
            return rows
        if time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def database_bytes(state: Path) -> int:
    return sum(path.stat().st_size for path in state.glob("sandlot.db*"))


def test_a_refusal_flood_leaves_bounded_rows_and_server_memory(server: ServerProcess) -> None:
    assert server.process is not None
    pid = server.process.pid
    key = server.key("flooder")
    with sandbox(server, key) as sbx:
        sbx.run_code("1")
        rss_before = status_kib(pid, "VmRSS")
        db_before = database_bytes(server.state_dir)
        execution = sbx.run_code(FLOOD, timeout=120)
        assert execution.error is None, execution.error
        counts = json.loads(execution.logs.stdout[-1])
        sandbox_id = sbx.sandbox_id
    attempts = counts["connect"] + counts["socks5"]
    assert counts["other"] == 0, counts
    assert attempts > 4 * BURST, f"the flood was too slow to tell: {counts}"
    # Remote mode gets the same bounded records, counts included.
    network = execution.network or []
    assert len(network) <= BURST + RATE * (counts["seconds"] + 5) + 4
    assert sum(event.count for event in network) == attempts
    rows = rows_of(server, sandbox_id, attempts)
    growth = (status_kib(pid, "VmHWM") - rss_before) * 1024
    db_growth = database_bytes(server.state_dir) - db_before
    bound = BURST + RATE * (counts["seconds"] + 5) + 4
    measured = (
        f"{attempts} refusals -> {len(rows)} rows, server peak +{growth / MiB:.1f} MiB, "
        f"database +{db_growth / MiB:.1f} MiB"
    )
    print(measured)
    assert len(rows) <= bound, measured
    assert sum(row["count"] for row in rows) == attempts, measured  # nothing silently lost
    assert all(row["tenant"] == "flooder" and row["verdict"] == "refused" for row in rows)
    assert all(len(row["host"]) <= 255 and len(row["reason"]) <= 1024 for row in rows)
    assert growth < 64 * MiB, measured
    assert db_growth < 4 * MiB, measured


def test_forged_names_stay_on_one_escaped_audit_line(server: ServerProcess) -> None:
    alice = server.key("alice")
    with sandbox(server, alice) as sbx:
        assert json.loads(sbx.run_code(INJECT).logs.stdout[-1]) == [True, True]
        sandbox_id = sbx.sandbox_id
    rows = rows_of(server, sandbox_id, 2)
    table = server.cli("audit", "--network", "--sandbox", sandbox_id).stdout
    lines = table.splitlines()
    assert len(lines) == len(rows) == 2, table  # one line per record: nothing forged
    assert all(line.split()[1] == "alice" for line in lines), table
    assert all(ESCAPED in line for line in lines), table
    assert sorted(row["method"] for row in rows) == ["CONNECT", "SOCKS5"]
    assert all(row["host"] == ESCAPED for row in rows)  # stored escaped
    assert all(line.isprintable() for line in lines), table  # no ESC, no tab
    # The server's own log: no raw escape anywhere; its records are JSON lines.
    log = server.log()
    assert "\x1b" not in log
    messages = [json.loads(line)["message"] for line in log.splitlines() if line[:1] == "{"]
    assert any(ESCAPED in message for message in messages)


def test_retention_by_age_and_rows(tmp_path: Path) -> None:
    """``--audit-max-age`` deletes old rows when the server starts; ``--audit-max-rows``
    keeps the newest rows while records are written."""
    state = tmp_path / "retention"
    first = start(state)
    first.key("setup")  # the database and its tables exist from here on
    first.stop()
    old = time.time() - 3 * 86400
    with sqlite3.connect(state / "sandlot.db") as db:
        db.executemany(
            "INSERT INTO network_events (time, tenant, sandbox_id, method, host, port, "
            "verdict, reason, bytes_in, bytes_out) VALUES (?, 'old', 'old', 'CONNECT', ?, 1, "
            "'refused', 'old', 0, 0)",
            [(old, f"old{n}.test") for n in range(30)],
        )
    server = start(state, "--audit-max-age", "2", "--audit-max-rows", "5")
    try:
        # Gone at start: older than 2 days (the row cap alone would keep 5 of them).
        assert server.cli("audit", "--network", "--json").stdout == ""
        hosts = [f"h{n}.test" for n in range(12)]
        with sandbox(server, server.key("bounded")) as sbx:
            code = ASK + f"print(json.dumps([connect(h, 443) for h in {hosts!r}]))"
            assert json.loads(sbx.run_code(code).logs.stdout[-1]) == [True] * 12
            sandbox_id = sbx.sandbox_id
        deadline = time.monotonic() + 60
        while True:  # until the last record is written (the cap keeps at most 5)
            out = server.cli("audit", "--network", "--json", "--limit", "1000").stdout
            rows = [json.loads(line) for line in out.splitlines()]
            if (rows and rows[-1]["host"] == hosts[-1]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        server.stop()
    assert [row["host"] for row in rows] == hosts[-5:]
    assert {row["sandbox_id"] for row in rows} == {sandbox_id}
