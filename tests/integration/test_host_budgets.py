"""What a hostile cell can make the host hold, against real sandboxes.

The runner caps results by their JSON text (``result_bytes`` each, ``max_results`` a
cell), but it shares the sandbox with user code, and ``json.loads`` turns text made of
tiny values into objects worth twelve times its size or more. Here user code writes
such results straight to its kernel's socket, past the kernel's own display code; the
runner forwards them (each is within its caps), so only the host can stop them.

The SDK runs in a child process that reports its own peak RSS (``VmHWM``, reset after
the warm-up through ``/proc/self/clear_refs``), so the measure is the host's and not
the test runner's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sandlot.policy import MiB

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

RESULT_MIB = 4
RESULTS = 16
"""Before the fix the host held about 16 x 4 MiB x 12 = 768 MiB for this cell."""

# User code: find the kernel's channel to the supervisor and send RESULTS results of
# just under result_bytes each (as the runner measures them: json.dumps(data), whose
# ", " separators count 6 bytes an item) made of two-letter strings.
HOSTILE = """
import sys
frame = sys._getframe()
while type(frame.f_locals.get("self")).__name__ != "Kernel":
    frame = frame.f_back
kernel = frame.f_locals["self"]
channel = kernel.channel
items = ({limit} - 4096) // 6
body = '{{"type":"result","id":"%s","is_main_result":false,"data":{{"application/json":[' % (
    kernel.current_id
)
line = (body + '"ab",' * items + '"x"]}}}}\\n').encode()
with channel.lock:
    for _ in range({count}):
        channel.sock.sendall(line)
print("sent", len(line), flush=True)
"""

CHILD = """
import json, sys
from sandlot import Pool, Sandbox

backend, result_bytes, count, hostile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resources = {"result_bytes": result_bytes, "max_results": count}


def status(field):
    with open("/proc/self/status") as f:
        for row in f:
            if row.startswith(field + ":"):
                return int(row.split()[1]) * 1024
    raise KeyError(field)


def run(sbx):
    sbx.run_code("print('warm')")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    hostile_run = sbx.run_code(hostile, timeout=120)
    peak = status("VmHWM")
    after = sbx.run_code("print(6 * 7)")
    return {
        "growth": peak - base,
        "status": hostile_run.status,
        "truncated": hostile_run.truncated,
        "results": len(hostile_run.results),
        "stdout": "".join(hostile_run.logs.stdout),
        "stderr": "".join(hostile_run.logs.stderr),
        "next": "".join(after.logs.stdout),
        "next_status": after.status,
        "error": repr(hostile_run.error),
    }


if backend == "pool":
    with Pool(size=1, backend="zygote") as pool:
        pool.warm("python-data", resources=resources)
        with Sandbox(pool=pool, backend=pool._backend, resources=resources, timeout=300) as sbx:
            report = run(sbx)
else:
    with Sandbox(backend=backend, resources=resources, timeout=300) as sbx:
        report = run(sbx)
print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "backend",
    [
        "bwrap",
        "zygote",
        "pool",
        pytest.param("docker", marks=pytest.mark.requires_docker),
        pytest.param("podman", marks=pytest.mark.requires_podman),
    ],
)
def test_results_of_tiny_values_are_cut_before_the_host_parses_them(backend: str) -> None:
    limit = RESULT_MIB * MiB
    hostile = textwrap.dedent(HOSTILE).format(limit=limit, count=RESULTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(limit), str(RESULTS), hostile],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.splitlines()[-1])
    # The cell did run and send everything (the runner let each result through).
    assert "sent" in report["stdout"], report
    # The host held at most about twice the result cap, not twelve times it per result.
    assert report["growth"] <= 2 * limit, (
        f"the SDK grew by {report['growth'] / MiB:.0f} MiB (cap {RESULT_MIB} MiB)"
    )
    # The Execution says so, and the sandbox keeps working.
    assert report["truncated"] is True, report
    assert "the host dropped the rest" in report["stderr"], report
    assert report["next_status"] == "ok" and report["next"] == "42\n", report
