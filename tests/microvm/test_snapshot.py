"""VMs restored from one snapshot (the microvm backend's default) each have their own
identity: the kernel's random generator reseeded with the host's entropy, Python's
generators reseeded from it, their own writable file systems, and the uid and
capabilities of a cold-booted VM.

Two VMs restored from the same saved state start as the same bytes of memory: without
the reseed their ``os.urandom``, ``random``, ``uuid4`` and ``secrets`` would answer
alike (the kernel's generator state is part of the saved memory). Each check below
runs the same cell in both and compares.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import BackendUnavailable, Pool, Sandbox
from sandlot.backends.microvm import MicroVMBackend
from sandlot.backends.microvm._qemu import artifacts_dir
from sandlot.backends.microvm._snapshot import snapshot_dir
from sandlot.policy import SandboxSpec

pytestmark = [pytest.mark.requires_microvm, pytest.mark.slow]

IDENTITY = """
import json, os, random, secrets, tempfile, uuid
import numpy
print(json.dumps({
    "tempname": next(tempfile._get_candidate_names()),
    "urandom": os.urandom(16).hex(),
    "random": random.random(),
    "uuid4": str(uuid.uuid4()),
    "secret": secrets.token_hex(16),
    "numpy": float(numpy.random.random()),
    "getrandom": os.getrandom(16).hex(),
    "kernel_uuid": open("/proc/sys/kernel/random/uuid").read().strip(),
}))
"""


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[Sandbox, Sandbox]]:
    """Two VMs restored from the same snapshot (the first start makes it, if needed)."""
    first = Sandbox(backend=MicroVMBackend(), timeout=900)
    try:
        second = Sandbox(backend=MicroVMBackend(), timeout=900)
        try:
            yield first, second
        finally:
            second.kill()
    finally:
        first.kill()


def _identity(sbx: Sandbox) -> dict[str, object]:
    execution = sbx.run_code(IDENTITY)
    assert execution.error is None, execution.error
    document: dict[str, object] = json.loads("".join(execution.logs.stdout))
    return document


def test_restored_vms_have_their_own_randomness(twins: tuple[Sandbox, Sandbox]) -> None:
    first, second = (_identity(sbx) for sbx in twins)
    for name in first:
        assert first[name] != second[name], f"{name} is the same in two restored VMs"


def test_a_file_written_in_one_is_not_in_the_other(twins: tuple[Sandbox, Sandbox]) -> None:
    first, second = twins
    for path in ("/home/user/only-in-first", "/tmp/only-in-first", "/dev/shm/only-in-first"):
        wrote = first.run_code(f"open({path!r}, 'w').write('first'); 1")
        assert wrote.error is None, wrote.error
        seen = second.run_code(f"import os; os.path.exists({path!r})")
        assert seen.error is None and seen.text == "False", path
    first.files.write("/home/user/via-files", "first")
    assert not second.files.exists("/home/user/via-files")


def test_restored_vm_runs_as_uid_1000_without_capabilities(
    twins: tuple[Sandbox, Sandbox],
) -> None:
    # pid 1 of a snapshot template is root until the restore; each copy must drop it.
    result = twins[0].run_code(
        "fields = {}\n"
        "for pid in ('1', 'self'):\n"
        "    for line in open(f'/proc/{pid}/status'):\n"
        "        key, _, value = line.partition(':')\n"
        "        fields[pid + ' ' + key] = value.split()\n"
        "[fields[f'{p} {k}'] for p in ('1', 'self') for k in\n"
        " ('Uid', 'Gid', 'Groups', 'CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')]"
    )
    assert result.error is None, result.error
    assert result.text is not None
    values = eval(result.text)  # a list of lists of strings, printed by the VM
    zero = ["0000000000000000"]
    expected = [["1000"] * 4, ["1000"] * 4, [], zero, zero, zero, zero, zero, ["1"]]
    assert values == expected * 2


def test_restored_vm_has_no_network_device_and_a_read_only_root(
    twins: tuple[Sandbox, Sandbox],
) -> None:
    result = twins[1].run_code(
        "import os, errno\n"
        "try:\n"
        "    open('/usr/escape', 'w')\n"
        "    wrote = 'wrote'\n"
        "except OSError as exc:\n"
        "    wrote = errno.errorcode[exc.errno]\n"
        "(sorted(os.listdir('/sys/class/net')), wrote)"
    )
    assert result.error is None, result.error
    assert result.text == "(['lo'], 'EROFS')"


def test_the_snapshot_is_private_to_sandlots_user(twins: tuple[Sandbox, Sandbox]) -> None:
    directory = snapshot_dir()
    info = directory.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    states = list(directory.glob("*.state"))
    assert states
    for state in states:
        assert stat.S_IMODE(state.stat().st_mode) & 0o077 == 0, state


def test_a_snapshot_directory_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDLOT_MICROVM_DIR", str(artifacts_dir()))  # the real artifacts
    monkeypatch.setenv("SANDLOT_CACHE_DIR", str(tmp_path))
    (tmp_path / "microvm-snapshots").mkdir(mode=0o777)
    (tmp_path / "microvm-snapshots").chmod(0o777)
    with pytest.raises(BackendUnavailable, match="no one else can write"):
        MicroVMBackend().start(SandboxSpec())


def test_a_warm_pool_hands_out_restored_vms_that_differ() -> None:
    with Pool(size=2, backend=MicroVMBackend(), starts=2) as pool:
        pool.warm()
        with pool._cond:  # notified whenever a started sandbox joins the ready queue
            pool._cond.wait_for(lambda: pool.stats().size == 2, timeout=300)
        assert pool.stats().size == 2, pool.stats()
        sandboxes = [Sandbox(backend=MicroVMBackend(), pool=pool, timeout=300) for _ in range(2)]
        try:
            assert pool.stats().hits == 2
            first, second = (_identity(sbx) for sbx in sandboxes)
            assert first["urandom"] != second["urandom"]
            assert first["random"] != second["random"]
        finally:
            for sbx in sandboxes:
                sbx.kill()
