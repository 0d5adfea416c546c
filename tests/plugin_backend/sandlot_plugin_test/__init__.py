"""A backend plug-in that exists only for tests: proof that a backend is added by
declaring it, with no edit anywhere in sandlot.

It is never installed: ``test_plugin_backend.py`` declares it the way an installed
package would, with a throwaway ``.dist-info`` holding an ``entry_points.txt`` in the
``sandlot.backends`` group, on the ``PYTHONPATH`` of the processes it starts (the CLI,
a script, ``sandlot serve``). Everything it does goes through sandlot's public API.

Its sandboxes are bubblewrap sandboxes (it wraps the registry's ``bwrap`` backend), so
it isolates exactly as well as bwrap, and it has the housekeeping a real backend has,
in miniature: each sandbox holds a "lease" file (as a cold bwrap sandbox holds a
cgroup) named after the process that started it, which :meth:`cleanup_orphans` removes
once that process is dead, and a recovery token that :meth:`reap` acts on. What it is
asked to do is recorded in the directory ``$SANDLOT_PLUGIN_TEST_STATE``, for the tests
to check; without that variable the backend reports itself unavailable.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandlot.backends import (
    Backend,
    EventStream,
    Finding,
    Probe,
    RecoveryToken,
    SandboxHandle,
    load_backend,
)
from sandlot.backends.host import process_start_time
from sandlot.policy import SandboxSpec

NAME = "plugin-test"
STATE_ENV = "SANDLOT_PLUGIN_TEST_STATE"
ENTRY_POINT = f"{NAME} = sandlot_plugin_test:PluginBackend"
"""The line its ``entry_points.txt`` declares in the ``[sandlot.backends]`` section."""


def state_dir() -> Path | None:
    value = os.environ.get(STATE_ENV)
    return Path(value) if value else None


def leases() -> Path:
    directory = state_dir()
    assert directory is not None, f"{STATE_ENV} is not set"
    return directory / "leases"


def lease_name(pid: int, started: str | None) -> str:
    """``<pid>.<start time>.<random>``: the owner, unambiguously (pids are reused)."""
    return f"{pid}.{started}.{uuid.uuid4().hex[:8]}"


def _record(kind: str, value: Any) -> None:
    directory = state_dir()
    if directory is not None:
        with (directory / f"{kind}.jsonl").open("a") as handle:
            handle.write(json.dumps(value) + "\n")


class PluginHandle(SandboxHandle):
    """The wrapped bwrap sandbox, plus its lease file."""

    def __init__(self, inner: SandboxHandle, lease: Path) -> None:
        self._inner = inner
        self._lease = lease

    def request(self, message: dict[str, Any]) -> EventStream:
        return self._inner.request(message)

    def kill(self) -> None:
        self._inner.kill()
        self._lease.unlink(missing_ok=True)

    @property
    def alive(self) -> bool:
        return self._inner.alive

    @property
    def death_reason(self) -> str:
        return self._inner.death_reason

    def recovery_token(self) -> RecoveryToken | None:
        return {"lease": self._lease.name, "inner": self._inner.recovery_token()}


class PluginBackend(Backend):
    """Test-only: bwrap sandboxes with a lease file each (see the module docstring)."""

    name = NAME

    def __init__(self, *, egress: Any = None) -> None:
        bwrap: Any = load_backend("bwrap")
        self._inner: Backend = bwrap() if egress is None else bwrap(egress=egress)

    @classmethod
    def probe(cls) -> Probe:
        if state_dir() is None:
            return Probe(NAME, False, f"{STATE_ENV} is not set", f"export {STATE_ENV}=DIR")
        inner = load_backend("bwrap").probe()
        # Strength 0: "auto" never picks a test backend over a real one.
        details = {"wraps": "bwrap", "state": str(state_dir())}
        return Probe(NAME, inner.available, inner.reason, inner.fix, 0, details)

    @classmethod
    def checks(cls) -> list[Finding]:
        directory = state_dir()
        if directory is None or not directory.is_dir():
            return [Finding("plugin-test state", "missing", f"no directory in {STATE_ENV}")]
        return [Finding("plugin-test state", "ok", f"leases in {directory / 'leases'}")]

    @classmethod
    def cleanup_orphans(cls) -> list[str]:
        if state_dir() is None or not leases().is_dir():
            return []
        removed = []
        for lease in sorted(leases().iterdir()):
            pid, _, rest = lease.name.partition(".")
            started = rest.partition(".")[0]
            if pid.isdigit() and process_start_time(int(pid)) == started:
                continue  # its owner is alive
            lease.unlink(missing_ok=True)
            removed.append(f"lease {lease.name}")
        _record("cleanups", removed)
        return removed

    @classmethod
    def reap(cls, token: Mapping[str, Any]) -> bool:
        _record("reaped", dict(token))
        inner = token.get("inner")
        return isinstance(inner, dict) and load_backend("bwrap").reap(inner)

    def start(self, spec: SandboxSpec) -> SandboxHandle:
        leases().mkdir(parents=True, exist_ok=True)
        lease = leases() / lease_name(os.getpid(), process_start_time(os.getpid()))
        lease.touch()
        try:
            inner = self._inner.start(spec)
        except BaseException:
            lease.unlink(missing_ok=True)
            raise
        _record("started", lease.name)
        return PluginHandle(inner, lease)
