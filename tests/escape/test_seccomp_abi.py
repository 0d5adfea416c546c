"""The syscall filter's edges: other ABIs, and calls the policy has not reviewed.

Rules are written for the native ABI's numbers, so a call through another ABI (x32 on
x86-64) must kill the process. And the filter is an allowlist: calls newer than the deny
list (``statmount``, ``listmount``, ``open_tree_attr``, ``mseal``: Linux 6.8 to 6.15) are
refused, and so is every number above the highest the policy has reviewed, so a kernel
newer than the policy adds nothing a sandbox can call. The calls are made by number from
user code with ctypes, in a fresh process.
"""

from __future__ import annotations

import errno
import json
import signal

import pytest
from escape_helpers import is_container, is_gvisor, xfail_under_gvisor

from sandlot import Sandbox
from sandlot.seccomp import SYSCALL_NUMBERS, highest_reviewed

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

X32_GETPID = """
import ctypes, subprocess, sys
child = "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39)"  # x32 getpid
print(subprocess.run([sys.executable, "-c", child]).returncode)
"""


def test_an_x32_syscall_kills_the_process(sandbox: Sandbox, request: pytest.FixtureRequest) -> None:
    xfail_under_gvisor(
        sandbox,
        request,
        "gVisor has no x32 ABI: the x32 getpid fails with ENOSYS in gVisor's "
        "kernel and the child exits 0; no host kernel filter is reached to kill it",
    )
    # Without the filter's architecture check the kernel answers ENOSYS (x32 off) or
    # runs getpid (x32 on), and the child exits 0. With it, the child dies of SIGSYS.
    execution = sandbox.run_code(X32_GETPID, timeout=30)
    assert execution.error is None, execution.error
    assert "".join(execution.logs.stdout).strip() == str(-signal.SIGSYS)


# Each call with arguments that succeed, or fail only past the filter, on a kernel that
# has it and no filter (checked by hand on Linux 6.18, outside any sandbox:
# open_tree_attr returned a descriptor, listmount and statmount EFAULT, mseal 0).
NEW_CALLS = """
import ctypes, errno, json, mmap, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
AT_FDCWD = -100
page = mmap.mmap(-1, mmap.PAGESIZE)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
calls = {
    "statmount": (457, 0, 0, 0, 0),       # a NULL request: EFAULT past the filter
    "listmount": (458, 0, 0, 0, 0),       # likewise
    "mseal": (462, address, mmap.PAGESIZE, 0),
    "open_tree_attr": (467, AT_FDCWD, b"/", 0, 0, 0),
    **{f"nr {n}": (n,) for n in NUMBERS},
}
outcome = {}
for name, (nr, *args) in calls.items():
    ctypes.set_errno(0)
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    rc = libc.syscall(ctypes.c_long(nr), *args)
    outcome[name] = "OK" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps({"machine": platform.machine(), **outcome}))
"""


def _unreviewed_numbers() -> list[int]:
    """Numbers above every table's highest (both arches number new calls alike), and
    the largest native one (bit 30 set is x32 on x86-64, tested above)."""
    top = max(highest_reviewed(arch) for arch in SYSCALL_NUMBERS)
    return [top + 1, top + 2, top + 30, 1000, 0x3FFFFFFF]


EXPECTED = {
    "statmount": "ENOSYS",
    "listmount": "ENOSYS",
    "mseal": "ENOSYS",
    "open_tree_attr": "EPERM",
}


@pytest.fixture(scope="module")
def new_calls(sandbox: Sandbox) -> dict[str, str]:
    code = f"NUMBERS = {_unreviewed_numbers()!r}\n{NEW_CALLS}"
    sandbox.files.write("/tmp/new_calls.py", code)
    command = sandbox.commands.run("python3 /tmp/new_calls.py", timeout=60)
    assert command.exit_code == 0, command.stderr
    outcome: dict[str, str] = json.loads(command.stdout)
    assert outcome.pop("machine") in SYSCALL_NUMBERS
    return outcome


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_calls_newer_than_the_deny_list_are_refused(
    new_calls: dict[str, str], name: str, sandbox: Sandbox
) -> None:
    # Before the allowlist these four passed the filter: open_tree_attr gave a
    # descriptor, mseal sealed the page, listmount and statmount reached the kernel.
    accepted = {EXPECTED[name]}
    if is_container(sandbox):
        # A container engine names calls with its own libseccomp, and a denial it cannot
        # name falls to the profile's default: refused all the same, with ENOSYS.
        accepted.add("ENOSYS")
    if is_gvisor(sandbox):
        # gVisor implements none of them (ENOSYS), and runsc answers EPERM for what
        # its profile refuses.
        accepted |= {"ENOSYS", "EPERM"}
    assert new_calls[name] in accepted, f"{name}: got {new_calls[name]}, want {accepted}"


def test_numbers_above_the_reviewed_table_are_refused(new_calls: dict[str, str]) -> None:
    # Kernels up to the reviewed one have nothing there, so the kernel would answer
    # ENOSYS as well; tests/integration/test_seccomp_allowlist.py shows the filter
    # refusing calls the running kernel does have, with a policy older than it.
    numbers = {name: outcome for name, outcome in new_calls.items() if name.startswith("nr ")}
    assert len(numbers) == len(_unreviewed_numbers())
    assert set(numbers.values()) == {errno.errorcode[errno.ENOSYS]}, numbers
