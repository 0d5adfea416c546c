"""The unmodified ``e2b`` package's envd 0.6.x file features against a real
``sandlot serve``: file metadata (``X-Metadata-*`` upload headers, ``EntryInfo.metadata``
from Stat/ListDir/Move) and watch events with their entry (``include_entry``,
``allow_network_mounts``), sync and async, in E2B's normal mode."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
]

WAIT = 30.0


class Wire:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.key = server.key("e2b-metadata")

    def opts(self) -> dict[str, Any]:
        return self.server.e2b_opts(self.key)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    server = ServerProcess(tmp_path_factory.mktemp("e2b-metadata")).start()
    try:
        yield Wire(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sbx(wire: Wire) -> Iterator[Any]:
    from e2b import Sandbox

    sandbox = Sandbox.create(timeout=300, **wire.opts())
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_sandlot_reports_the_envd_version_that_unlocks_these_features(sbx: Any) -> None:
    from packaging.version import Version

    assert sbx._envd_version == Version("0.6.4")


@pytest.mark.parametrize("octet_stream", [False, True])
def test_metadata_round_trips_through_every_read(sbx: Any, octet_stream: bool) -> None:
    base = f"meta-{int(octet_stream)}"
    sbx.files.make_dir(base)
    info = sbx.files.write(
        f"{base}/a.txt", "x", metadata={"Author": "mish"}, use_octet_stream=octet_stream
    )
    assert info.metadata == {"author": "mish"}  # lowercased, as envd does
    assert sbx.files.get_info(f"{base}/a.txt").metadata == {"author": "mish"}
    listed = {entry.name: entry.metadata for entry in sbx.files.list(base)}
    assert listed == {"a.txt": {"author": "mish"}}
    assert sbx.files.rename(f"{base}/a.txt", f"{base}/b.txt").metadata == {"author": "mish"}
    # An overwrite without metadata clears it; a directory has none.
    assert sbx.files.write(f"{base}/b.txt", "y", use_octet_stream=octet_stream).metadata is None
    assert sbx.files.get_info(f"{base}/b.txt").metadata is None
    assert sbx.files.get_info(base).metadata is None


def test_write_files_applies_the_metadata_to_every_file(sbx: Any) -> None:
    infos = sbx.files.write_files(
        [
            {"path": "multi-meta/1.txt", "data": "1"},
            {"path": "multi-meta/2.bin", "data": io.BytesIO(b"2")},
        ],
        metadata={"source": "suite"},
    )
    assert [info.metadata for info in infos] == [{"source": "suite"}] * 2
    assert [sbx.files.get_info(info.path).metadata for info in infos] == [{"source": "suite"}] * 2


def test_an_attribute_set_by_user_code_is_metadata(sbx: Any) -> None:
    sbx.files.write("oob.txt", "x")
    sbx.commands.run(
        "python3 -c \"import os; os.setxattr('/home/user/oob.txt', 'user.e2b.k', b'v')\""
    )
    assert sbx.files.get_info("oob.txt").metadata == {"k": "v"}


def test_metadata_the_sdk_lets_through_but_sandlot_refuses_is_a_400(wire: Wire, sbx: Any) -> None:
    """The SDK checks characters only; the size limits are the server's (as envd's)."""
    from e2b.exceptions import InvalidArgumentException

    with pytest.raises(InvalidArgumentException):
        sbx.files.write("too-big.txt", "x", metadata={"k": "v" * 5000})
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("too-long-key.txt", "x", metadata={"k" * 247: "v"})
    assert not sbx.files.exists("too-big.txt")
    assert not sbx.files.exists("too-long-key.txt")
    # sandlot's own API takes the same headers, with the same checks.
    url = f"{wire.server.url}/v1/sandboxes/{sbx.sandbox_id}/files"
    headers = {"authorization": f"Bearer {wire.key}", "x-metadata-k": "v" * 5000}
    response = httpx.post(url, params={"path": "v1.txt"}, content=b"x", headers=headers)
    assert response.status_code == 400, response.text


def _events_until(handle: Any, name: str, kind: Any) -> list[Any]:
    seen: list[Any] = []
    deadline = time.monotonic() + WAIT
    while not any(event.name == name and event.type == kind for event in seen):
        assert time.monotonic() < deadline, seen
        seen += handle.get_new_events()
        time.sleep(0.05)
    return seen


def test_watch_events_carry_their_entry_and_network_mounts_are_allowed(sbx: Any) -> None:
    from e2b import FilesystemEventType, FileType

    sbx.files.make_dir("watch-entry")
    sbx.files.write("watch-entry/f.txt", "old")
    with_entry = sbx.files.watch_dir("watch-entry", include_entry=True)
    mounts = sbx.files.watch_dir("watch-entry", allow_network_mounts=True)
    try:
        sbx.files.write("watch-entry/f.txt", "new", metadata={"tag": "w"})
        sbx.files.remove("watch-entry/f.txt")
        seen = _events_until(with_entry, "f.txt", FilesystemEventType.REMOVE)
        # Each entry is what the file was when its event was read: the last write's
        # follows the data (and the metadata, stored before it).
        write = [e for e in seen if e.type == FilesystemEventType.WRITE][-1]
        assert write.entry is not None
        assert write.entry.path == "/home/user/watch-entry/f.txt"
        assert write.entry.type == FileType.FILE
        assert write.entry.metadata == {"tag": "w"}
        removed = next(e for e in seen if e.type == FilesystemEventType.REMOVE)
        assert removed.entry is None
        plain = _events_until(mounts, "f.txt", FilesystemEventType.REMOVE)
        assert any(e.type == FilesystemEventType.WRITE for e in plain)
        assert all(e.entry is None for e in plain)
    finally:
        with_entry.stop()
        mounts.stop()


def test_async_metadata_and_streamed_watch_entries(wire: Wire) -> None:
    from e2b import AsyncSandbox, FilesystemEventType

    async def scenario() -> tuple[Any, Any, list[Any]]:
        got: list[Any] = []
        arrived = asyncio.Event()

        def on_event(event: Any) -> None:
            got.append(event)
            # The entry is read when the event is: the write of the data has it all.
            if event.entry is not None and event.entry.metadata == {"k": "v"}:
                arrived.set()

        asbx = await AsyncSandbox.create(timeout=120, **wire.opts())
        try:
            await asbx.files.make_dir("/home/user/awatch")
            watch = await asbx.files.watch_dir(
                "/home/user/awatch", on_event, include_entry=True, allow_network_mounts=True
            )
            info = await asbx.files.write("/home/user/awatch/a.txt", "x", metadata={"k": "v"})
            await asyncio.wait_for(arrived.wait(), WAIT)
            await watch.stop()
            stat = await asbx.files.get_info("/home/user/awatch/a.txt")
        finally:
            await asbx.kill()
        return info.metadata, stat.metadata, got

    written, stat, events = asyncio.run(scenario())
    assert written == stat == {"k": "v"}
    entries = [e.entry for e in events if e.entry is not None and e.entry.metadata]
    assert entries[-1].path == "/home/user/awatch/a.txt"
    assert all(e.entry is None for e in events if e.type == FilesystemEventType.REMOVE)
