"""Syscalls from another ABI cannot slip past the filter's native-number rules."""

from __future__ import annotations

import signal

import pytest
from escape_helpers import xfail_under_gvisor

from sandlot import Sandbox

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
