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
