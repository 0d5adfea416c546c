"""files.watch_dir in the SDK, against the shipped fake (:class:`sandlot.testing.FakeBackend`):
what the host side sends, folds and keeps bounded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import sandlot._watch as watch_module
from sandlot import (
    AsyncSandbox,
    FilesystemEvent,
    InvalidArgumentError,
    PathNotAllowedError,
    Sandbox,
    SandlotError,
    WatchLimitError,
)
from sandlot.testing import FakeBackend, echo_handler

RELEASE = threading.Event()


def handler(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind = request["type"]
    if kind == "fs_watch":
        if request["path"] == "full":
            yield {
                "type": "reply",
                "ok": False,
                "error": {"name": "WatchLimitError", "message": "16 watches"},
            }
            return
        if request["path"] == "/etc":
            yield {
                "type": "reply",
                "ok": False,
                "error": {"name": "PathNotAllowedError", "message": "outside"},
            }
            return
        yield {"type": "watching"}
        yield {"type": "fs_event", "event": "create", "name": "a"}
        yield {"type": "fs_event", "event": "something-new", "name": "ignored"}
        yield {"type": "fs_event", "event": "remove", "name": "a"}
        if request["path"] == "ends":
            yield {"type": "exit", "status": "ok"}
        # else: runs until fs_watch_stop, like a real watch
    elif kind == "fs_watch_stop":
        yield {"type": "reply", "ok": True, "value": True}
    else:
        yield from echo_handler(request)


def test_events_requests_and_stop() -> None:
    backend = FakeBackend(handler)
    with Sandbox(backend=backend) as sbx:
        handle = sbx.files.watch_dir("dir", recursive=True)
        events: list[FilesystemEvent] = []
        while len(events) < 2:
            events += handle.get_new_events()
        assert events == [FilesystemEvent("a", "create"), FilesystemEvent("a", "remove")]
        assert handle.running
        handle.stop()
        assert not handle.running
        with pytest.raises(SandlotError):
            handle.get_new_events()
    watch = next(r for r in backend.requests if r["type"] == "fs_watch")
    assert watch["path"] == "dir" and watch["recursive"] is True
    stop = next(r for r in backend.requests if r["type"] == "fs_watch_stop")
    assert stop["target"] == watch["id"]


def test_a_watch_that_ends_is_not_running() -> None:
    with Sandbox(backend=FakeBackend(handler)) as sbx:
        handle = sbx.files.watch_dir("ends")
        assert handle.wait(10)
        assert not handle.running
        assert [e.type for e in handle.get_new_events()] == ["create", "remove"]
        handle.stop()


def test_refusals_are_typed() -> None:
    with Sandbox(backend=FakeBackend(handler)) as sbx:
        with pytest.raises(WatchLimitError):
            sbx.files.watch_dir("full")
        with pytest.raises(PathNotAllowedError):
            sbx.files.watch_dir("/etc")
        with pytest.raises(InvalidArgumentError):
            sbx.files.watch_dir("x", recursive="yes")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            sbx.files.watch_dir("x", on_event="print")  # type: ignore[arg-type]


def test_kept_events_are_bounded_with_an_overflow_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "KEPT_EVENTS", 1)
    with Sandbox(backend=FakeBackend(handler)) as sbx:
        handle = sbx.files.watch_dir("ends")
        assert handle.wait(10)
        assert handle.get_new_events() == [
            FilesystemEvent("a", "create"),
            FilesystemEvent("1 events dropped", "overflow"),
        ]
        handle.stop()


def test_echo_handler_fakes_a_watch() -> None:
    with Sandbox(backend=FakeBackend(echo_handler)) as sbx:
        handle = sbx.files.watch_dir("some/dir")
        assert handle.wait(10)
        assert handle.get_new_events() == [FilesystemEvent("some/dir", "create")]
        handle.stop()


def test_async_twin_awaits_a_coroutine_callback() -> None:
    async def main() -> list[FilesystemEvent]:
        got: list[FilesystemEvent] = []

        async def on_event(event: FilesystemEvent) -> None:
            got.append(event)

        async with AsyncSandbox(Sandbox(backend=FakeBackend(handler))) as sbx:
            handle = await sbx.files.watch_dir("ends", on_event=on_event)
            assert await handle.wait(10)
            await handle.stop()
        return got

    assert asyncio.run(main()) == [FilesystemEvent("a", "create"), FilesystemEvent("a", "remove")]
