"""Teardown leaves nothing: 500 sandboxes created and destroyed, then the host is checked.

The sandboxes end every way a sandbox can end: ``kill()``, leaving a ``with`` block,
a cell timeout, the sandbox's own timeout expiring, and a crash (its host process
SIGKILLed from outside). Some leave a double-forked, setsid, SIGTERM-ignoring daemon
behind them. Afterwards nothing may remain: no process, no cgroup, no temporary
directory, no mount, and no file descriptor or thread of this test process.
"""

from __future__ import annotations

import gc
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sandlot import Sandbox
from sandlot.backends import _cgroups
from sandlot.backends.bwrap import _zygote
from sandlot.templates import cache_dir

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template, pytest.mark.slow]

SANDBOXES = int(os.environ.get("SANDLOT_TEARDOWN_N", "500"))


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


PROCESS_WIDE = {"sandlot-reaper", "sandlot-timeouts"}


def _snapshot() -> dict[str, object]:
    host = _cgroups.host()
    runtime = cache_dir() / "runtime"
    mine = f"{os.getpid()}."  # sandbox cgroups are named after their owner process
    return {
        "processes": _descendants(os.getpid()),
        "cgroups": sorted(
            str(p)
            for base in host.bases.values()
            if base.is_dir()
            for p in base.iterdir()
            if p.is_dir() and p.name.startswith(mine)
        ),
        # The test points TMPDIR at a directory of its own; anything sandlot leaves in a
        # temp dir shows up there. The host's /tmp itself is not compared: other programs
        # (and other test workers running sandlot) create and remove entries there, and
        # sandlot names no path in it.
        "tmp": sorted(os.listdir(tempfile.gettempdir())),
        # Unfinished copies of the runner (a finished one is a cache, kept on purpose).
        "staging": sorted(p.name for p in runtime.glob(".stage-*")) if runtime.is_dir() else [],
        "fds": sorted(os.listdir("/proc/self/fd")),
        # Threads of the process, not of a sandbox (each starts on first use and ends
        # once idle for a while) are not counted: whether one is still idling is timing.
        "threads": sorted(t.name for t in threading.enumerate() if t.name not in PROCESS_WIDE),
        "mounts": _mounts(),
    }


# Container engines mount and unmount their containers' file systems in the host's mount
# namespace as other tests (or other programs) start and stop containers: not sandlot's.
_ENGINE_MOUNTS = ("/var/lib/docker/", "/var/lib/containers/", "/run/docker/", "/run/containers/")


def _mounts() -> list[str]:
    """The host's mount table (this process's namespace), minus container engines'."""
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [
        line
        for line in lines
        if not (line.split()[4] + "/").startswith(_ENGINE_MOUNTS)
        and "/run/netns/" not in line.split()[4] + "/"
    ]


def _settled(before: dict[str, object], timeout: float = 30.0) -> dict[str, object]:
    """The snapshot once it matches ``before``, or the last one after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = _snapshot()
        if now == before or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def _crash(sbx: Sandbox) -> None:
    handle = sbx._core._handle
    assert handle is not None
    os.kill(handle._process.pid, signal.SIGKILL)  # type: ignore[attr-defined]


@pytest.mark.timeout(1800)  # about 4 minutes alone on 2 cores; much longer on a busy host
def test_500_sandboxes_leave_nothing_behind(
    daemon_cell: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    Sandbox("python-data", backend="bwrap", timeout=None).kill()  # warm caches, stage runtime
    # Zygotes that earlier test modules started live as long as this process (by design);
    # they are not what this test counts.
    _zygote.close_all()
    # And descriptors of earlier modules' sandboxes that only the garbage collector
    # closes (a zygote-made sandbox's pidfd), so none of them closes mid-test.
    gc.collect()
    before = _settled(_snapshot(), timeout=5)
    assert before["processes"] == set(), "the test process has children before starting"
    endings: dict[str, int] = {}
    for i in range(SANDBOXES):
        how = ("kill", "with", "cell-timeout", "own-timeout", "crash")[i % 5]
        endings[how] = endings.get(how, 0) + 1
        if how == "with":
            with Sandbox("python-data", backend="bwrap", timeout=60) as sbx:
                sbx.run_code("x = 1")
            continue
        sbx = Sandbox("python-data", backend="bwrap", timeout=60)
        try:
            if i % 50 < 5:
                # A daemon that survives its cell: the teardown must find it anyway.
                execution = sbx.run_code(daemon_cell(f"sandlot-teardown-{i}"), timeout=30)
                assert execution.error is None, execution.error
            if how == "cell-timeout":
                execution = sbx.run_code("while True: pass", timeout=0.5)
                assert execution.status == "timeout", execution
            elif how == "own-timeout":
                sbx.set_timeout(0.05)
                deadline = time.monotonic() + 30
                while sbx.is_running() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert not sbx.is_running()
            elif how == "crash":
                _crash(sbx)
        finally:
            sbx.kill()
    after = _settled(before)
    for key in before:
        assert after[key] == before[key], (key, endings)
