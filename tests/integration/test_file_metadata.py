"""File metadata (``files.write(..., metadata=)``) and watch entries
(``watch_dir(..., include_entry=True)``) against real sandboxes: every backend, and
remote mode through a real ``sandlot serve``. The metadata lives in ``user.e2b.*``
extended attributes of the file inside the sandbox; nothing here is faked."""

from __future__ import annotations

import asyncio
import io
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import sandlot
from sandlot import (
    AsyncSandbox,
    FilesystemEvent,
    InvalidArgumentError,
    Sandbox,
    WatchHandle,
)
from sandlot.protocol import CHUNK_BYTES

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template, pytest.mark.all_backends]

WAIT = 60.0
"""Seconds to wait for an event; generous, the machine is shared."""


def _name(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def _xattr(sbx: Sandbox, code: str) -> str:
    """Run the Python ``code`` as user code in the sandbox; its stdout."""
    result = sbx.commands.run("python3 -c " + shlex.quote(code))
    assert result.exit_code == 0, result.stderr
    return result.stdout


def test_metadata_is_stored_and_reported_by_info_list_and_rename(sandbox: Sandbox) -> None:
    directory = _name("meta")
    path = f"{directory}/a.txt"
    written = sandbox.files.write(path, "content", metadata={"Author": "mish", "stage": "1"})
    # Keys are lowercased (they travel as HTTP header names too).
    assert written.metadata == {"author": "mish", "stage": "1"}
    assert sandbox.files.get_info(path).metadata == {"author": "mish", "stage": "1"}
    listed = {entry.name: entry.metadata for entry in sandbox.files.list(directory)}
    assert listed == {"a.txt": {"author": "mish", "stage": "1"}}
    moved = sandbox.files.rename(path, f"{directory}/b.txt")
    assert moved.metadata == {"author": "mish", "stage": "1"}
    assert sandbox.files.read(f"{directory}/b.txt") == "content"
    # It is the file's own extended attributes, as user code in the sandbox sees them.
    seen = _xattr(
        sandbox,
        f"import os\nprint(sorted(os.listxattr('/home/user/{directory}/b.txt')))",
    )
    assert seen.strip() == "['user.e2b.author', 'user.e2b.stage']"


def test_a_write_replaces_the_metadata_and_one_without_clears_it(sandbox: Sandbox) -> None:
    path = _name("over") + ".txt"
    sandbox.files.write(path, "one", metadata={"a": "1", "b": "2"})
    assert sandbox.files.write(path, "two", metadata={"b": "3"}).metadata == {"b": "3"}
    assert sandbox.files.get_info(path).metadata == {"b": "3"}
    assert sandbox.files.write(path, "three").metadata is None
    assert sandbox.files.get_info(path).metadata is None
    assert sandbox.files.read(path) == "three"


def test_write_files_gives_every_file_the_same_metadata(sandbox: Sandbox) -> None:
    directory = _name("multi")
    infos = sandbox.files.write_files(
        [
            {"path": f"{directory}/one.txt", "data": "1"},
            {"path": f"/tmp/{directory}-two.bin", "data": b"\x00\x01"},
            {"path": f"{directory}/three.txt", "data": io.BytesIO(b"3")},
        ],
        metadata={"source": "suite"},
    )
    assert [info.metadata for info in infos] == [{"source": "suite"}] * 3
    for info in infos:
        assert sandbox.files.get_info(info.path).metadata == {"source": "suite"}


def test_a_streamed_write_of_many_chunks_keeps_its_metadata(sandbox: Sandbox) -> None:
    path = _name("big") + ".bin"
    data = os.urandom(CHUNK_BYTES + 1000)  # two fs_write requests: write, then append
    info = sandbox.files.write(path, io.BytesIO(data), metadata={"size": str(len(data))})
    assert info.metadata == {"size": str(len(data))}
    assert sandbox.files.get_info(path).size == len(data)
    assert sandbox.files.get_info(path).metadata == {"size": str(len(data))}


def test_attributes_set_in_the_sandbox_are_metadata_within_the_limits(sandbox: Sandbox) -> None:
    path = _name("oob") + ".txt"
    sandbox.files.write(path, "x")
    _xattr(
        sandbox,
        textwrap.dedent(
            f"""\
            import os
            p = '/home/user/{path}'
            os.setxattr(p, 'user.e2b.author', b'mish')
            os.setxattr(p, 'user.other', b'not metadata')
            os.setxattr(p, 'user.e2b.huge', b'v' * 6000)"""
        ),
    )
    # Only the user.e2b. namespace is metadata, and what would pass the 4096-byte
    # budget (set by other means than files.write) is left out, never cut.
    assert sandbox.files.get_info(path).metadata == {"author": "mish"}


@pytest.mark.parametrize(
    "metadata",
    [
        {"bad key": "v"},
        {"": "v"},
        {"good": "bad\nvalue"},
        {"good": "value\n"},
        {"key\n": "v"},
        {"k": "é"},
        {"k" * 247: "v"},
        {"big": "v" * 4096},
        {"Same": "1", "same": "2"},
        {"k": 1},
    ],
)
def test_bad_metadata_is_refused_before_anything_is_written(
    sandbox: Sandbox, metadata: dict[str, str]
) -> None:
    path = _name("bad") + ".txt"
    with pytest.raises(InvalidArgumentError):
        sandbox.files.write(path, "x", metadata=metadata)
    with pytest.raises(InvalidArgumentError):
        sandbox.files.write_files([{"path": path, "data": "x"}], metadata=metadata)
    assert not sandbox.files.exists(path)


def _until(handle: WatchHandle, done: tuple[str, str]) -> list[FilesystemEvent]:
    """The handle's events up to the (name, type) ``done``; the handle's own thread
    delivers them, so a remote watch may lag the call that caused them."""
    seen: list[FilesystemEvent] = []
    deadline = time.monotonic() + WAIT
    while not any((event.name, event.type) == done for event in seen):
        assert time.monotonic() < deadline, seen
        seen += handle.get_new_events()
        time.sleep(0.02)
    return seen


def test_watch_events_carry_the_entry_with_its_metadata(sandbox: Sandbox) -> None:
    directory = _name("watch")
    sandbox.files.make_dir(directory)
    sandbox.files.write(f"{directory}/f.txt", "old")
    handle = sandbox.files.watch_dir(directory, include_entry=True)
    plain = sandbox.files.watch_dir(directory)
    try:
        sandbox.files.write(f"{directory}/f.txt", "new content", metadata={"tag": "w"})
        sandbox.files.remove(f"{directory}/f.txt")
        seen = _until(handle, ("f.txt", "remove"))
        writes = [event for event in seen if event.type == "write"]
        assert writes, seen
        entry = writes[-1].entry
        assert entry is not None
        assert entry.path == f"/home/user/{directory}/f.txt"
        assert entry.name == "f.txt" and entry.size == len("new content")
        assert entry.metadata == {"tag": "w"}
        # Gone by the time it is reported: a remove has no entry to give.
        assert [event.entry for event in seen if event.type == "remove"] == [None]
        # Without include_entry, no entry at all.
        assert all(event.entry is None for event in _until(plain, ("f.txt", "remove")))
    finally:
        handle.stop()
        plain.stop()


def test_async_twin_writes_metadata_and_watches_entries(sandbox: Sandbox) -> None:
    """The async SDK is the same implementation, driven from an event loop."""
    directory = _name("async")
    sandbox.files.make_dir(directory)

    async def scenario() -> tuple[object, object, list[FilesystemEvent]]:
        asbx = AsyncSandbox(sandbox)
        got: list[FilesystemEvent] = []
        arrived = asyncio.Event()

        def on_event(event: FilesystemEvent) -> None:
            got.append(event)
            if event.entry is not None and event.entry.metadata == {"k": "v"}:
                arrived.set()

        watch = await asbx.files.watch_dir(directory, on_event, include_entry=True)
        try:
            info = await asbx.files.write(f"{directory}/a.txt", "x", metadata={"k": "v"})
            many = await asbx.files.write_files(
                [{"path": f"{directory}/b.txt", "data": "y"}], metadata={"k": "w"}
            )
            await asyncio.wait_for(arrived.wait(), WAIT)
        finally:
            await watch.stop()
        return info.metadata, [m.metadata for m in many], got

    written, many, events = asyncio.run(scenario())
    assert written == {"k": "v"}
    assert many == [{"k": "w"}]
    assert any(e.entry is not None and e.entry.metadata == {"k": "v"} for e in events), events


@pytest.mark.local_only
def test_a_filesystem_without_user_attributes_fails_the_write_typed(tmp_path: Path) -> None:
    """ramfs keeps no user.* attributes (EOPNOTSUPP), as tmpfs before Linux 6.6 did: the
    runner's write refuses the metadata (FileOperationError, saying why and how to fix)
    and leaves no file, rather than store the data without it. A real ramfs, mounted in
    a user namespace of this test's own."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a ramfs")
    root = tmp_path / "ramfs"
    root.mkdir()
    script = textwrap.dedent(
        f"""\
        import subprocess, sys
        subprocess.run(["mount", "-t", "ramfs", "none", {str(root)!r}], check=True)
        from sandlot.runner._files import Files, MetadataRefused
        files = Files({str(root)!r}, roots=({str(root)!r},))
        files.write("plain.txt", b"data", False, None)  # no metadata: fine
        assert files.stat("plain.txt").get("metadata") is None
        try:
            files.write("meta.txt", b"data", False, None, {{"k": "v"}})
        except MetadataRefused as exc:
            assert exc.name == "FileOperationError", exc.name
            print(exc)
        else:
            sys.exit("metadata on ramfs did not fail")
        import os
        assert not os.path.exists({str(root / "meta.txt")!r})
        """
    )
    src = str(Path(sandlot.__file__).resolve().parents[1])  # the sandlot under test
    result = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=60,
    )
    if result.returncode != 0 and "unshare" in result.stderr and "Operation" in result.stderr:
        pytest.skip(f"no user namespace to mount a ramfs in: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "user extended attributes" in result.stdout
    assert "Linux 6.6" in result.stdout
