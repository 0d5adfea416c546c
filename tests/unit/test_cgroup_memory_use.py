"""``_cgroups.memory_use``: what the zygote backend reads to keep room in the zygote's
cgroup, from v2 and v1 files (written here, no cgroup needed)."""

from __future__ import annotations

from pathlib import Path

from sandlot.backends._cgroups import UsageFiles, memory_use, read_usage


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


def _v2(path: Path) -> None:
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    (path / "memory.peak").write_text("3000\n")
    (path / "memory.max").write_text("8192\n")
    (path / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (path / "pids.current").write_text("4\n")


def _v1(path: Path) -> None:
    (path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (path / "cpuacct.usage").write_text("2500000000\n")
    (path / "memory.max_usage_in_bytes").write_text("4096\n")
    (path / "memory.limit_in_bytes").write_text("8192\n")
    (path / "pids.current").write_text("7\n")


def test_counters_are_the_oom_kills_and_cpu_time_of_a_full_read(tmp_path: Path) -> None:
    """What a cell is measured from (read before each) agrees with the full read, from
    only the two files it needs."""
    for version, fill, paths in (
        (2, _v2, {"": tmp_path}),
        (1, _v1, {"memory": tmp_path, "cpuacct": tmp_path, "pids": tmp_path}),
    ):
        for child in tmp_path.iterdir():
            child.unlink()
        fill(tmp_path)
        full = read_usage(version, paths, UsageFiles())  # type: ignore[arg-type]
        counters = read_usage(version, paths, UsageFiles(), counters_only=True)  # type: ignore[arg-type]
        assert (counters.oom_kills, counters.cpu_seconds) == (full.oom_kills, full.cpu_seconds)
        assert full.cpu_seconds in (1.5, 2.5) and full.oom_kills in (2, 5)
        assert counters.memory_peak_bytes is None and counters.pids is None
        needed = {"memory.events", "cpu.stat", "memory.oom_control", "cpuacct.usage"}
        for child in tmp_path.iterdir():
            if child.name not in needed:
                child.unlink()
        again = read_usage(version, paths, counters_only=True)  # type: ignore[arg-type]
        assert again == counters


def test_kept_files_read_again_but_the_limit_sandlot_set(tmp_path: Path) -> None:
    """Usage is read from files kept open: the counters come fresh on every read; the
    memory limit, which sandlot wrote when it made the cgroup, is read once."""
    paths = {"memory": tmp_path, "cpuacct": tmp_path, "pids": tmp_path}
    _v1(tmp_path)
    files = UsageFiles()
    first = read_usage(1, paths, files)  # type: ignore[arg-type]
    assert (first.oom_kills, first.memory_limit_bytes, first.pids) == (5, 8192, 7)
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 1\noom_kill 6\n")
    (tmp_path / "cpuacct.usage").write_text("3000000000\n")
    (tmp_path / "pids.current").write_text("9\n")
    (tmp_path / "memory.limit_in_bytes").write_text("1\n")
    second = read_usage(1, paths, files)  # type: ignore[arg-type]
    assert (second.oom_kills, second.cpu_seconds, second.pids) == (6, 3.0, 9)
    assert second.memory_limit_bytes == 8192


def test_keyed_values_are_found_by_their_whole_key(tmp_path: Path) -> None:
    _v2(tmp_path)
    # A key that ends in "oom_kill", before it; and a counter that is not a number.
    (tmp_path / "memory.events").write_text("oom 2\noom_group_kill 9\noom_kill 3\n")
    assert read_usage(2, {"": tmp_path}).oom_kills == 3  # type: ignore[arg-type]
    (tmp_path / "memory.events").write_text("oom_group_kill 9\n")
    assert read_usage(2, {"": tmp_path}).oom_kills == 0  # type: ignore[arg-type]
    (tmp_path / "cpu.stat").write_text("usage_usec x\nuser_usec 1\n")
    assert read_usage(2, {"": tmp_path}).cpu_seconds is None  # type: ignore[arg-type]
