"""Checkpoint and restore for real: a bubblewrap sandbox in the namespace layout CRIU
can checkpoint (sandlot.backends._checkpoint), dumped with CRIU and restored twice from
the one checkpoint, each copy in namespaces of its own and as host ids of its own.

What it shows, each with a check that fails if the mechanism does not hold:
variables, a file in the sandbox's home and a background child process come back; the
host's channel is re-plumbed to a new socket (the dumped one's peer is gone); the
syscall filter comes back; two copies restored from one checkpoint do not see each
other's changes and run as different host uids; the namespace layout passes CRIU's
checks where sandlot's nested layout does not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.backends import _checkpoint, _hostids
from sandlot.backends._checkpoint import DumpPlan, RestorePlan
from sandlot.backends.bwrap import _seccomp

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_criu]

# The sandbox's program: answers on its channel (fd 3 once started), holds a variable,
# keeps a file in its home and a background child, and counts in /tmp.
PROGRAM = r"""
import os, socket, subprocess, time
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
chan = socket.socket(fileno=int(os.environ["CHAN"]))
os.closerange(3, chan.fileno())
os.closerange(chan.fileno() + 1, 4096)
x = 41
with open("/home/user/notes.txt", "w") as f:
    f.write("kept")
child = subprocess.Popen(["sleep", "3600"])
buf = b""
while True:
    data = chan.recv(4096)
    if not data:
        time.sleep(0.05)  # the host's end went away (checkpointed): wait to be restored
        continue
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        cmd = line.decode().split()
        if cmd[0] == "set":
            x = int(cmd[1])
        if cmd[0] == "unshare":
            try:
                os.unshare(os.CLONE_NEWUSER)
                said = "allowed"
            except (OSError, AttributeError) as exc:
                said = f"refused {getattr(exc, 'errno', exc)}"
            chan.sendall(f"{said}\n".encode())
            continue
        notes = open("/home/user/notes.txt").read()
        alive = child.poll() is None
        chan.sendall(f"x={x} notes={notes} child={alive} uid={os.getuid()}\n".encode())
"""

CHANNEL_FD = 3


def _ask(sock: socket.socket, line: str) -> str:
    sock.settimeout(10)
    sock.sendall(line.encode() + b"\n")
    got = b""
    while not got.endswith(b"\n"):
        part = sock.recv(4096)
        assert part, "the sandbox closed its channel"
        got += part
    return got.decode().strip()


def _status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _root_skeleton(path: Path) -> None:
    """The mount points of the sandbox below (what its read-only root held)."""
    for d in ("usr", "etc", "proc", "dev", "tmp", "home/user"):
        (path / d).mkdir(parents=True, exist_ok=True)
    for name in ("lib", "lib64", "bin", "sbin"):
        target = Path("/") / name
        if target.is_symlink():
            (path / name).symlink_to(os.readlink(target))
    (path / "etc/passwd").touch()


class _Ids:
    def __init__(self) -> None:
        self.held: list[_hostids.HostIds] = []

    def three(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        got = [_hostids.acquire() for _ in range(3)]
        self.held += got
        return got[0].pair, got[1].pair, got[2].pair


@pytest.fixture
def ids() -> Iterator[_Ids]:
    held = _Ids()
    yield held
    for one in held.held:
        one.release()


@pytest.fixture
def pids() -> Iterator[list[int]]:
    started: list[int] = []
    yield started
    for pid in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start(ids: _Ids, tmp_path: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    root, one, user = ids.three()
    maps = _checkpoint.sandbox_maps(root, one, user)
    spaces = _checkpoint.make_namespaces(maps, owner=(0, 0))
    program = _seccomp.program_fd()
    # The channel is made inside the sandbox's network namespace: CRIU finds it there.
    host, guest = _checkpoint.in_netns(spaces.net, socket.socketpair)
    chan = 10
    argv = [
        "bwrap", "--userns", str(spaces.user), "--unshare-pid", "--unshare-ipc",
        "--unshare-uts", "--cap-drop", "ALL", "--seccomp", str(program), "--as-pid-1",
        "--new-session",
        "--uid", "1000", "--gid", "1000", "--hostname", "sandlot", "--clearenv",
        "--setenv", "CHAN", str(chan), "--setenv", "HOME", "/home/user",
        "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc/passwd", "/etc/passwd",
    ]  # fmt: skip
    for name in ("lib", "lib64", "bin", "sbin"):
        if Path("/", name).is_symlink():
            argv += ["--symlink", os.readlink(Path("/", name)), f"/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/home/user"]
    argv += ["--chdir", "/home/user", "--remount-ro", "/", "--", "/usr/bin/python3", "-c", PROGRAM]

    def enter() -> None:
        if _checkpoint._LIBC.setns(spaces.net, 0x40000000) != 0:
            raise OSError("setns(net)")
        os.dup2(guest.fileno(), chan)

    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(spaces.user, program, guest.fileno(), chan),
            preexec_fn=enter,
            env={},
        )
    finally:
        spaces.close()
        os.close(program)
        guest.close()
    return process, host


def _pid1(bwrap: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{bwrap.pid}/task/{bwrap.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("bwrap started no sandbox")


def _restore(
    images: Path, root: Path, channel_inode: int, ids: _Ids, pids: list[int]
) -> tuple[int, socket.socket]:
    copy = images.parent / f"copy-{len(pids)}"
    shutil.copytree(images, copy)
    root_ids, one, user = ids.three()
    _checkpoint.rewrite_userns(str(copy), _checkpoint.sandbox_maps(root_ids, one, user))
    host, guest = socket.socketpair()
    plan = RestorePlan(
        images_dir=str(copy),
        root=str(root),
        inherit=((guest.fileno(), f"socket:[{channel_inode}]"),),
    )
    argv = _checkpoint.restore_argv(plan, criu=_checkpoint.criu_path() or "criu")
    done = subprocess.run(argv, pass_fds=(guest.fileno(),), capture_output=True, check=False)
    guest.close()
    log = (
        (copy / "restore.log").read_text(errors="replace")
        if (copy / "restore.log").exists()
        else ""
    )
    assert done.returncode == 0, log[-3000:]
    pid = int((copy / "restored.pid").read_text())
    pids.append(pid)
    return pid, host


def test_a_checkpointed_sandbox_comes_back_twice_each_copy_on_its_own(
    tmp_path: Path, ids: _Ids, pids: list[int]
) -> None:
    criu = _checkpoint.criu_path() or "criu"
    bwrap, host = _start(ids, tmp_path)
    try:
        pid1 = _pid1(bwrap)
        pids.append(pid1)
        assert _ask(host, "get").startswith("x=41 notes=kept child=True uid=1000")
        host.sendall(b"set 42\n")
        assert _ask(host, "get").startswith("x=42")
        filters = _status(pid1, "Seccomp_filters")
        original_uid = _status(pid1, "Uid").split()[0]

        channel = next(
            os.stat(f"/proc/{pid1}/fd/{fd}").st_ino
            for fd in os.listdir(f"/proc/{pid1}/fd")
            if os.readlink(f"/proc/{pid1}/fd/{fd}").startswith("socket:")
        )
        images = tmp_path / "images"
        images.mkdir()
        plan = DumpPlan(pid=pid1, images_dir=str(images), external_unix=(channel,))
        done = subprocess.run(
            _checkpoint.dump_argv(plan, criu=criu), capture_output=True, check=False
        )
        log = (images / "dump.log").read_text(errors="replace")
        assert done.returncode == 0, log[-3000:]
        bwrap.wait(timeout=10)  # dumped without --leave-running: the sandbox is gone
    finally:
        host.close()
        if bwrap.poll() is None:
            bwrap.kill()
            bwrap.wait()

    root = tmp_path / "root"
    _root_skeleton(root)
    first, first_chan = _restore(images, root, channel, ids, pids)
    second, second_chan = _restore(images, root, channel, ids, pids)
    with first_chan, second_chan:
        for pid, chan in ((first, first_chan), (second, second_chan)):
            assert _ask(chan, "get").startswith("x=42 notes=kept child=True uid=1000")
            assert _status(pid, "Seccomp") == "2"
            for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(_status(pid, caps), 16) == 0, caps
            assert _status(pid, "Seccomp_filters") == filters
            assert _ask(chan, "unshare").startswith("refused")
        # Independent: a change in one copy is not in the other.
        first_chan.sendall(b"set 7\n")
        assert _ask(first_chan, "get").startswith("x=7")
        assert _ask(second_chan, "get").startswith("x=42")
        # Each copy has namespaces and host ids of its own.
        for ns in ("user", "pid", "net", "mnt", "ipc", "uts"):
            assert os.readlink(f"/proc/{first}/ns/{ns}") != os.readlink(
                f"/proc/{second}/ns/{ns}"
            ), ns
        uids = {_status(pid, "Uid").split()[0] for pid in (first, second)}
        assert len(uids) == 2 and original_uid not in uids
        # Its own pid namespace: the restored tree is pid 1 there, its child is there too.
        assert _status(first, "NSpid").split()[-1] == "1"
        assert Path(f"/proc/{first}/task/{first}/children").read_text().split()


def test_the_nested_layout_is_what_criu_refuses(tmp_path: Path) -> None:
    """The namespace layout sandboxes use today (bubblewrap's own, nested user
    namespace) cannot be checkpointed: what makes the layout above necessary."""
    from sandlot import Sandbox

    with Sandbox(backend="bwrap") as sbx:
        sbx.run_code("x = 1")
        bwrap = sbx._core._handle._process  # type: ignore[attr-defined]
        pid1 = int(Path(f"/proc/{bwrap.pid}/task/{bwrap.pid}/children").read_text().split()[0])
        images = tmp_path / "images"
        images.mkdir()
        plan = DumpPlan(pid=pid1, images_dir=str(images), leave_running=True)
        done = subprocess.run(
            _checkpoint.dump_argv(plan, criu=_checkpoint.criu_path() or "criu"),
            capture_output=True,
            check=False,
        )
        assert done.returncode != 0
        assert "user namespace" in (images / "dump.log").read_text()
        assert sbx.run_code("x + 1").text == "2"
