"""Each Docker/Podman container is a host uid and gid of its own, for its life only.

Read from the host, not from inside: every process of a runc/crun container is that
container's own uid in ``/proc/<pid>/status`` (real, effective, saved and file-system),
no two live containers share one, and none is 1000 (the uid every container used to
run as, which made the kernel's per-user quotas shared; ``tests/escape/
test_user_quotas.py`` shows the quotas themselves). The uid goes back to the range when
the container ends, however it ends, and a full or missing range refuses the start
with the fix, leaving no container behind. Bounded polls only, never sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _host import eventually
from sandlot import IsolationUnavailable, Sandbox
from sandlot.backends import _hostids
from sandlot.backends.docker import DockerBackend, PodmanBackend, _engine_for, owner_tag
from sandlot.backends.docker._compile import LABEL, LABEL_OWNER
from sandlot.backends.docker._engine import DOCKER, PODMAN

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="reads every container process's /proc status as root"
)

RUNC_ENGINES = [
    pytest.param("docker", marks=pytest.mark.requires_docker, id="docker"),
    pytest.param("podman", marks=pytest.mark.requires_podman, id="podman"),
]
ALL_ENGINES = [
    *RUNC_ENGINES,
    pytest.param("docker-runsc", marks=pytest.mark.requires_runsc, id="docker-runsc"),
]
CYCLES = 4
SETTLE = 60.0
"""Upper bound of the polls below (a loaded two-core host can be slow to tear down)."""


def _backend(name: str) -> DockerBackend | PodmanBackend:
    if name == "podman":
        return PodmanBackend()
    return DockerBackend(runtime="runsc" if name == "docker-runsc" else None)


def _wait_until(check: Callable[[], bool], timeout: float = SETTLE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def _handle(sbx: Sandbox) -> object:
    return sbx._core._handle  # type: ignore[attr-defined]


def _held(sbx: Sandbox) -> tuple[int, int]:
    ids = _handle(sbx).host_ids  # type: ignore[attr-defined]
    return ids.uid, ids.gid


def _ids_of(pid: int) -> tuple[set[int], set[int]]:
    """Every uid and gid (real, effective, saved, fs) ``pid`` runs as, from the host."""
    uids: set[int] = set()
    gids: set[int] = set()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uids.update(int(x) for x in line.split()[1:])
        elif line.startswith("Gid:"):
            gids.update(int(x) for x in line.split()[1:])
    return uids, gids


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (parent links from /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _container_pids(sbx: Sandbox) -> list[int]:
    container = _handle(sbx).container  # type: ignore[attr-defined]
    state = (container.engine.inspect(container.cid) or {}).get("State") or {}
    return _tree(int(state["Pid"]))


def _lock_holders() -> dict[int, str]:
    lock_dir = os.environ.get(_hostids.LOCK_DIR_ENV) or _hostids.DEFAULT_LOCK_DIR
    return _hostids.HostIdAllocator(_hostids.configured_range(), lock_dir).holders()


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    try:
        yield made
    finally:
        for sbx in made:
            sbx.kill()


@pytest.mark.parametrize("engine", RUNC_ENGINES)
def test_live_containers_run_as_host_uids_of_their_own(
    engine: str, sandboxes: list[Sandbox]
) -> None:
    id_range = _hostids.configured_range()
    seen: dict[int, int] = {}
    for _ in range(2):
        sbx = Sandbox(backend=_backend(engine), timeout=300)
        sandboxes.append(sbx)
        # A process of user code besides the supervisor and the kernel.
        sbx.run_code("import subprocess\n_sleeper = subprocess.Popen(['sleep', '300'])")
        pids = _container_pids(sbx)
        assert len(pids) >= 3, pids  # supervisor, kernel, sleep
        # One uid and one gid for every process of the container, as the host sees it.
        (uids, gids), *others = [_ids_of(pid) for pid in pids]
        assert all(other == (uids, gids) for other in others), [_ids_of(p) for p in pids]
        assert len(uids) == len(gids) == 1, (uids, gids)
        uid, gid = uids.pop(), gids.pop()
        assert uid not in seen, f"two live containers run as host uid {uid}"
        assert uid not in (0, 1000) and gid not in (0, 1000), (uid, gid)
        assert id_range.first_uid <= uid < id_range.first_uid + id_range.count
        assert _held(sbx) == (uid, gid)
        # No user namespace under runc/crun: the uid code sees is the host's, and its
        # own account files name it.
        inside = sbx.commands.run("id -u; id -g; id -un; echo ~")
        assert inside.stdout.split() == [str(uid), str(gid), "user", "/home/user"]
        assert _lock_holders()[uid].split()[0] == str(os.getpid())
        seen[uid] = gid
    assert len(seen) == 2 and len(set(seen.values())) == 2, seen


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_host_ids_go_back_when_containers_end(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Killed by the SDK, ended by the engine behind the SDK's back, or closed as a
    context manager: the ids and their account files are given back, and N
    create/kill cycles leave no uid held."""
    from sandlot.backends.docker._accounts import ACCOUNTS_SUBDIR

    # A range and lock directory of the test's own: other processes on the host take
    # and give back uids of the shared range meanwhile.
    monkeypatch.setenv(_hostids.RANGE_ENV, "2000000200-2000000207")
    monkeypatch.setenv(_hostids.LOCK_DIR_ENV, str(tmp_path))
    lock_dir = tmp_path
    used = []
    for cycle in range(CYCLES):
        sbx = Sandbox(backend=_backend(engine), timeout=300)
        uid, _ = _held(sbx)
        used.append(uid)
        accounts = lock_dir / ACCOUNTS_SUBDIR / str(uid)
        assert uid in _lock_holders() and (accounts / "passwd").is_file()
        if cycle % 3 == 0:
            sbx.kill()
        elif cycle % 3 == 1:
            # The container ends without the SDK's doing (an operator, the engine).
            container = _handle(sbx).container  # type: ignore[attr-defined]
            container.engine.kill_and_remove(container.cid)
            assert _wait_until(lambda u=uid: u not in _lock_holders()), f"uid {uid} still held"
            sbx.kill()
        else:
            with sbx:
                pass
        assert uid not in _lock_holders(), f"cycle {cycle}: uid {uid} still held"
        assert not accounts.exists(), f"cycle {cycle}: {accounts} left behind"
    assert _lock_holders() == {}
    assert len(set(used)) == CYCLES  # round robin: a uid just given back is not reused first


@pytest.mark.parametrize("engine", RUNC_ENGINES)
def test_a_uid_a_container_still_runs_as_is_never_handed_out(
    engine: str, tmp_path: Path, sandboxes: list[Sandbox]
) -> None:
    """The owner's lock is not all that guards a uid: should it be gone while the
    container still runs (its owner was SIGKILLed; ``cleanup_orphans`` has not run yet),
    the allocator still skips the uid, because processes run as it."""
    sbx = Sandbox(backend=_backend(engine), timeout=300)
    sandboxes.append(sbx)
    uid, gid = _held(sbx)
    only_that_uid = _hostids.HostIdRange(uid, gid, 1, "test")
    allocator = _hostids.HostIdAllocator(only_that_uid, tmp_path)  # no lock held there
    with pytest.raises(_hostids.HostIdsExhausted):
        allocator.acquire()
    sbx.kill()
    # The engine may still be reaping the container's last processes when kill()
    # returns (Podman's conmon): the uid is free once nothing runs as it.
    eventually(lambda: uid not in _hostids.uids_in_use(), f"nothing to run as uid {uid}")
    allocator.acquire().release()


def _owned_containers(name: str) -> list[str]:
    engine = _engine_for(PODMAN if name == "podman" else DOCKER)
    return [
        str(c["Id"])
        for c in engine.containers([LABEL])
        if (c.get("Labels") or {}).get(LABEL_OWNER) == owner_tag()
    ]


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_a_full_range_refuses_cleanly_until_a_container_ends(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sandboxes: list[Sandbox]
) -> None:
    # Two ids no account uses, and a lock directory of this test's own.
    monkeypatch.setenv(_hostids.RANGE_ENV, "2000000100-2000000101")
    monkeypatch.setenv(_hostids.LOCK_DIR_ENV, str(tmp_path))
    for _ in range(2):
        sandboxes.append(Sandbox(backend=_backend(engine), timeout=300))
    assert {_held(s)[0] for s in sandboxes} == {2000000100, 2000000101}
    before = sorted(_owned_containers(engine))
    with pytest.raises(_hostids.HostIdsExhausted, match="all 2 host uids") as refused:
        Sandbox(backend=_backend(engine), timeout=300)
    assert "Fix:" in str(refused.value) and "usermod --add-subuids" in str(refused.value)
    assert sorted(_owned_containers(engine)) == before  # refused before creating one
    first_uid = _held(sandboxes[0])[0]
    sandboxes[0].kill()
    eventually(lambda: first_uid not in _hostids.uids_in_use(), f"nothing to run as {first_uid}")
    third = Sandbox(backend=_backend(engine), timeout=300)
    sandboxes.append(third)
    assert _held(third)[0] == first_uid
    assert third.run_code("1 + 1").text == "2"


NO_RANGE_CHILD = textwrap.dedent(
    """
    import json, sys
    from sandlot import IsolationUnavailable, Sandbox
    from sandlot.backends.docker import DockerBackend, PodmanBackend, _engine_for, owner_tag
    from sandlot.backends.docker._compile import LABEL, LABEL_OWNER
    backend = DockerBackend() if sys.argv[1] == "docker" else PodmanBackend()
    try:
        Sandbox(backend=backend, timeout=60).kill()
        refusal = None
    except IsolationUnavailable as exc:
        refusal = str(exc)
    left = [c["Id"] for c in _engine_for(backend.kind).containers([LABEL])
            if (c.get("Labels") or {}).get(LABEL_OWNER) == owner_tag()]
    print(json.dumps({"refusal": refusal, "left": left}))
    """
)


@pytest.mark.parametrize("engine", RUNC_ENGINES)
def test_no_delegated_range_refuses_with_the_fix_and_doctor_says_so(engine: str) -> None:
    """A host where root has no /etc/subuid and /etc/subgid entry (empty files bound over
    them, in a mount namespace of the test's own) and no SANDLOT_HOST_IDS: the start is
    refused with the fix and no container is made; ``sandlot doctor`` says the same."""
    env = {k: v for k, v in os.environ.items() if k != _hostids.RANGE_ENV}

    def without_range(*argv: str) -> subprocess.CompletedProcess[str]:
        script = (
            'mount --bind /dev/null /etc/subuid && mount --bind /dev/null /etc/subgid && exec "$@"'
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip

    child = without_range(sys.executable, "-c", NO_RANGE_CHILD, engine)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["left"] == []
    assert result["refusal"] is not None and "no range is delegated" in result["refusal"]
    assert "usermod --add-subuids 100000-165535" in result["refusal"]
    doctor = without_range(sys.executable, "-m", "sandlot", "doctor", "--json")
    checks = {c["name"].strip(): c for c in json.loads(doctor.stdout)["checks"]}
    check = checks["container host ids"]
    assert check["status"] == "missing" and "will not start" in check["detail"], check
    assert "usermod --add-subuids" in check["fix"]


@pytest.mark.requires_docker
def test_doctor_reports_the_range_containers_take_their_ids_from() -> None:
    from sandlot.backends.docker import host_ids_finding

    finding = host_ids_finding()
    assert finding.status == "ok", finding
    assert _hostids.configured_range().describe() in finding.detail


def test_a_bad_range_is_reported_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.backends.docker import host_ids_finding

    monkeypatch.setenv(_hostids.RANGE_ENV, "0-65535")  # would include root
    finding = host_ids_finding()
    assert finding.status == "missing" and "usermod --add-subuids" in finding.fix
    with pytest.raises(IsolationUnavailable, match="usermod --add-subuids"):
        _hostids.configured_range()
