"""The host id allocator: a uid/gid pair per live sandbox, from a delegated range.

Real locks in a temporary directory and real processes for the crash cases; only the
set of uids "some process runs as" is given by the tests where starting processes as
those uids would need root.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandlot import IsolationUnavailable
from sandlot.backends._hostids import (
    HostIdAllocator,
    HostIdRange,
    HostIdsExhausted,
    configured_range,
    uids_in_use,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")
# Far above any account on a test host (checked by configured_range, not here).
FIRST = 3_000_000_000
ACCOUNT = min(entry.pw_uid for entry in pwd.getpwall() if entry.pw_uid > 0)
"""The uid of some account on this host (daemon, bin, ...)."""


def _allocator(tmp_path: Path, count: int = 3, busy: set[int] | None = None) -> HostIdAllocator:
    return HostIdAllocator(
        HostIdRange(FIRST, FIRST + 500, count, "test"), tmp_path, in_use=lambda: set(busy or ())
    )


def test_each_holder_gets_its_own_pair_and_exhaustion_is_a_typed_refusal(tmp_path: Path) -> None:
    alloc = _allocator(tmp_path)
    held = [alloc.acquire() for _ in range(3)]
    assert sorted(h.uid for h in held) == [FIRST, FIRST + 1, FIRST + 2]
    assert all(h.gid == h.uid + 500 for h in held)
    with pytest.raises(HostIdsExhausted, match="all 3 host uids") as caught:
        alloc.acquire()
    assert isinstance(caught.value, IsolationUnavailable)  # fail closed, with the fix
    assert "usermod --add-subuids" in str(caught.value)


def test_a_released_pair_is_handed_out_again(tmp_path: Path) -> None:
    alloc = _allocator(tmp_path, count=2)
    first, second = alloc.acquire(), alloc.acquire()
    second.release()
    second.release()  # idempotent
    again = alloc.acquire()
    assert again.uid == second.uid
    with pytest.raises(HostIdsExhausted):
        alloc.acquire()
    first.release()
    again.release()


def test_another_allocator_in_this_process_sees_the_same_holders(tmp_path: Path) -> None:
    # Two Sandbox() calls build two allocators; the lock files, not the object, decide.
    held = _allocator(tmp_path, count=1).acquire()
    with pytest.raises(HostIdsExhausted):
        _allocator(tmp_path, count=1).acquire()
    assert _allocator(tmp_path).holders() == {FIRST: f"{os.getpid()} {_start(os.getpid())}"}
    held.release()
    assert _allocator(tmp_path, count=1).acquire().uid == FIRST


def test_a_uid_some_process_still_runs_as_is_skipped(tmp_path: Path) -> None:
    # A sandbox that outlived its owner by a moment: its lock is free, its uid is not.
    alloc = _allocator(tmp_path, count=2, busy={FIRST})
    assert alloc.acquire().uid == FIRST + 1
    with pytest.raises(HostIdsExhausted):
        alloc.acquire()


@pytest.mark.parametrize("child_releases", [True, False])
def test_a_forked_child_neither_keeps_nor_gives_back_its_parents_pair(
    tmp_path: Path, child_releases: bool
) -> None:
    # A child forked from the SDK's process shares each lock's open file description:
    # its release (an atexit handler) must not free the parent's uid, and its copy of
    # the descriptor (a long-lived worker) must not keep the uid after the parent's.
    alloc = _allocator(tmp_path, count=1)
    held = alloc.acquire()
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if child_releases:
                held.release()
            os.write(to_parent_w, b"ready")
            os.read(to_child_r, 1)  # lives on until the parent has checked
        finally:
            os._exit(0)
    try:
        assert os.read(to_parent_r, 8) == b"ready"
        with pytest.raises(HostIdsExhausted):
            alloc.acquire()  # still the parent's
        held.release()  # while the child still lives
        assert alloc.acquire().uid == FIRST
    finally:
        os.write(to_child_w, b"x")
        os.waitpid(pid, 0)
        for fd in (to_parent_r, to_parent_w, to_child_r, to_child_w):
            os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a process as another uid")
def test_the_real_process_table_is_read(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "600"], user=FIRST, group=FIRST)
    try:
        alloc = HostIdAllocator(HostIdRange(FIRST, FIRST, 2, "test"), tmp_path)
        assert alloc.acquire().uid == FIRST + 1
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a process as another uid")
def test_a_zombie_does_not_pin_its_uid() -> None:
    # Some inits reap slowly or never; a zombie runs nothing and holds no descriptors.
    child = subprocess.Popen(["true"], user=FIRST, group=FIRST)
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert Path(f"/proc/{child.pid}/status").read_text().count("State:\tZ") == 1
        assert FIRST not in uids_in_use()
    finally:
        child.wait()


HOLDER = """
import sys, time
sys.path.insert(0, {src!r})
from sandlot.backends._hostids import HostIdAllocator, HostIdRange
alloc = HostIdAllocator(HostIdRange({first}, {first}, 1, "test"), {dir!r}, in_use=set)
held = alloc.acquire()
print(held.uid, flush=True)
time.sleep(600)
"""


def test_the_pair_of_an_owner_that_was_killed_is_free_again(tmp_path: Path) -> None:
    # Crash recovery: SIGKILL leaves no chance to release; the kernel drops the lock.
    code = textwrap.dedent(HOLDER).format(src=SRC, first=FIRST, dir=str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == str(FIRST)
        alloc = _allocator(tmp_path, count=1)
        with pytest.raises(HostIdsExhausted):
            alloc.acquire()
        assert alloc.holders() == {FIRST: f"{holder.pid} {_start(holder.pid)}"}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    # The record it left names a dead owner: stale, not held.
    assert (tmp_path / str(FIRST)).read_text().split()[0] == str(holder.pid)
    assert alloc.holders() == {}
    assert alloc.acquire().uid == FIRST


def test_the_range_comes_from_the_environment_or_roots_subordinate_ids(tmp_path: Path) -> None:
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text("alice:100000:65536\nroot:3000000000:1000\n")
    subgid.write_text("root:3100000000:500\n")
    got = configured_range({}, str(subuid), str(subgid))
    assert (got.first_uid, got.first_gid, got.count) == (3_000_000_000, 3_100_000_000, 500)
    env = {"SANDLOT_HOST_IDS": "3000000000-3000000009"}
    got = configured_range(env, str(subuid), str(subgid))
    assert (got.first_uid, got.first_gid, got.count) == (3_000_000_000, 3_000_000_000, 10)


@pytest.mark.parametrize(
    ("env", "subuid", "message"),
    [
        ({}, "alice:100000:65536\n", "no range is delegated"),
        ({"SANDLOT_HOST_UID": "65534"}, "root:3000000000:10\n", "same host uid"),
        ({"SANDLOT_HOST_IDS": "lots"}, "", "is not FIRST-LAST"),
        ({"SANDLOT_HOST_IDS": "0-100"}, "", "includes id 0"),
        ({"SANDLOT_HOST_IDS": "3000000000-3000000000"}, "", "at least 2"),
        ({"SANDLOT_HOST_IDS": f"{ACCOUNT}-{ACCOUNT + 1}"}, "", "which account"),
    ],
)
def test_no_usable_range_is_a_refusal_that_names_the_fix(
    tmp_path: Path, env: dict[str, str], subuid: str, message: str
) -> None:
    (tmp_path / "subuid").write_text(subuid)
    (tmp_path / "subgid").write_text(subuid)
    with pytest.raises(IsolationUnavailable, match=message) as caught:
        configured_range(env, str(tmp_path / "subuid"), str(tmp_path / "subgid"))
    assert "Fix" in str(caught.value) or "FIRST-LAST" in str(caught.value)


def _start(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.mark.parametrize("raise_limits", [True, False])
def test_a_zygote_splits_its_uids_quotas_into_shares(raise_limits: bool) -> None:
    import resource

    from sandlot.backends.bwrap._quotas import INOTIFY_SHARE, shares

    got = shares(raise_limits)
    instances = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    slots = max(2, instances // INOTIFY_SHARE)
    assert got.sandboxes == slots - 1  # one share kept back
    assert got.user["max_inotify_instances"] * slots <= instances
    assert got.user["max_user_namespaces"] == 0
    for name, which in (
        ("msgqueue", resource.RLIMIT_MSGQUEUE),
        ("sigpending", resource.RLIMIT_SIGPENDING),
    ):
        soft, hard = resource.getrlimit(which)
        if raise_limits:  # each sandbox what a cold one gets; the zygote room for all
            assert (which, got.rlimits[name] * slots) in got.zygote_rlimits
            if soft != resource.RLIM_INFINITY:
                assert got.rlimits[name] == soft
        else:  # the zygote's own limit, divided
            assert got.zygote_rlimits == ()
            if hard != resource.RLIM_INFINITY:
                assert got.rlimits[name] * slots <= hard
