"""Checkpoint and restore for real, at the backend seam: a checkpointable bubblewrap
sandbox (``SandboxSpec(checkpointable=True)``) is checkpointed with CRIU and restored
twice from the one checkpoint, each copy in namespaces of its own and as host ids of
its own.

What it shows, each with a check that fails if the mechanism does not hold: variables,
the execution count, a file in the home directory and a background child process come
back; the host's channel is handed in anew; the syscall filter comes back and no
capability does; the root is read-only; two copies restored from one checkpoint do not
see each other's changes and run as different host uids; the nested namespace layout
of ordinary sandboxes is what CRIU refuses.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import CheckpointError
from sandlot.backends import _checkpoint
from sandlot.backends._base import SandboxHandle
from sandlot.backends._checkpoint import DumpPlan
from sandlot.backends.bwrap import BwrapBackend
from sandlot.policy import SandboxSpec

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template, pytest.mark.requires_criu]

SPEC = SandboxSpec(checkpointable=True)


def run(handle: SandboxHandle, code: str) -> dict[str, Any]:
    """One cell: its main result's text, stdout, the exit event."""
    stream = handle.request(
        {"type": "execute", "code": code, "context": "default", "envs": {}, "timeout": 30}
    )
    out: dict[str, Any] = {"text": None, "stdout": ""}
    while True:
        event = stream.next(30)
        assert event is not None, "the cell did not finish"
        if event["type"] == "result" and event.get("is_main_result"):
            out["text"] = event["data"].get("text/plain")
        if event["type"] == "stdout":
            out["stdout"] += event["text"]
        if event["type"] in ("exit", "reply"):
            out["exit"] = event
            return out


def status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def pid1(handle: Any) -> int:
    process = handle.process
    if getattr(process, "is_pid_namespace_init", False):
        return int(process.pid)
    return int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])


@pytest.fixture
def store() -> Iterator[Path]:
    """Where checkpoints go: reachable (o+x) as restores need, not listable."""
    path = Path(tempfile.mkdtemp(prefix="sandlot-ckpt-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def handles() -> Iterator[list[SandboxHandle]]:
    started: list[SandboxHandle] = []
    yield started
    for handle in started:
        with contextlib.suppress(Exception):
            handle.kill()


def test_a_checkpointed_sandbox_comes_back_twice_each_copy_on_its_own(
    store: Path, handles: list[SandboxHandle]
) -> None:
    backend = BwrapBackend()
    original = backend.start(SPEC)
    handles.append(original)
    setup = (
        "import subprocess\n"
        "x = 41\n"
        "open('/home/user/notes.txt', 'w').write('kept')\n"
        "child = subprocess.Popen(['sleep', '3600'])\n"
        "x + 1"
    )
    assert run(original, setup)["text"] == "42"
    first_pid = pid1(original)
    filters = status(first_pid, "Seccomp_filters")
    original_uid = status(first_pid, "Uid").split()[0]
    checkpoint = store / "one"
    checkpoint.mkdir()
    original.checkpoint(str(checkpoint))
    assert not original.alive  # a checkpoint ends the sandbox

    copies = [backend.restore(str(checkpoint), SPEC) for _ in range(2)]
    handles.extend(copies)
    probe = "(x, open('/home/user/notes.txt').read(), child.poll())"
    for copy in copies:
        got = run(copy, probe)
        assert got["text"] == "(41, 'kept', None)"
        assert got["exit"]["execution_count"] == 2
        pid = pid1(copy)
        assert status(pid, "Seccomp") == "2"
        assert status(pid, "Seccomp_filters") == filters
        assert status(pid, "NoNewPrivs") == "1"
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status(pid, caps), 16) == 0, caps
        denied = run(copy, "try:\n    open('/x', 'w')\nexcept OSError as e:\n    print(e.errno)")
        assert denied["stdout"].strip() == "30"  # EROFS: the root is read-only
        unshare = (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())"  # CLONE_NEWUSER
        )
        assert run(copy, unshare)["stdout"].split() == ["-1", "1"]  # EPERM: the filter holds

    # Independent: a change in one copy is not in the other.
    assert run(copies[0], "x = 7; x")["text"] == "7"
    assert run(copies[1], "x")["text"] == "41"
    first, second = (pid1(copy) for copy in copies)
    for ns in ("user", "pid", "net", "mnt", "ipc", "uts"):
        assert os.readlink(f"/proc/{first}/ns/{ns}") != os.readlink(f"/proc/{second}/ns/{ns}")
    uids = {status(pid, "Uid").split()[0] for pid in (first, second)}
    assert len(uids) == 2 and original_uid not in uids
    assert status(first, "NSpid").split()[-1] == "1"


def test_a_call_in_flight_refuses_the_checkpoint_and_the_sandbox_runs_on(
    store: Path, handles: list[SandboxHandle]
) -> None:
    handle = BwrapBackend().start(SPEC)
    handles.append(handle)
    stream = handle.request(
        {"type": "execute", "code": "import time; time.sleep(2); 5", "context": "default",
         "envs": {}, "timeout": 30}
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="still running"):
        handle.checkpoint(str(store))
    while (event := stream.next(30)) is not None and event["type"] not in ("exit", "reply"):
        pass
    assert run(handle, "6")["text"] == "6"
    assert os.listdir(store) == []


def test_an_ordinary_sandbox_says_it_cannot_be_checkpointed(store: Path) -> None:
    handle = BwrapBackend().start(SandboxSpec())
    try:
        with pytest.raises(CheckpointError, match="not started checkpointable"):
            handle.checkpoint(str(store))
        assert run(handle, "1 + 1")["text"] == "2"
    finally:
        handle.kill()


def test_the_nested_layout_is_what_criu_refuses(tmp_path: Path) -> None:
    """The namespace layout ordinary sandboxes use (bubblewrap's own, nested user
    namespace) cannot be checkpointed: what makes the checkpointable layout necessary."""
    handle = BwrapBackend().start(SandboxSpec())
    try:
        images = tmp_path / "images"
        images.mkdir()
        plan = DumpPlan(pid=pid1(handle), images_dir=str(images), leave_running=True)
        done = subprocess.run(
            _checkpoint.dump_argv(plan, criu=_checkpoint.criu_path() or "criu"),
            capture_output=True,
            check=False,
        )
        assert done.returncode != 0
        assert "user namespace" in (images / "dump.log").read_text()
        assert run(handle, "1 + 1")["text"] == "2"
    finally:
        handle.kill()


INOTIFY_HOG = """
import ctypes, os, resource
libc = ctypes.CDLL(None)
for fd in globals().get('held', []):
    os.close(fd)
held = []
while len(held) < 1000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
(len(held), open('/proc/sys/user/max_inotify_instances').read().strip(),
 resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0])
"""


def _root_gets_an_inotify_instance() -> bool:
    import ctypes

    fd = ctypes.CDLL(None, use_errno=True).inotify_init1(0)
    if fd < 0:
        return False
    os.close(fd)
    return True


def test_a_checkpointable_sandbox_and_its_copy_take_only_their_share_of_roots_quotas(
    store: Path, handles: list[SandboxHandle]
) -> None:
    """A checkpointable sandbox's user namespace is root's, so the kernel charges its
    inotify instances (and queue bytes, queued signals) to root too: unbounded, one
    sandbox took all 128 of root's instances and CRIU (root) could then neither
    checkpoint nor restore anything. Each sandbox, started or restored (CRIU makes its
    user namespace anew, without limits), holds at most its share."""
    from sandlot.backends.bwrap._quotas import shares

    share = shares(raise_limits=False)
    instances = share.user["max_inotify_instances"]
    expected = (instances, str(instances), share.rlimits["msgqueue"])
    backend = BwrapBackend()
    original = backend.start(SandboxSpec(checkpointable=True))
    handles.append(original)
    assert run(original, INOTIFY_HOG)["text"] == repr(expected)
    assert _root_gets_an_inotify_instance()
    original.checkpoint(str(store))
    copy = backend.restore(str(store), SPEC)
    handles.append(copy)
    # The limit is back in the copy's new user namespace, and holds.
    assert run(copy, INOTIFY_HOG)["text"] == repr(expected)
    assert _root_gets_an_inotify_instance()


def test_a_restored_sandbox_refuses_a_second_checkpoint_and_runs_on(
    store: Path, handles: list[SandboxHandle]
) -> None:
    """CRIU cannot dump a restored sandbox (its namespace check cannot open the
    non-dumpable supervisor's /proc/1/ns/*: the supervisor's memory, set up by CRIU,
    belongs to the host's user namespace). Refused up front, the sandbox is not lost."""
    backend = BwrapBackend()
    original = backend.start(SPEC)
    handles.append(original)
    assert run(original, "x = 5; x")["text"] == "5"
    first = store / "first"
    first.mkdir()
    original.checkpoint(str(first))
    copy = backend.restore(str(first), SPEC)
    handles.append(copy)
    second = store / "second"
    second.mkdir()
    with pytest.raises(CheckpointError, match="cannot be checkpointed again"):
        copy.checkpoint(str(second))
    assert copy.alive and run(copy, "x + 1")["text"] == "6"
    assert os.listdir(second) == []


OWNER = """
import sys, time
from sandlot.backends.bwrap import BwrapBackend
from sandlot.policy import SandboxSpec
spec = SandboxSpec(checkpointable=True)
backend = BwrapBackend()
backend.start(spec).checkpoint(sys.argv[1])
copy = backend.restore(sys.argv[1], spec)
print("ready", flush=True)
time.sleep(120)
"""


def test_the_root_of_a_restored_sandbox_whose_owner_was_killed_is_swept(store: Path) -> None:
    """A restored sandbox's root directory (a bind mount) is released when the sandbox
    ends; when its owner is SIGKILLed first, the next sweep (sandlot serve's start-up
    cleanup, a process's first restore) unmounts and removes it."""
    import signal
    import sys

    from sandlot.backends.bwrap import _persist

    with subprocess.Popen(
        [sys.executable, "-c", OWNER, str(store)], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            assert owner.stdout is not None and owner.stdout.readline() == "ready\n"
            roots = [n for n in os.listdir(_persist.ROOTS_DIR) if n.startswith(f"{owner.pid}.")]
            assert len(roots) == 1  # control: named after its owner
            path = os.path.join(_persist.ROOTS_DIR, roots[0])
            _persist.sweep_orphan_roots()
            assert os.path.isdir(path)  # a live owner's root is left alone
        finally:
            owner.send_signal(signal.SIGKILL)
            owner.wait()
    assert roots[0] in [line.split()[-1] for line in BwrapBackend.cleanup_orphans()]
    assert not os.path.exists(path)
    assert path not in Path("/proc/self/mountinfo").read_text()
