"""What a host process has set for itself must not reach its sandboxes.

Signal masks, "ignore" dispositions and the file mode mask survive fork and exec. A host that starts
sandboxes from a thread with SIGINT blocked (a Ray worker's threads, for one) or
ignored gave every process in the sandbox the same, and a cell's interrupt, a SIGINT
to its kernel, never arrived: a timeout then killed and restarted the kernel (its
variables gone) instead of interrupting the cell, and a client that left a server did
not stop its cell. Each case runs in a child process of its own, which sets up its
signals as such a host does before it makes any sandbox.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

HOST = textwrap.dedent(
    """
    import json, signal, sys
    how = sys.argv[1]
    if how == "blocked":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    elif how == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from sandlot import Sandbox
    found = {}
    for backend in ("bwrap", "zygote"):
        with Sandbox(backend=backend, timeout=120) as sbx:
            sbx.run_code("x = 41")
            timed_out = sbx.run_code("import time; time.sleep(60)", timeout=1)
            after = sbx.run_code("x + 1")
            inside = sbx.run_code(
                "import signal\\n"
                "print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())),"
                " signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)"
            )
            found[backend] = {
                "error": timed_out.error.name if timed_out.error else None,
                "after": after.text,
                "inside": "".join(inside.logs.stdout).strip(),
            }
    print(json.dumps(found))
    """
)


@pytest.mark.parametrize("how", ["blocked", "ignored", "default"])
def test_a_timeout_interrupts_the_cell_whatever_the_host_did_with_its_signals(how: str) -> None:
    """The timed-out cell is interrupted: the kernel and ``x`` survive (a kernel the
    interrupt does not reach is killed and restarted after the grace period, and ``x``
    is gone); and code in the sandbox sees no blocked signal and SIGTERM not ignored.
    ``default`` is the control: a host that left its signals alone."""
    done = subprocess.run(
        [sys.executable, "-c", HOST, how], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for backend, seen in found.items():
        assert seen["error"] == "TimeoutError", (backend, seen)
        assert seen["after"] == "42", (backend, seen)  # not restarted: state kept
        assert seen["inside"] == "[] False", (backend, seen)


UMASK = textwrap.dedent(
    """
    import json, os, sys
    os.umask(int(sys.argv[1], 8))
    from sandlot import Sandbox
    found = {}
    for backend in ("bwrap", "zygote"):
        with Sandbox(backend=backend, timeout=120) as sbx:
            sbx.files.write("by-api.txt", "x")
            cell = sbx.run_code(
                "import os\\n"
                "open('by-code.txt', 'w').write('y')\\n"
                "print(oct(os.umask(0o022)), *(oct(os.stat(f).st_mode & 0o777)"
                " for f in ('by-api.txt', 'by-code.txt')))"
            )
            found[backend] = "".join(cell.logs.stdout).strip()
    print(json.dumps(found))
    """
)


@pytest.mark.parametrize("umask", ["077", "000"])
def test_the_hosts_umask_does_not_decide_the_sandboxs_file_modes(umask: str) -> None:
    """A service's umask (077 under hardened units, 000 elsewhere) stays the host's:
    the sandbox's code and its files API create files as under the usual 022."""
    done = subprocess.run(
        [sys.executable, "-c", UMASK, umask], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {b: "0o22 0o644 0o644" for b in ("bwrap", "zygote")}, found
