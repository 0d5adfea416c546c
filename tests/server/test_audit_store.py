"""The audit trail's bounds (escaping, caps, retention) on SQLite; the same checks run
on PostgreSQL in test_postgres.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from audit_store_checks import check_bounds_and_retention, check_old_database_gets_the_count_column

pytestmark = [pytest.mark.requires_server]


def test_an_old_database_gets_the_count_column(tmp_path: Path) -> None:
    check_old_database_gets_the_count_column(f"sqlite:///{tmp_path / 'old.db'}")


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
    finally:
        store.close()


def test_audit_sync_is_checked(tmp_path: Path) -> None:
    from sandlot import InvalidArgumentError
    from sandlot.server._store import Store

    with pytest.raises(InvalidArgumentError, match="audit_sync"):
        Store(f"sqlite:///{tmp_path / 'audit.db'}", audit_sync="off")  # type: ignore[arg-type]
