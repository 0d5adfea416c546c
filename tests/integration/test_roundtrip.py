"""The cell round trip's fast path, against real sandboxes.

The supervisor hands a cell to an idle kernel on the thread that reads the host
channel (never blocking there), and a cell's exit, not the thread that watches its
timeout, frees the kernel for the next cell. These tests hold it to what the slower
path guaranteed: a kernel that forges its exits and stops reading its socket stalls
only its own cells, never the supervisor; cells from several threads on one context
still run one at a time, each with its own result.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from sandlot import Execution, Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

STALL = 4.0
"""Seconds the kernel sleeps after forging its cell's exit (it reads nothing then)."""
FORGE_AND_STALL = f"""
import sys, time
kernel = sys.stdout.kernel
kernel.channel.send({{"type": "exit", "id": kernel.current_id, "status": "ok"}})
time.sleep({STALL})
"""
BIG = 300_000
"""Bytes of code in the big cell: more than a socket buffer holds, so sending it waits
for the kernel to read (on a worker, not on the thread that reads the host)."""


@pytest.mark.parametrize("size", ["small", "big"])
def test_a_stalled_kernel_with_a_forged_exit_does_not_stall_the_supervisor(
    fresh_sandbox: Sandbox, size: str
) -> None:
    sbx = fresh_sandbox
    started = time.monotonic()
    forged = sbx.run_code(FORGE_AND_STALL, timeout=30)
    assert forged.status == "ok"
    assert time.monotonic() - started < STALL  # the forged exit ended the cell early
    code = "1+1" if size == "small" else f"x = '{'a' * BIG}'\nlen(x) + 1"
    expect = "2" if size == "small" else str(BIG + 1)
    outcome: list[Execution] = []
    runner = threading.Thread(target=lambda: outcome.append(sbx.run_code(code, timeout=30)))
    runner.start()
    try:
        # The next cell waits for the sleeping kernel; everything else is served now.
        for _ in range(3):
            asked = time.monotonic()
            assert [c.id for c in sbx.list_code_contexts()] == ["default"]
            sbx.files.write("stall.txt", "still here")
            assert sbx.files.read("stall.txt") == "still here"
            assert time.monotonic() - asked < STALL / 2
        assert runner.is_alive()  # ... and it does wait: nothing read it yet
    finally:
        runner.join(60)
    assert not runner.is_alive()
    execution = outcome[0]
    assert execution.error is None, execution.error
    assert execution.text == expect
    assert sbx.run_code("1+1").text == "2"


def test_cells_from_threads_on_one_context_run_one_at_a_time(sandbox: Sandbox) -> None:
    sbx = sandbox
    sbx.run_code("import threading, time\n_rtt_busy = threading.Lock()")
    # Each cell fails if another cell of the context is running at the same time.
    cell = (
        "assert _rtt_busy.acquire(blocking=False), 'two cells at once'\n"
        "time.sleep(0.002)\n"
        "_rtt_busy.release()\n"
        "{n} * 2"
    )
    errors: list[Any] = []

    def run(offset: int) -> None:
        for n in range(offset, offset + 40):
            execution = sbx.run_code(cell.format(n=n), timeout=60)
            if execution.error is not None or execution.text != str(n * 2):
                errors.append((n, execution.error, execution.text))

    threads = [threading.Thread(target=run, args=(1000 * i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert sbx.run_code("1+1").text == "2"


@pytest.mark.parametrize("stubborn", [False, True], ids=["interrupted", "restarted"])
def test_a_timed_out_cell_frees_its_kernel_for_the_next(
    fresh_sandbox: Sandbox, stubborn: bool
) -> None:
    sbx = fresh_sandbox
    sbx.run_code("kept = 41")
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if stubborn else ""
    started = time.monotonic()
    execution = sbx.run_code(f"import signal, time\n{ignore}time.sleep(60)", timeout=0.5)
    assert time.monotonic() - started < 10
    assert execution.status == "timeout"
    assert execution.error is not None and execution.error.name == "TimeoutError"
    # The next cells run at once, on the same kernel (variables kept) or a new one.
    for n in range(20):
        assert sbx.run_code(f"{n} + 1", timeout=30).text == str(n + 1)
    kept = sbx.run_code("kept + 1")
    if stubborn:
        assert kept.error is not None and kept.error.name == "NameError"
    else:
        assert kept.text == "42"


# User code writes lines to its kernel's socket that json.loads cannot parse: nested too
# deep (RecursionError, not ValueError), not JSON, not UTF-8. The supervisor drops each
# and goes on forwarding the cell; it used to lose the thread that listens to the
# kernel on the first one, and the cell then ran into its timeout.
UNPARSABLE = """
import sys
kernel = sys.stdout.kernel
with kernel.channel.lock:
    kernel.channel.sock.sendall(b'{"a":' + b"[" * 200000 + b"\\n")
    kernel.channel.sock.sendall(b"not json\\n" + b'{"type":"stdout","id":"\\xff"}\\n')
print("still here")
6 * 7
"""


def test_lines_the_supervisor_cannot_parse_are_dropped_and_the_cell_goes_on(
    fresh_sandbox: Sandbox,
) -> None:
    sbx = fresh_sandbox
    execution = sbx.run_code(UNPARSABLE, timeout=10)
    assert execution.error is None, execution.error
    assert execution.logs.stdout == ["still here\n"]
    assert execution.text == "42"
    assert sbx.run_code("1 + 1").text == "2"
