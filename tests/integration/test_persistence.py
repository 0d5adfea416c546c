"""Pause, resume, snapshots and fork through the SDK, for real (local mode).

Each test drives real checkpointable sandboxes (bubblewrap, CRIU) and checks what a
user relies on: variables, files and a running background process come back; a paused
sandbox holds no process; another process resumes it by id; copies from a snapshot or
a fork are independent of each other and of their parent; what cannot be done says so
with a typed error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import CheckpointError, Sandbox, SnapshotInfo

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template, pytest.mark.requires_criu]

SETUP = (
    "import subprocess\n"
    "x = 41\n"
    "open('/home/user/notes.txt', 'w').write('kept')\n"
    "child = subprocess.Popen(['sleep', '3600'])\n"
)
PROBE = "(x, open('/home/user/notes.txt').read(), child.poll())"


@pytest.fixture(autouse=True)
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sandlot-store-", dir="/var/tmp"))
    path.chmod(0o711)
    monkeypatch.setenv("SANDLOT_CHECKPOINT_DIR", str(path))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_pause_frees_the_sandbox_and_connect_brings_it_back(store: Path) -> None:
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(SETUP)
        handle = sbx.handle
        assert handle is not None
        assert sbx.pause() is True
        assert sbx.pause() is False  # already paused
        assert not handle.alive and not sbx.is_running()
        assert (store / sbx.sandbox_id / "info.json").exists()
        sbx.connect()
        execution = sbx.run_code(PROBE)
        assert execution.text == "(41, 'kept', None)"
        assert execution.execution_count == 2
        assert not (store / sbx.sandbox_id).exists()  # resumed: the checkpoint is gone


THREAD = (
    "import threading\n"
    "stop = threading.Event()\n"
    "t = threading.Thread(target=stop.wait, daemon=True)\n"
    "t.start()\n"
)


def test_a_session_with_a_thread_resumes_and_forks() -> None:
    # CRIU gives each thread of a code context a cgroup set of its own; restoring one
    # failed ("The message from cgroupd is truncated") before sandlot dropped it.
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(THREAD)
        assert sbx.pause() is True
        assert sbx.run_code("t.is_alive()").text == "True"
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(THREAD)
        copies = sbx.fork(count=1)
        try:
            assert isinstance(copies[0], Sandbox), copies
            assert copies[0].run_code("stop.set(); t.join(5); t.is_alive()").text == "False"
        finally:
            for copy in copies:
                if isinstance(copy, Sandbox):
                    copy.kill()
        assert sbx.run_code("t.is_alive()").text == "True"


def test_a_paused_sandbox_resumes_on_its_next_use() -> None:
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(SETUP)
        sbx.pause()
        assert sbx.run_code(PROBE).text == "(41, 'kept', None)"
        assert sbx.restarts == 0


def test_another_process_resumes_a_paused_sandbox_by_id(store: Path) -> None:
    sbx = Sandbox(checkpointable=True)
    sbx.run_code(SETUP)
    sbx.pause()
    script = (
        "import sys\nfrom sandlot import Sandbox\n"
        "sbx = Sandbox.connect(sys.argv[1])\n"
        f"print(sbx.run_code({PROBE!r}).text)\n"
        "sbx.kill()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, sbx.sandbox_id],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SANDLOT_CHECKPOINT_DIR": str(store)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(41, 'kept', None)"
    assert not (store / sbx.sandbox_id).exists()  # killed there: deleted for good
    with pytest.raises(CheckpointError, match="no paused sandbox"):
        Sandbox.connect(sbx.sandbox_id)


def test_snapshots_start_independent_sandboxes_and_the_original_carries_on() -> None:
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(SETUP)
        snapshot = sbx.create_snapshot(name="after setup")
        assert isinstance(snapshot, SnapshotInfo) and snapshot.names == ["after setup"]
        assert snapshot.snapshot_id in {s.snapshot_id for s in Sandbox.list_snapshots()}
        assert sbx.run_code("x = 1; x").text == "1"  # the original carries on
        with (
            Sandbox.create(snapshot.snapshot_id) as one,
            Sandbox.create(snapshot.snapshot_id) as two,
        ):
            assert one.sandbox_id not in (two.sandbox_id, sbx.sandbox_id)
            assert one.run_code(PROBE).text == "(41, 'kept', None)"
            one.run_code("x = 2")
            one.files.write("notes.txt", "changed")
            assert two.run_code(PROBE).text == "(41, 'kept', None)"
        assert Sandbox.delete_snapshot(snapshot.snapshot_id) is True
        assert Sandbox.delete_snapshot(snapshot.snapshot_id) is False
        with pytest.raises(CheckpointError, match="no snapshot"):
            Sandbox.create(snapshot.snapshot_id)


def test_fork_makes_independent_copies_of_a_running_session() -> None:
    with Sandbox(checkpointable=True) as sbx:
        sbx.run_code(SETUP)
        copies = sbx.fork(count=3)
        try:
            assert all(isinstance(c, Sandbox) for c in copies), copies
            sandboxes = [c for c in copies if isinstance(c, Sandbox)]
            assert len({c.sandbox_id for c in sandboxes} | {sbx.sandbox_id}) == 4
            for i, copy in enumerate(sandboxes):
                assert copy.run_code(PROBE).text == "(41, 'kept', None)"
                copy.run_code(f"x = {i}")
            assert [c.run_code("x").text for c in sandboxes] == ["0", "1", "2"]
            assert sbx.run_code(PROBE).text == "(41, 'kept', None)"
        finally:
            for copy in copies:
                if isinstance(copy, Sandbox):
                    copy.kill()
        assert Sandbox.list_snapshots() == []  # the fork's own snapshot is gone


def test_an_ordinary_sandbox_says_how_to_make_it_pausable() -> None:
    with Sandbox(backend="bwrap") as sbx:
        sbx.run_code("x = 1")
        with pytest.raises(CheckpointError, match="checkpointable=True"):
            sbx.pause()
        assert sbx.run_code("x").text == "1"


def test_killing_a_paused_sandbox_deletes_it(store: Path) -> None:
    sbx = Sandbox(checkpointable=True)
    sbx.pause()
    assert (store / sbx.sandbox_id).exists()
    sbx.kill()
    assert not (store / sbx.sandbox_id).exists()
