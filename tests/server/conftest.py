"""Shared by the server tests."""

from __future__ import annotations

import pytest

E2B_ENVIRONMENT = ("E2B_DEBUG", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")


@pytest.fixture(autouse=True)
def no_e2b_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The E2B SDKs read these; a test configures them itself (arguments, or setenv),
    never inherits them from the shell that runs the tests."""
    for name in E2B_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
