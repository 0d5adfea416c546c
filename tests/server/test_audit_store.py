"""The audit trail's bounds (escaping, caps, retention) on SQLite; the same checks run
on PostgreSQL in test_postgres.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from audit_store_checks import (
    check_bounds_and_retention,
    check_old_database_gets_the_count_column,
    check_operations,
)

pytestmark = [pytest.mark.requires_server]


def test_an_old_database_gets_the_count_column(tmp_path: Path) -> None:
    check_old_database_gets_the_count_column(f"sqlite:///{tmp_path / 'old.db'}")


def test_operations_table_on_an_old_database(tmp_path: Path) -> None:
    check_operations(f"sqlite:///{tmp_path / 'ops.db'}")


def test_bounds_and_retention(tmp_path: Path) -> None:
    check_bounds_and_retention(f"sqlite:///{tmp_path / 'audit.db'}")


@pytest.mark.parametrize(("sync", "pragma"), [("normal", 1), ("full", 2)])
def test_sqlite_commits_as_audit_sync_says(tmp_path: Path, sync: str, pragma: int) -> None:
    from sandlot.server._store import Store

    store = Store(f"sqlite:///{tmp_path / 'audit.db'}", audit_sync=sync)  # type: ignore[arg-type]
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == pragma
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        # The hot path's own connections (key lookups, a cell's audit rows) too.
        assert store._driver is not None
        driver = store._driver._connection()
        assert driver.execute("PRAGMA synchronous").fetchone() == (pragma,)
        assert driver.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        store.close()


def test_hot_path_sees_other_processes_writes_at_once(tmp_path: Path) -> None:
    """A key revoked by `sandlot keys revoke` (another store on the same file) is refused
    by the server's next request, and the audit rows the hot path writes are the rows
    `sandlot audit` reads."""
    from sandlot.server._store import Store

    url = f"sqlite:///{tmp_path / 'audit.db'}"
    server, cli = Store(url), Store(url)
    try:
        key = cli.create_key("acme")
        principal = server.authenticate(key)
        assert principal is not None and principal.tenant == "acme"
        server.execution_started(
            execution_id="e1",
            principal=principal,
            sandbox_id="s1",
            context="default",
            code="print(1)",
            keep_code=True,
        )
        server.execution_finished("e1", {"outcome": "ok", "status": "ok", "truncated": True})
        [row] = cli.query_executions(sandbox_id="s1")
        assert (row["code"], row["outcome"], row["truncated"]) == ("print(1)", "ok", True)
        assert cli.revoke_key(principal.key_id)
        assert server.authenticate(key) is None
    finally:
        server.close()
        cli.close()


def test_audit_sync_is_checked(tmp_path: Path) -> None:
    from sandlot import InvalidArgumentError
    from sandlot.server._store import Store

    with pytest.raises(InvalidArgumentError, match="audit_sync"):
        Store(f"sqlite:///{tmp_path / 'audit.db'}", audit_sync="off")  # type: ignore[arg-type]


def test_the_clis_operation_kinds_are_the_stores() -> None:
    # The CLI spells them out (it loads the server lazily); the store is what checks them.
    import click

    from sandlot.cli._server import audit
    from sandlot.server._store import OPERATION_KINDS

    kind = next(p for p in audit.params if p.name == "kind")
    assert isinstance(kind.type, click.Choice)
    assert sorted(kind.type.choices) == sorted(OPERATION_KINDS)
