"""A kernel newer than the syscall policy adds nothing a sandbox can call.

The policy's tables (``sandlot.seccomp.SYSCALL_NUMBERS``) list every call up to the
kernel it was reviewed against, and the filter refuses every other number with ENOSYS.
On a kernel no newer than that review, numbers above it do not exist anyway, so this
test makes the policy older than the running kernel instead: a child process cuts the
tables at ``futex_requeue`` (456, Linux 6.7) before starting real bwrap and zygote
sandboxes, whose filters are then built from the cut tables. Calls this kernel has and
the full policy allows (``lsm_list_modules``, ``getxattrat``, ``file_getattr``: Linux
6.8 to 6.17) must then fail with ENOSYS, as on a kernel without them, while the same
calls under the full policy reach the kernel.
"""

from __future__ import annotations

import ctypes
import errno
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

CUT = 456
RECENT = {"lsm_list_modules": 461, "getxattrat": 464, "file_getattr": 468}
"""Allowed by the full policy, above the cut; each called with arguments the kernel
refuses (NULL pointers, a bad descriptor), so nothing happens when it is reached."""
CONTROL = {"futex_wake": 454}
"""Below the cut: reaches the kernel under both policies."""

PROBE = textwrap.dedent(
    """
    import ctypes, errno, json
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = {}
    for name, nr in NUMBERS.items():
        ctypes.set_errno(0)
        rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(-1)] + [ctypes.c_long(0)] * 5)
        out[name] = "OK" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    print(json.dumps(out))
    """
)

CHILD = textwrap.dedent(
    """
    import json, sys
    from sandlot import Sandbox
    from sandlot.backends.bwrap import _seccomp
    cut, probe = int(sys.argv[1]), sys.argv[2]
    if cut:
        _seccomp.SYSCALL_NUMBERS = {
            arch: {name: nr for name, nr in table.items() if nr <= cut}
            for arch, table in _seccomp.SYSCALL_NUMBERS.items()
        }
    outcome = {}
    for backend in ("bwrap", "zygote"):
        with Sandbox(backend=backend, timeout=120) as sbx:
            sbx.files.write("/tmp/probe.py", probe)
            done = sbx.commands.run("python3 /tmp/probe.py", timeout=60)
            assert done.exit_code == 0, done.stderr
            outcome[backend] = json.loads(done.stdout)
    print(json.dumps(outcome))
    """
)


def _host_has(numbers: dict[str, int]) -> list[str]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    missing = []
    for name, nr in numbers.items():
        ctypes.set_errno(0)
        args = [ctypes.c_long(-1)] + [ctypes.c_long(0)] * 5
        if libc.syscall(ctypes.c_long(nr), *args) < 0 and ctypes.get_errno() == errno.ENOSYS:
            missing.append(name)
    return missing


def _run(cut: int) -> dict[str, dict[str, str]]:
    probe = f"NUMBERS = { ({**RECENT, **CONTROL})!r}\n{PROBE}"
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(cut), probe],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_policy_older_than_the_kernel_refuses_the_newer_calls() -> None:
    missing = _host_has({**RECENT, **CONTROL})
    if missing:
        pytest.skip(f"this kernel lacks {', '.join(missing)} (Linux 6.17 or newer has them)")
    enosys = errno.errorcode[errno.ENOSYS]
    full = _run(0)
    older = _run(CUT)
    for backend in ("bwrap", "zygote"):
        # The full policy lets them through to the kernel, which refuses the arguments.
        assert enosys not in full[backend].values(), (backend, full[backend])
        assert {older[backend][name] for name in RECENT} == {enosys}, (backend, older[backend])
        assert older[backend]["futex_wake"] == full[backend]["futex_wake"] != enosys
