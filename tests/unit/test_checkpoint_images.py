"""The checkpoint layer's pure parts: the userns image codec and the criu command
lines (sandlot.backends._checkpoint). The real round trip is
tests/integration/test_checkpoint.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandlot.backends import _checkpoint
from sandlot.backends._checkpoint import DumpPlan, IdExtent, RestorePlan, UsernsMaps

# A userns image CRIU 4.1 wrote for a sandbox mapping 0-1 -> 100000-100001 and
# 1000 -> 100002 (uid and gid alike).
CRIU_WROTE = bytes.fromhex(
    "19435654064947552a0000000a0808001"
    "0a08d0618020a0908e80710a28d061801"
    "12080800"
    "10a08d0618021209"
    "08e80710a28d061801"
)


def test_an_image_criu_wrote_decodes_to_its_maps() -> None:
    magic, maps = _checkpoint.decode_userns(CRIU_WROTE)
    assert magic == CRIU_WROTE[:8]
    both = (IdExtent(0, 100000, 2), IdExtent(1000, 100002, 1))
    assert maps == UsernsMaps(uid=both, gid=both)
    assert _checkpoint.encode_userns(magic, maps) == CRIU_WROTE


def test_sandbox_maps_give_each_id_its_own_host_id() -> None:
    maps = _checkpoint.sandbox_maps((7, 70), (8, 80), (9, 90))
    assert _checkpoint.map_text(maps.uid) == "0 7 1\n1 8 1\n1000 9 1\n"
    assert _checkpoint.map_text(maps.gid) == "0 70 1\n1 80 1\n1000 90 1\n"
    magic = CRIU_WROTE[:8]
    assert _checkpoint.decode_userns(_checkpoint.encode_userns(magic, maps)) == (magic, maps)


def test_rewrite_replaces_the_one_userns_image(tmp_path: Path) -> None:
    (tmp_path / "userns-14.img").write_bytes(CRIU_WROTE)
    maps = _checkpoint.sandbox_maps((5, 5), (6, 6), (4_000_000_000, 7))
    _checkpoint.rewrite_userns(str(tmp_path), maps)
    assert _checkpoint.decode_userns((tmp_path / "userns-14.img").read_bytes())[1] == maps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userns-14.img"]


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        CRIU_WROTE[:-1],
        CRIU_WROTE + b"\x00",
        CRIU_WROTE[:12] + b"\x1a\x00" + CRIU_WROTE[14:],  # field 3: not a userns entry
        CRIU_WROTE[:8] + b"\x04\x00\x00\x00" + b"\x0a\x02\x08\x00",  # extent without lower/count
    ],
)
def test_what_is_not_a_userns_image_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        _checkpoint.decode_userns(bad)


def test_a_checkpoint_with_two_user_namespaces_is_refused(tmp_path: Path) -> None:
    for name in ("userns-1.img", "userns-2.img"):
        (tmp_path / name).write_bytes(CRIU_WROTE)
    with pytest.raises(ValueError, match="one user namespace"):
        _checkpoint.rewrite_userns(str(tmp_path), _checkpoint.sandbox_maps((1, 1), (2, 2), (3, 3)))


def test_dump_command_line() -> None:
    plan = DumpPlan(pid=42, images_dir="/var/lib/x", leave_running=True, external_unix=(7, 9))
    assert _checkpoint.dump_argv(plan, criu="/c") == [
        "/c", "dump", "-t", "42", "-D", "/var/lib/x", "-o", "dump.log", "--shell-job", "-v4",
        "--network-lock", "skip", "--external", "mnt[]", "--external", "unix[7]",
        "--external", "unix[9]", "--leave-running",
    ]  # fmt: skip


def test_restore_command_line() -> None:
    plan = RestorePlan(images_dir="/i", root="/r", inherit=((5, "socket:[77]"),))
    assert _checkpoint.restore_argv(plan, criu="/c") == [
        "/c", "restore", "-D", "/i", "-o", "restore.log", "--shell-job", "-v4", "-d",
        "--pidfile", "restored.pid", "--root", "/r", "--ext-mount-map", "auto",
        "--manage-cgroups=ignore", "--inherit-fd", "fd[5]:socket:[77]",
    ]  # fmt: skip
    scripted = RestorePlan(images_dir="/i", root="/r", action_script="/i/limits.py")
    assert _checkpoint.restore_argv(scripted, criu="/c")[-2:] == ["--action-script", "/i/limits.py"]


def test_the_limits_script_sets_only_user_namespace_limits() -> None:
    script = _checkpoint.limits_script({"max_inotify_instances": 8}, "/py")
    assert script.startswith("#!/py -I\n")
    assert "'setup-namespaces'" in script and "{'max_inotify_instances': 8}" in script
    compile(script, "limits.py", "exec")
    with pytest.raises(ValueError, match="not a user namespace limit"):
        _checkpoint.limits_script({"../../kernel/core_pattern": 1}, "/py")


def test_doctor_names_the_fix_without_criu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SANDLOT_CRIU", str(tmp_path / "nowhere"))
    found = _checkpoint.finding()
    assert found.status == "warn"
    assert "setup-criu.sh" in found.fix


def test_mount_points_are_what_the_command_line_mounts(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    argv = [
        "bwrap", "--unshare-pid", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--ro-bind", str(tmp_path / "file"), "/etc/passwd", "--setenv", "A", "/not/a/mount",
        "--proc", "/proc", "--perms", "1777", "--size", "5", "--tmpfs", "/tmp",
        "--tmpfs", "/home/user", "--chdir", "/home/user", "--remount-ro", "/",
        "--", "/usr/bin/python3", "--tmpfs", "/after/the/command",
    ]  # fmt: skip
    points = _checkpoint.mount_points(argv)
    assert [(p.path, p.kind, p.target) for p in points] == [
        ("/etc", "dir", ""),
        ("/home", "dir", ""),
        ("/lib", "symlink", "usr/lib"),
        ("/proc", "dir", ""),
        ("/tmp", "dir", ""),
        ("/usr", "dir", ""),
        ("/etc/passwd", "file", ""),
        ("/home/user", "dir", ""),
    ]
    root = tmp_path / "root"
    _checkpoint.build_root(points, str(root))
    assert (root / "etc/passwd").is_file() and (root / "home/user").is_dir()
    assert os.readlink(root / "lib") == "usr/lib"


def _core(thread_core: bytes, magic: bytes = CRIU_WROTE[:8]) -> bytes:
    # core_entry { mtype = 1 (X86_64); thread_core = 5 { ... } }
    body = b"\x08\x01" + b"\x2a" + bytes([len(thread_core)]) + thread_core
    return magic + len(body).to_bytes(4, "little") + body


# thread_core_entry: futex_rla = 1, futex_rla_len = 2, comm = 13 ("python"), then cg_set = 16
THREAD_CORE = b"\x08\x90\x4e\x10\x18" + b"\x6a\x06python"
CG_SET_4 = b"\x80\x01\x04"


def test_a_threads_own_cgroup_set_is_dropped_from_its_core_image() -> None:
    with_set = _core(THREAD_CORE + CG_SET_4)
    assert _checkpoint.drop_thread_cg_set(with_set) == _core(THREAD_CORE)
    assert _checkpoint.drop_thread_cg_set(_core(THREAD_CORE)) is None  # nothing to drop
    # in the middle of the message too
    assert _checkpoint.drop_thread_cg_set(_core(THREAD_CORE[:5] + CG_SET_4 + THREAD_CORE[5:])) == (
        _core(THREAD_CORE)
    )


@pytest.mark.parametrize(
    "bad",
    [b"", _core(THREAD_CORE)[:-1], _core(THREAD_CORE) + b"\x00", _core(b"\x0f")],
)
def test_what_is_not_a_core_image_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        _checkpoint.drop_thread_cg_set(bad)
