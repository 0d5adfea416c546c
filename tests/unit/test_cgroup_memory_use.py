"""``_cgroups.memory_use``: what the zygote backend reads to keep room in the zygote's
cgroup, from v2 and v1 files (written here, no cgroup needed)."""

from __future__ import annotations

from pathlib import Path

from sandlot.backends._cgroups import memory_use


def test_v2_reads_current_and_max(tmp_path: Path) -> None:
    (tmp_path / "memory.current").write_text("1048576\n")
    (tmp_path / "memory.max").write_text("4194304\n")
    assert memory_use(2, {"": tmp_path}) == (1048576, 4194304)
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_use(2, {"": tmp_path}) is None  # no limit


def test_v1_reads_usage_and_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.usage_in_bytes").write_text("2048\n")
    (tmp_path / "memory.limit_in_bytes").write_text("8192\n")
    assert memory_use(1, {"memory": tmp_path, "pids": tmp_path}) == (2048, 8192)


def test_unreadable_is_none(tmp_path: Path) -> None:
    assert memory_use(2, {"": tmp_path / "gone"}) is None
    assert memory_use(1, {"pids": tmp_path}) is None  # no memory controller
