"""Whole-sandbox limits (cgroups) against the real bubblewrap backend.

Each limit is checked by exceeding it for real: several processes together, since a
per-process rlimit would let each of them through.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import sandlot
from sandlot import Sandbox
from sandlot.backends import _cgroups, _reaper
from sandlot.backends._hostids import (
    DEFAULT_LOCK_DIR,
    LOCK_DIR_ENV,
    HostIdAllocator,
    configured_range,
)
from sandlot.policy import MiB

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]


def _cgroup_of(sbx: Sandbox) -> _cgroups.SandboxCgroup:
    handle = sbx._core._handle
    group = getattr(handle, "_cgroup", None)
    assert isinstance(group, _cgroups.SandboxCgroup)
    return group


EIGHT_HOGS = """
import subprocess, sys
hog = "b = bytearray(400 * 1024 * 1024); import time; time.sleep(2); print('survived', flush=True)"
procs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(8)]
print("exit codes", [p.wait() for p in procs], flush=True)
"""


def test_eight_processes_of_400_mb_under_512_mb_are_stopped_as_oom(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    # Each hog is under the per-process rlimit (512 MiB of address space): only the
    # whole-sandbox cgroup limit can stop them.
    sbx = make_sandbox(resources={"memory_mb": 512})
    sbx.run_code("kept = 'state before'")
    execution = sbx.run_code(EIGHT_HOGS, timeout=60)
    assert execution.status == "oom", execution
    assert execution.error is not None
    assert execution.error.name == "OutOfMemoryError"
    assert "memory limit of 512 MiB" in execution.error.value
    assert "peak" in execution.error.value
    assert "".join(execution.logs.stdout).count("survived") < 8
    assert execution.usage is not None
    assert execution.usage.memory_limit_bytes == 512 * MiB
    assert execution.usage.oom_kills >= 1
    peak = execution.usage.memory_peak_bytes
    assert peak is not None and peak <= 512 * MiB
    # The cell was stopped, not the sandbox: state and service survive.
    assert sbx.run_code("kept").text == "'state before'"


def test_one_cell_over_the_limit_in_the_kernel_itself(make_sandbox: Callable[..., Sandbox]) -> None:
    # 300 MiB is under RLIMIT_AS (512 MiB) but over what is left of the cgroup after
    # the kernel's own pandas-free footprint plus a 300 MiB tmpfs file.
    sbx = make_sandbox(resources={"memory_mb": 512})
    sbx.files.write("filler.bin", b"\0" * (300 * MiB))  # tmpfs pages count too
    execution = sbx.run_code("b = bytearray(300 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])")
    assert execution.error is not None and execution.error.name == "OutOfMemoryError", execution
    assert "512 MiB" in execution.error.value
    assert sbx.run_code("1 + 1").text == "2"


def test_pids_limit_holds_for_the_whole_sandbox(make_sandbox: Callable[..., Sandbox]) -> None:
    sbx = make_sandbox(resources={"pids": 40})
    execution = sbx.run_code(
        textwrap.dedent(
            """
            import os, subprocess, sys, time
            procs, error = [], None
            for _ in range(100):
                try:
                    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
                    procs.append(subprocess.Popen(sleeper))
                except OSError as exc:
                    error = exc.errno
                    break
            print(len(procs), error, flush=True)
            for p in procs:
                p.kill(); p.wait()
            """
        ),
        timeout=60,
    )
    assert execution.error is None, execution.error
    started, error = "".join(execution.logs.stdout).split()
    assert error == "11"  # EAGAIN from fork: the pids controller said no
    assert 10 < int(started) < 40
    assert sbx.run_code("1 + 1").text == "2"


def test_cpu_quota_holds_for_the_whole_sandbox(make_sandbox: Callable[..., Sandbox]) -> None:
    # Two busy processes for 2 s of wall clock under a quota of a quarter core: the
    # kernel's own CPU accounting for the cgroup stays near 0.5 s, far below the 4 s
    # they would burn on two free cores. (Wall clock is only the window, never asserted.)
    sbx = make_sandbox(resources={"cpus": 0.25})
    execution = sbx.run_code(
        textwrap.dedent(
            """
            import subprocess, sys
            spin = "import time\\nend = time.monotonic() + 2\\nwhile time.monotonic() < end: pass"
            procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
            [p.wait() for p in procs]
            """
        ),
        timeout=60,
    )
    assert execution.error is None, execution.error
    assert execution.usage is not None and execution.usage.cpu_seconds is not None
    assert execution.usage.cpu_seconds < 1.2, execution.usage


def test_swap_is_off_and_limits_are_written(make_sandbox: Callable[..., Sandbox]) -> None:
    sbx = make_sandbox(resources={"memory_mb": 300, "pids": 50, "cpus": 1.5})
    group = _cgroup_of(sbx)
    read = lambda ctrl, name: (group.paths[ctrl] / name).read_text().strip()  # noqa: E731
    if group.host.version == 1:
        assert read("memory", "memory.limit_in_bytes") == str(300 * MiB)
        if group.host.swap_accounting:
            assert read("memory", "memory.memsw.limit_in_bytes") == str(300 * MiB)
        else:
            assert read("memory", "memory.swappiness") == "0"
        assert read("pids", "pids.max") == "50"
        assert read("cpu", "cpu.cfs_quota_us") == "150000"
        # The parent of all sandboxes weighs like many processes, not like one.
        parent = group.paths["cpu"].parent / "cpu.shares"
        assert parent.read_text().strip() == str(_cgroups.SANDBOXES_CPU_SHARES)
    else:
        assert read("", "memory.max") == str(300 * MiB)
        if group.host.swap_accounting:
            assert read("", "memory.swap.max") == "0"
        assert read("", "pids.max") == "50"
        assert read("", "cpu.max") == "150000 100000"


def test_every_sandbox_process_is_in_its_cgroup(
    fresh_sandbox: Sandbox, list_processes: Callable[[Sandbox], tuple[int, list[dict[str, object]]]]
) -> None:
    group = _cgroup_of(fresh_sandbox)
    _, inside = list_processes(fresh_sandbox)
    members = set(group.pids())
    # bwrap, the supervisor and the kernel at least; all of them in the cgroup.
    assert len(members) >= 3
    handle = fresh_sandbox._core._handle
    assert handle is not None
    assert handle._process.pid in members  # type: ignore[attr-defined]
    assert len(inside) <= len(members)


def test_the_cgroup_is_removed_with_the_sandbox(make_sandbox: Callable[..., Sandbox]) -> None:
    sbx = make_sandbox()
    paths = list(_cgroup_of(sbx).paths.values())
    assert all(p.is_dir() for p in paths)
    sbx.kill()
    assert _reaper.drain(10)  # kill() returns once it is signalled; it is reaped meanwhile
    assert not any(p.exists() for p in paths)


def test_root_is_not_root_outside(fresh_sandbox: Sandbox) -> None:
    if os.geteuid() != 0:
        pytest.skip("sandlot is not running as root here (CI's root run covers this)")
    handle = fresh_sandbox._core._handle
    assert handle is not None
    members = _cgroup_of(fresh_sandbox).pids()
    owners = {os.stat(f"/proc/{pid}").st_uid for pid in members if os.path.exists(f"/proc/{pid}")}
    ids = handle._host_ids  # type: ignore[attr-defined]
    assert owners == {ids.uid}, owners  # every sandbox process is the sandbox's own host uid
    id_range = configured_range()
    assert 0 < id_range.first_uid <= ids.uid < id_range.first_uid + id_range.count
    status = fresh_sandbox.run_code(
        "print(open('/proc/self/status').read())", timeout=30
    ).logs.stdout
    text = "".join(status)
    assert "CapEff:\t0000000000000000" in text
    assert "CapPrm:\t0000000000000000" in text
    assert "Seccomp:\t2" in text


def test_each_sandbox_is_a_host_uid_of_its_own_until_it_ends(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    if os.geteuid() != 0:
        pytest.skip("as an ordinary user every sandbox runs as that user (SECURITY.md)")
    first, second = make_sandbox(), make_sandbox()
    uids = []
    for sbx in (first, second):
        group = _cgroup_of(sbx)
        owners = {
            os.stat(f"/proc/{pid}").st_uid for pid in group.pids() if os.path.exists(f"/proc/{pid}")
        }
        assert len(owners) == 1, owners
        uids.append(owners.pop())
    assert uids[0] != uids[1]
    lock_dir = os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR
    holders = HostIdAllocator(configured_range(), lock_dir).holders()
    assert {uids[0], uids[1]} <= set(holders)
    first.kill()
    assert _reaper.drain(10)
    holders = HostIdAllocator(configured_range(), lock_dir).holders()
    assert uids[0] not in holders and uids[1] in holders


OUTER_CHILD = textwrap.dedent(
    """
    import json, sandlot
    outcome = {}
    try:
        sandlot.Sandbox(timeout=None).kill()
        outcome["strict"] = "ran"
    except sandlot.IsolationUnavailable as exc:
        outcome["strict"] = str(exc)
    sbx = sandlot.Sandbox(timeout=None, unsafe_best_effort_limits=True)
    outcome["best_effort"] = sbx.run_code("6 * 7").text
    sbx.kill()
    print(json.dumps(outcome))
    """
)


def test_without_writable_cgroups_sandlot_refuses_unless_told_best_effort() -> None:
    # A real host where sandlot cannot create cgroups. As root: an outer mount namespace
    # that sees the host as it is, except /sys/fs/cgroup, read-only. As a normal user:
    # no delegated subtree (the default location belongs to root).
    env = dict(os.environ)
    outer: list[str] = []
    if os.geteuid() == 0:
        bwrap = shutil.which("bwrap")
        assert bwrap is not None
        outer = [bwrap, "--dev-bind", "/", "/", "--ro-bind", "/sys/fs/cgroup", "/sys/fs/cgroup"]
        outer += ["--cap-add", "ALL", "--"]  # root stays root inside, minus cgroup writes
    else:
        env.pop(_cgroups.ROOT_ENV, None)
    result = subprocess.run(
        [*outer, sys.executable, "-c", OUTER_CHILD],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["strict"] != "ran", outcome
    assert "cgroup" in outcome["strict"] and "unsafe_best_effort_limits" in outcome["strict"]
    assert outcome["best_effort"] == "42"


def test_cgroups_of_a_killed_owner_are_swept(tmp_path: Path) -> None:
    # The owner is SIGKILLed: its sandbox dies with it (pdeathsig), and the empty
    # cgroup it could not remove is swept by the next sandlot process.
    script = textwrap.dedent(
        """
        import os, sys, sandlot
        sbx = sandlot.Sandbox(timeout=None)
        print(sbx._core._handle._cgroup.name, flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == -9
    name = result.stdout.strip()
    host = _cgroups.host()
    leftovers = [base / name for base in host.bases.values()]
    assert any(p.exists() for p in leftovers)  # control: the owner could not clean up
    assert name in _cgroups.sweep_orphans()
    assert not any(p.exists() for p in leftovers)


def test_limits_are_typed_errors_for_bad_values() -> None:
    with pytest.raises(sandlot.PolicyError):
        Sandbox(resources={"cpus": 0})
