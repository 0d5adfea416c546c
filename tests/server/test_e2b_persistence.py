"""Pause, resume, snapshots and fork through E2B's wire, with the unmodified E2B SDKs
against a real ``sandlot serve --checkpointable`` (bubblewrap sandboxes, CRIU).

A paused sandbox survives a restart of the server with its variables, files and a
running background process; snapshots start independent sandboxes; forks are
independent copies; another tenant finds none of them.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _server_harness import ServerProcess

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.requires_server,
    pytest.mark.requires_criu,
]


class Wire:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.key = server.key("persist")
        self.other_key = server.key("persist-other")

    def opts(self, key: str | None = None) -> dict[str, Any]:
        return self.server.e2b_opts(key or self.key)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    store = Path(tempfile.mkdtemp(prefix="sandlot-e2b-store-", dir="/var/tmp"))
    store.chmod(0o711)
    server = ServerProcess(
        tmp_path_factory.mktemp("e2b-persist"),
        "--checkpointable",
        "--pool-size",
        "0",
        env={"SANDLOT_CHECKPOINT_DIR": str(store)},
    ).start()
    try:
        yield Wire(server)
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(store)], check=False)


SETUP = (
    "import subprocess\n"
    "x = 41\n"
    "child = subprocess.Popen(['sleep', '3600'])\n"
    "open('/home/user/notes.txt', 'w').write('kept')"
)
PROBE = "(x, open('/home/user/notes.txt').read(), child.poll())"


def test_a_paused_sandbox_survives_a_server_restart(wire: Wire) -> None:
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, **wire.opts())
    try:
        assert sbx.run_code(SETUP).error is None
        assert sbx.pause() is True
        assert not sbx.is_running()
        assert Sandbox.pause(sbx.sandbox_id, **wire.opts()) is False  # paused already
        listed = {s.sandbox_id: s.state for s in Sandbox.list(**wire.opts()).next_items()}
        assert listed[sbx.sandbox_id] == "paused"
        assert Sandbox.get_info(sbx.sandbox_id, **wire.opts()).state == "paused"

        wire.server.stop()
        wire.server.start()
        with pytest.raises(SandboxException):
            Sandbox.connect(sbx.sandbox_id, **wire.opts(wire.other_key))

        resumed = Sandbox.connect(sbx.sandbox_id, **wire.opts())
        assert resumed.sandbox_id == sbx.sandbox_id
        assert resumed.is_running()
        assert resumed.run_code(PROBE).text == "(41, 'kept', None)"
        assert resumed.files.read("/home/user/notes.txt") == "kept"
    finally:
        Sandbox.kill(sbx.sandbox_id, **wire.opts())


def test_snapshots_start_independent_sandboxes(wire: Wire) -> None:
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, **wire.opts())
    try:
        sbx.run_code("x = 41")
        sbx.files.write("/home/user/shared.txt", "shared")
        snapshot = sbx.create_snapshot(name="after-setup")
        assert snapshot.snapshot_id and snapshot.names == ["after-setup"]
        assert sbx.run_code("x + 1").text == "42"  # the original carries on
        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, **wire.opts()).next_items()
        assert [s.snapshot_id for s in listed] == [snapshot.snapshot_id]
        assert Sandbox.list_snapshots(**wire.opts(wire.other_key)).next_items() == []
        with pytest.raises(SandboxException):
            Sandbox.create(snapshot.snapshot_id, **wire.opts(wire.other_key))

        one = Sandbox.create(snapshot.snapshot_id, timeout=60, **wire.opts())
        two = Sandbox.create(snapshot.snapshot_id, timeout=60, **wire.opts())
        try:
            one.files.write("/home/user/shared.txt", "changed in one")
            one.run_code("x = 7")
            assert two.files.read("/home/user/shared.txt") == "shared"
            assert two.run_code("x").text == "41"
            assert one.run_code("x").text == "7"
        finally:
            one.kill()
            two.kill()
        assert Sandbox.delete_snapshot(snapshot.snapshot_id, **wire.opts()) is True
        assert Sandbox.delete_snapshot(snapshot.snapshot_id, **wire.opts()) is False
    finally:
        sbx.kill()


def test_fork_gives_independent_running_copies(wire: Wire) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=120, **wire.opts())
    try:
        sbx.run_code("x = 41")
        sbx.files.write("/home/user/state.txt", "before fork")
        forks = sbx.fork(count=2, timeout=60)
        copies = [f for f in forks if isinstance(f, Sandbox)]
        assert len(copies) == 2, forks
        try:
            assert len({c.sandbox_id for c in copies} | {sbx.sandbox_id}) == 3
            copies[0].files.write("/home/user/state.txt", "changed in a fork")
            copies[0].run_code("x = 0")
            assert copies[1].run_code("x").text == "41"
            assert sbx.files.read("/home/user/state.txt") == "before fork"
            assert sbx.run_code("x").text == "41"
        finally:
            for copy in copies:
                copy.kill()
    finally:
        sbx.kill()


def test_a_filesystem_only_pause_is_refused_in_e2bs_shape(wire: Wire) -> None:
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=60, **wire.opts())
    try:
        with pytest.raises(SandboxException, match="keep memory"):
            sbx.pause(keep_memory=False)
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_killing_a_paused_sandbox_deletes_it(wire: Wire) -> None:
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=60, **wire.opts())
    sbx.pause()
    assert Sandbox.kill(sbx.sandbox_id, **wire.opts(wire.other_key)) is False
    assert Sandbox.kill(sbx.sandbox_id, **wire.opts()) is True
    with pytest.raises(SandboxException):
        Sandbox.connect(sbx.sandbox_id, **wire.opts())


def test_a_sandbox_created_with_auto_pause_is_paused_at_its_timeout(wire: Wire) -> None:
    import time

    from e2b.sandbox.sandbox_api import SandboxState
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(
        timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": False}, **wire.opts()
    )
    try:
        sbx.run_code("x = 41")
        deadline = time.monotonic() + 30
        while sbx.get_info().state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused at its timeout"
            time.sleep(0.2)
        assert not sbx.is_running()
        sbx.connect(timeout=60)
        assert sbx.get_info().state == SandboxState.RUNNING
        assert sbx.run_code("x + 1").text == "42"
    finally:
        Sandbox.kill(sbx.sandbox_id, **wire.opts())
