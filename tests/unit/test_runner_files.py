"""The runner's files.* operations (``sandlot.runner._files``), on the host interpreter.

The workspace roots are two directories under ``tmp_path`` and an ``outside``
directory holds what must stay unreachable. Each test runs twice: with openat2 (where
the kernel has it) and with the component-by-component walk alone, as on kernels
before 5.6 or under a filter that refuses openat2. The real attack (user code racing
the files API inside a sandbox) is in tests/escape/test_filesystem.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandlot.runner import _files
from sandlot.runner._files import Files, FilesError, NotFound, PathRefused

SECRET = "outside-secret"


@dataclass
class Workspace:
    files: Files
    home: Path
    tmp: Path
    outside: Path

    def read(self, path: str) -> str:
        fd, _ = self.files.open_read(path)
        with os.fdopen(fd, "rb") as handle:
            return handle.read().decode()

    def write(self, path: str, text: str) -> dict[str, Any]:
        return self.files.write(path, text.encode(), False, None)


@pytest.fixture(params=["openat2", "walk"])
def ws(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Workspace]:
    if request.param == "openat2" and _files._openat2.syscall is None:
        pytest.skip("this kernel (or its seccomp filter) has no openat2")
    if request.param == "walk":
        monkeypatch.setattr(_files._openat2, "syscall", None)
    home, tmp, outside = (tmp_path / n for n in ("home", "tmp", "outside"))
    for directory in (home, tmp, outside / "sub"):
        directory.mkdir(parents=True)
    (outside / "secret").write_text(SECRET)
    (home / "real_dir").mkdir()
    (home / "real_dir" / "inside.txt").write_text("inside")
    (tmp / "tmp.txt").write_text("in tmp")
    links = {
        "to_inside": home / "real_dir" / "inside.txt",  # absolute, inside
        "relative_in": "real_dir/inside.txt",
        "to_tmp": tmp / "tmp.txt",  # into the other root
        "relative_to_tmp": "../tmp/tmp.txt",  # up out of one root, into the other
        "to_dir": home / "real_dir",
        "dir_slash": f"{home}/real_dir/",
        "dot": ".",
        "to_home": home,
        "to_outside": outside / "secret",
        "to_outside_dir": outside,
        "relative_out": "../outside/secret",
        "loop": "loop",
        "dangling_in": home / "made_later",
    }
    for name, target in links.items():
        os.symlink(target, home / name)
    os.symlink(home / "to_outside_dir", tmp / "chained")  # a link to a link that leads out
    files = Files(str(home), (str(home), str(tmp)))
    try:
        yield Workspace(files, home, tmp, outside)
    finally:
        files.close()
    assert sorted(p.name for p in outside.iterdir()) == ["secret", "sub"]
    assert (outside / "secret").read_text() == SECRET
    assert list((outside / "sub").iterdir()) == []


def test_links_that_stay_inside_are_followed(ws: Workspace) -> None:
    for path in ("to_inside", "relative_in", "to_dir/inside.txt", "dir_slash/inside.txt"):
        assert ws.read(path) == "inside", path
    assert ws.read("dot/dot/real_dir/inside.txt") == "inside"
    assert ws.read("to_home/to_dir/inside.txt") == "inside"
    assert ws.read("to_tmp") == ws.read("relative_to_tmp") == "in tmp"
    assert [e["path"] for e in ws.files.list("to_dir", 1)] == [f"{ws.home}/real_dir/inside.txt"]
    assert ws.files.list("to_home", 1) == ws.files.list(".", 1)
    listed = {e["name"]: e for e in ws.files.list(".", 1)}
    assert listed["to_dir"]["type"] == "dir" and listed["to_home"]["type"] == "dir"
    assert listed["to_outside_dir"]["type"] == "file"  # not even told it is a directory
    assert listed["to_outside"]["symlink_target"] == str(ws.outside / "secret")
    # Writes, directories and renames may go through a directory link that stays in.
    assert ws.write("to_dir/new.txt", "new")["path"] == f"{ws.home}/real_dir/new.txt"
    assert ws.files.make_dir("to_dir/sub") is True
    assert ws.files.make_dir("to_dir") is False  # a link to a directory is one
    assert ws.write("dangling_in/created.txt", "x")["path"] == f"{ws.home}/made_later/created.txt"
    moved = ws.files.rename("to_dir/new.txt", "to_home/to_dir/sub/moved.txt")
    assert moved["path"] == f"{ws.home}/real_dir/sub/moved.txt"


def test_links_that_lead_out_are_refused(ws: Workspace) -> None:
    for path in ("to_outside", "relative_out", "to_outside_dir/secret", "../tmp/chained/secret"):
        with pytest.raises(PathRefused):
            ws.read(path)
    for path in ("to_outside_dir", "../tmp/chained", "to_outside_dir/sub"):
        with pytest.raises(PathRefused):
            ws.files.list(path, 1)
    for call in (
        lambda: ws.files.stat("to_outside_dir/secret"),
        lambda: ws.write("to_outside_dir/sub/x", "escaped"),
        lambda: ws.write("to_outside_dir/new/x", "escaped"),
        lambda: ws.files.make_dir("to_outside_dir/sub/d"),
        lambda: ws.files.make_dir("to_outside_dir"),
        lambda: ws.files.remove("to_outside_dir/secret"),
        lambda: ws.files.remove("to_outside_dir/sub"),
        lambda: ws.files.rename("to_outside_dir/secret", "stolen"),
        lambda: ws.files.rename("real_dir/inside.txt", "to_outside_dir/sub/planted"),
    ):
        with pytest.raises(PathRefused):
            call()
    # The links themselves are in the workspace: they can be looked at and removed.
    assert ws.files.stat("to_outside_dir")["symlink_target"] == str(ws.outside)
    ws.files.remove("to_outside_dir")
    assert not (ws.home / "to_outside_dir").is_symlink()


def test_writes_never_go_through_a_symlink(ws: Workspace) -> None:
    for path in ("to_inside", "to_tmp", "to_outside", "relative_in"):
        with pytest.raises(PathRefused, match="symlink"):
            ws.write(path, "overwritten")
    assert ws.read("real_dir/inside.txt") == "inside"


def test_paths_outside_the_roots_and_the_roots_themselves(ws: Workspace) -> None:
    for path in ("..", "../outside/secret", str(ws.outside / "secret"), "a/../../../etc"):
        with pytest.raises(PathRefused):
            ws.files.stat(path)
    with pytest.raises(PathRefused):
        ws.files.remove(".")
    with pytest.raises(PathRefused):
        ws.files.rename(str(ws.tmp), "moved")
    assert ws.files.make_dir(".") is False
    assert ws.files.stat(".")["path"] == str(ws.home)
    with pytest.raises(IsADirectoryError):
        ws.read(str(ws.tmp))
    with pytest.raises(IsADirectoryError):
        ws.write(".", "x")


def test_errors_are_the_documented_ones(ws: Workspace) -> None:
    with pytest.raises(FileNotFoundError):
        ws.files.stat("missing/file")
    with pytest.raises(FileNotFoundError):
        ws.read("missing")
    with pytest.raises(NotFound):
        ws.files.list("missing", 1)
    with pytest.raises(FilesError, match="not a directory"):
        ws.files.list("real_dir/inside.txt", 1)
    with pytest.raises(NotADirectoryError):
        ws.files.stat("real_dir/inside.txt/x")
    with pytest.raises(OSError) as loop:
        ws.read("loop")
    assert loop.value.errno == errno.ELOOP
    with pytest.raises(FileNotFoundError):
        ws.files.rename("missing", "x")


def test_normal_operations(ws: Workspace) -> None:
    assert ws.files.make_dir("ops/sub") is True
    assert ws.files.make_dir("ops/sub") is False
    ws.write("ops/a.txt", "aaa")
    ws.write("ops/sub/b.txt", "b")
    assert [(e["name"], e["type"]) for e in ws.files.list("ops", 1)] == [
        ("a.txt", "file"),
        ("sub", "dir"),
    ]
    assert {e["path"] for e in ws.files.list("ops", 2)} == {
        f"{ws.home}/ops/a.txt",
        f"{ws.home}/ops/sub",
        f"{ws.home}/ops/sub/b.txt",
    }
    info = ws.files.stat("ops/a.txt")
    assert (info["name"], info["type"], info["size"], info["symlink_target"]) == (
        "a.txt",
        "file",
        3,
        None,
    )
    ws.files.write("ops/a.txt", b"+", True, None)
    assert ws.read("ops/a.txt") == "aaa+"
    with pytest.raises(_files.InvalidArgument):
        ws.files.write("ops/big", b"x" * 10, False, 5)
    assert not (ws.home / "ops" / "big").exists()  # no partial file
    assert (
        ws.files.rename("ops/a.txt", "ops/new/dir/c.txt")["path"] == f"{ws.home}/ops/new/dir/c.txt"
    )
    ws.write(f"{ws.tmp}/t.txt", "t")
    assert ws.read("../tmp/t.txt") == "t"
    os.symlink(ws.outside, ws.home / "ops" / "sub" / "out")  # removed, never followed
    ws.files.remove("ops")
    assert not (ws.home / "ops").exists()


def test_no_descriptor_is_left_open(ws: Workspace) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        for call in (
            lambda: ws.read("to_tmp"),
            lambda: ws.read("to_outside_dir/secret"),
            lambda: ws.files.list(".", 2),
            lambda: ws.files.make_dir("x/y"),
            lambda: ws.write("x/y/z", "1"),
            lambda: ws.files.rename("x/y/z", "x/w"),
            lambda: ws.files.remove("x"),
            lambda: ws.files.stat("missing/x"),
            lambda: ws.read("loop"),
        ):
            with contextlib.suppress(OSError, FilesError):
                call()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_kernel_that_follows_links_despite_o_nofollow_is_caught(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gVisor (runsc 20221219) follows a symlink opened with O_DIRECTORY | O_NOFOLLOW;
    # found by the escape suite under docker-runsc. Every open is checked to be the
    # entry itself, so such a kernel follows no link out either.
    real_open = os.open

    def quirky_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if flags & os.O_DIRECTORY:
            flags &= ~os.O_NOFOLLOW
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_files._openat2, "syscall", None)  # the walk, as under gVisor
    monkeypatch.setattr(os, "open", quirky_open)
    with pytest.raises(PathRefused):
        ws.write("to_outside_dir/sub/x", "escaped")
    with pytest.raises(PathRefused):
        ws.files.list("to_outside_dir", 1)
    assert ws.read("to_dir/inside.txt") == "inside"  # links inside still work


RENAMEAT2 = {"x86_64": 316, "aarch64": 276}.get(platform.machine())


@pytest.mark.skipif(RENAMEAT2 is None, reason="renameat2's number is known here for x86-64/arm64")
def test_a_directory_swapped_for_an_outward_link_is_never_followed(ws: Workspace) -> None:
    # The attack, on the host: a thread swaps a directory of the workspace with a link
    # to `outside` (renameat2 RENAME_EXCHANGE, atomic) while files.* calls run below it.
    # (make_dir "made" there would create it outside: the fixture checks it did not.)
    (ws.home / "race").mkdir()
    (ws.home / "race" / "secret").write_text("inside")
    (ws.home / "race" / "marker").write_text("")
    os.symlink(ws.outside, ws.home / "race_out")
    libc = ctypes.CDLL(None, use_errno=True)
    done = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        a, b = str(ws.home / "race").encode(), str(ws.home / "race_out").encode()
        while not done.is_set() and swaps < 50_000_000:  # bounded, and stopped below
            if libc.syscall(RENAMEAT2, -100, a, -100, b, 2) != 0:  # RENAME_EXCHANGE
                raise OSError(ctypes.get_errno(), "renameat2")
            swaps += 1

    racer = threading.Thread(target=swap, daemon=True)
    racer.start()
    leaks: list[Any] = []
    answered = refused = 0
    try:
        for _ in range(1000):
            for call, legitimate in (
                (lambda: ws.read("race/secret"), "inside".__eq__),
                (lambda: ws.files.stat("race/secret")["size"], (6).__eq__),
                (lambda: {e["name"] for e in ws.files.list("race", 1)}, lambda n: "marker" in n),
                (lambda: ws.files.make_dir("race/made"), lambda _: True),
            ):
                try:
                    value = call()
                except PathRefused:
                    refused += 1
                    continue
                if legitimate(value):
                    answered += 1
                else:
                    leaks.append(value)
    finally:
        done.set()
        racer.join()
    assert leaks == []
    assert swaps and answered and refused, (swaps, answered, refused)  # the race alternated


# --- file metadata (user.e2b.* extended attributes) -------------------------------------


def _needs_user_xattrs(path: Path) -> None:
    probe = path / ".xattr-probe"
    probe.write_text("")
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError as exc:
        pytest.skip(f"{path} keeps no user extended attributes here: {exc}")
    finally:
        probe.unlink()


def test_metadata_is_replaced_by_each_write_and_kept_by_appends(ws: Workspace) -> None:
    _needs_user_xattrs(ws.home)
    first = ws.files.write("m.txt", b"a", False, None, {"k": "1", "old": "x"})
    assert first["metadata"] == {"k": "1", "old": "x"}
    assert os.getxattr(ws.home / "m.txt", "user.e2b.k") == b"1"
    os.setxattr(ws.home / "m.txt", "user.keep", b"not metadata")
    appended = ws.files.write("m.txt", b"b", True, None, {"ignored": "on append"})
    assert appended["metadata"] == {"k": "1", "old": "x"}
    replaced = ws.files.write("m.txt", b"c", False, None, {"k": "2"})
    assert replaced["metadata"] == {"k": "2"}
    assert ws.files.stat("m.txt")["metadata"] == {"k": "2"}
    cleared = ws.files.write("m.txt", b"d", False, None)
    assert "metadata" not in cleared and "metadata" not in ws.files.stat("m.txt")
    # Only the metadata namespace is the files API's to clear.
    assert os.getxattr(ws.home / "m.txt", "user.keep") == b"not metadata"


def test_metadata_is_read_from_the_entry_itself_never_through_a_symlink(ws: Workspace) -> None:
    _needs_user_xattrs(ws.home)
    os.setxattr(ws.outside / "secret", "user.e2b.leak", b"outside")
    os.setxattr(ws.home / "real_dir" / "inside.txt", "user.e2b.tag", b"in")
    listed = {entry["name"]: entry.get("metadata") for entry in ws.files.list(".", 1)}
    assert listed["to_outside"] is None  # a link is described, not followed
    assert listed["to_inside"] is None
    assert ws.files.stat("to_inside").get("metadata") is None
    assert ws.files.stat("real_dir/inside.txt")["metadata"] == {"tag": "in"}
    assert ws.files.stat("to_dir/inside.txt")["metadata"] == {"tag": "in"}


def test_metadata_read_back_is_bounded() -> None:
    """On tmpfs, whose budget for attributes is above the files API's: what user code
    sets past the limits is left out, never cut."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    home = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        _needs_user_xattrs(home)
        path = home / "big.txt"
        path.write_text("x")
        os.setxattr(path, "user.e2b.small", b"v")
        os.setxattr(path, "user.e2b.huge", b"v" * 4000)  # fits alone, not with the rest
        os.setxattr(path, "user.e2b.more", b"w" * 4000)
        os.setxattr(path, "user.e2b.bin", b"\xff\xfe")
        files = Files(str(home), (str(home),))
        try:
            metadata = files.stat("big.txt")["metadata"]
        finally:
            files.close()
        size = sum(len("user.e2b.") + len(k) + len(v.encode()) for k, v in metadata.items())
        assert size <= _files.METADATA_TOTAL_MAX
        assert metadata["small"] == "v" and metadata["bin"] == "\ufffd\ufffd"
        assert ("huge" in metadata) != ("more" in metadata)
    finally:
        shutil.rmtree(home)


@pytest.mark.parametrize(
    "metadata",
    [{"Upper": "v"}, {"sp ace": "v"}, {"k": "\x7f"}, {"k": 1}, ["k"], {"k" * 247: "v"}],
)
def test_bad_metadata_is_refused_and_the_file_left_alone(ws: Workspace, metadata: Any) -> None:
    ws.write("kept.txt", "before")
    with pytest.raises(_files.InvalidArgument):
        ws.files.write("kept.txt", b"after", False, None, metadata)
    assert ws.read("kept.txt") == "before"
