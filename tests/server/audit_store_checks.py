"""Checks of the audit trail's bounds on a real database (SQLite or PostgreSQL), shared
by test_audit_store.py and test_postgres.py."""

from __future__ import annotations

import time

import sqlalchemy as sa

from sandlot.server import Store, TenantQuotas
from sandlot.server._store import Principal

HOSTILE = "evil\n2026-01-01T00:00:00Z bob allowed\x1b[2K\x1b[1A" * 100
"""A sandbox-chosen string: newlines, terminal escapes, 4,500 characters."""


def event(sandbox: str, host: str, when: float, **changes: object) -> dict[str, object]:
    return {
        "sandbox": sandbox,
        "host": host,
        "port": 443,
        "verdict": "refused",
        "reason": f"{host}:443 is not in allow_out",
        "address": None,
        "bytes_in": 0,
        "bytes_out": 0,
        "method": "CONNECT",
        "time": when,
        **changes,
    }


def check_old_database_gets_the_count_column(url: str) -> None:
    """A network_events table made before ``count`` existed: opening it adds the
    column (default 1) and the old rows stay."""
    engine = sa.create_engine(url)
    old = sa.MetaData()
    sa.Table(
        "network_events",
        old,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("time", sa.Float, nullable=False, index=True),
        sa.Column("tenant", sa.String(128), nullable=True, index=True),
        sa.Column("sandbox_id", sa.String(64), nullable=False, index=True),
        sa.Column("method", sa.String(32), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("port", sa.Integer, nullable=False),
        sa.Column("address", sa.String(64), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("bytes_in", sa.BigInteger, nullable=False),
        sa.Column("bytes_out", sa.BigInteger, nullable=False),
    )
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO network_events (time, sandbox_id, method, host, port, verdict, "
                "reason, bytes_in, bytes_out) VALUES (1, 'before', 'CONNECT', 'old.test', 443, "
                "'allowed', 'then', 1, 2)"
            )
        )
    engine.dispose()
    store = Store(url)
    try:
        store.network_event(event("after", "new.test", time.time(), count=7))
        rows = store.query_network()
    finally:
        store.close()
    assert [(row["host"], row["count"]) for row in rows] == [("old.test", 1), ("new.test", 7)]


def check_bounds_and_retention(url: str) -> None:
    """Escaped and capped fields, the row cap on every write, and the age and row caps
    of :meth:`Store.prune` on both tables (never a running cell)."""
    now = time.time()
    store = Store(url, audit_max_age=86400, audit_max_rows=10)
    try:
        store.create_key("alice", TenantQuotas(None, None, None))
        store.sandbox_started("box", "alice", "python-data")
        store.network_events([event("box", HOSTILE, now, reason=HOSTILE * 20, method=HOSTILE)])
        (row,) = store.query_network(sandbox_id="box")
        assert row["tenant"] == "alice"
        for name, cap in (("host", 255), ("reason", 1024), ("method", 32)):
            assert row[name].isprintable() and len(row[name]) <= cap, (name, row[name])
        assert row["host"].startswith("evil\\n2026-01-01T00:00:00Z bob allowed\\x1b[2K")
        assert row["host"].endswith(" chars]")

        for n in range(25):  # one by one, as the writer does when records trickle in
            store.network_event(event("box", f"h{n}.test", now))
        hosts = [row["host"] for row in store.query_network(sandbox_id="box", limit=100)]
        assert hosts == [f"h{n}.test" for n in range(15, 25)]

        principal = Principal("alice", "key")
        for n in range(12):
            store.execution_started(
                execution_id=f"cell{n}",
                principal=principal,
                sandbox_id="box",
                context="default",
                code="1",
                keep_code=True,
            )
            if n != 0:
                store.execution_finished(f"cell{n}", {"outcome": "error", "error_name": HOSTILE})
        with store.engine.begin() as conn:  # cells 0-3 ran two days ago; cell 0 still runs
            conn.execute(
                sa.text(
                    "UPDATE executions SET started_at = :old "
                    "WHERE execution_id IN ('cell0', 'cell1', 'cell2', 'cell3')"
                ),
                {"old": now - 2 * 86400},
            )
        deleted = store.prune(now)
        cells = {row["execution_id"]: row for row in store.query_executions(limit=100)}
        assert set(cells) == {"cell0", *(f"cell{n}" for n in range(4, 12))}, deleted
        assert deleted["executions"] == 3
        name = cells["cell5"]["error_name"]
        assert name.isprintable() and len(name) <= 256

        # Egress rows older than the age go too.
        store.network_event(event("box", "stale.test", now - 2 * 86400))
        store.prune(now)
        assert "stale.test" not in {row["host"] for row in store.query_network(limit=100)}
    finally:
        store.close()


def check_operations(url: str) -> None:
    """The operations table: made on a database that predates it (no migration step),
    a hostile command line escaped and capped with its full size and digest kept, an
    outcome set, a server crash closing the rows left running, and retention never
    deleting a running operation."""
    store = Store(url)
    store.close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE operations"))  # as a database made before it
    engine.dispose()
    store = Store(url, audit_max_rows=2)
    try:
        who = Principal("ops-tenant", "ops-key")
        for pid in (2**40, -1):  # any integer a caller sends; no overflow, no row lost
            odd = store.operation_started(
                principal=who, sandbox_id="odd-pid", kind="kill", target=None, pid=pid
            )
            store.operation_finished(odd, {"outcome": "error", "pid": pid})
        assert [row["pid"] for row in store.query_operations(sandbox_id="odd-pid")] == [None, None]
        line = "echo " + HOSTILE
        done = store.operation_started(
            principal=who, sandbox_id="ops-box", kind="command", target=line
        )
        store.operation_finished(done, {"outcome": "ok", "exit_code": 3})
        left = store.operation_started(
            principal=who, sandbox_id="ops-box", kind="process", target="sleep 9"
        )
        for _ in range(3):
            moved = store.operation_started(
                principal=who,
                sandbox_id="ops-box",
                kind="rename",
                target="a\nb",
                destination="c",
            )
            store.operation_finished(moved, {"outcome": "ok"})
        rows = store.query_operations(tenant="ops-tenant", sandbox_id="ops-box")
        assert [row["kind"] for row in rows] == ["command", "process", "rename", "rename", "rename"]
        command = rows[0]
        assert command["outcome"] == "ok" and command["exit_code"] == 3
        assert command["key_id"] == "ops-key" and command["sandbox_id"] == "ops-box"
        assert len(command["target"]) <= 4096 and "\n" not in command["target"]
        assert "\x1b" not in command["target"]
        assert command["target_bytes"] == len(line.encode())
        assert rows[2]["target"] == "a\\nb" and rows[2]["destination"] == "c"
        store.prune()
        kept = store.query_operations(tenant="ops-tenant", sandbox_id="ops-box")
        # The row cap keeps the newest two, and the one still running.
        assert [row["kind"] for row in kept] == ["process", "rename", "rename"]
        store.close_orphans()  # as a restarted server does: closes the operations too
        (closed,) = [
            row for row in store.query_operations(kind="process") if row["operation_id"] == left
        ]
        assert closed["outcome"] == "killed" and closed["finished_at"] is not None
    finally:
        store.close()
