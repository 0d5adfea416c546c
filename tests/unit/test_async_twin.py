"""The asyncio twins cannot drift from the sync ones: same public members, same
parameters (names, order, kinds, defaults), every method awaited.

Annotations may differ where the async twin accepts more (coroutine callbacks) or
returns an async value (``files.read(format="stream")``), so they are not compared.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from sandlot import AsyncSandbox, Sandbox
from sandlot._async import (
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFilesystem,
    AsyncPty,
    AsyncWatchHandle,
)
from sandlot._process import CommandHandle
from sandlot._sandbox import Commands, Filesystem, Pty
from sandlot._watch import WatchHandle

TWINS = [
    (Sandbox, AsyncSandbox),
    (Filesystem, AsyncFilesystem),
    (Commands, AsyncCommands),
    (Pty, AsyncPty),
    (CommandHandle, AsyncCommandHandle),
    (WatchHandle, AsyncWatchHandle),
]

SYNC_ONLY: dict[tuple[type, str], str] = {
    (Sandbox, "create"): "the async twin's create is the constructor; compared below",
    (Sandbox, "__enter__"): "async twin: __aenter__",
    (Sandbox, "__exit__"): "async twin: __aexit__",
    (CommandHandle, "__iter__"): "async twin: __aiter__",
}
"""Public sync members the async twin spells differently, each with its reason."""


def _public(cls: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # without object
        for name, value in vars(klass).items():
            if not name.startswith("_") or name in ("__enter__", "__exit__"):
                members[name] = value
    return members


def _shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter after self/cls."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize(("sync", "twin"), TWINS, ids=lambda c: c.__name__)
def test_every_public_sync_member_has_an_async_twin(sync: type, twin: type) -> None:
    sync_members = _public(sync)
    twin_members = _public(twin)
    missing = [
        name for name in sync_members if name not in twin_members and (sync, name) not in SYNC_ONLY
    ]
    assert not missing, f"{twin.__name__} lacks {missing}"
    extra = [name for name in twin_members if name not in sync_members]
    assert not extra or (twin is AsyncSandbox and set(extra) == {"create"}), extra


@pytest.mark.parametrize(("sync", "twin"), TWINS, ids=lambda c: c.__name__)
def test_methods_have_the_same_parameters_and_are_awaited(sync: type, twin: type) -> None:
    for name, member in _public(sync).items():
        if (sync, name) in SYNC_ONLY:
            continue
        other = _public(twin)[name]
        if isinstance(member, property):
            assert isinstance(other, property), f"{twin.__name__}.{name} is not a property"
            continue
        function = getattr(twin, name)
        assert inspect.iscoroutinefunction(function), f"{twin.__name__}.{name} is not async"
        assert _shape(getattr(sync, name)) == _shape(function), f"{twin.__name__}.{name}"


def test_async_create_takes_the_constructors_parameters() -> None:
    assert _shape(Sandbox.__init__) == _shape(AsyncSandbox.create.__func__)  # type: ignore[attr-defined]


def test_the_comparison_sees_a_difference() -> None:
    # Control: a twin whose default drifted is caught by the same shape comparison.
    class Drifted:
        async def run(self, cmd: str, cwd: str | None = "/tmp") -> None: ...

    assert _shape(Commands.run)[:2] != _shape(Drifted.run)
