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
from collections.abc import Callable
from typing import Any

import pytest

from sandlot import Execution, Resources, Sandbox

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


# User code writes lines to its kernel's socket that the supervisor takes for this
# cell's (its id is the one parsed) but whose start says something else: the type or the
# id given twice, the first one not the parsed one; plain output with a field beside its
# text that costs far more than the text; a line for another cell. The supervisor passes
# a kernel's line on as it is only when it starts with exactly this cell's type and id
# and, for plain output, holds nothing else; it encodes the others again from what it
# parsed. Passed on as they are, the first would break the protocol (the host kills the
# sandbox: a type it did not account for), the second would be routed to no one, and
# the third charged to the results budget and dropped.
FORGED_HEADERS = """
import sys
kernel = sys.stdout.kernel
rid = kernel.current_id
zeros = ",".join(["0"] * 20000)
lines = [
    '{"type":"stderr","id":"%s","type":"stdout","text":"type-twice\\\\n"}' % rid,
    '{"type":"stdout","id":"%s-9","id":"%s","text":"id-twice\\\\n"}' % (rid, rid),
    '{"type":"stdout","id":"%s","text":"extra-field\\\\n","x":[%s]}' % (rid, zeros),
    '{"type":"error","id":"%s","type":"result","data":{"text/plain":"7"},'
    '"is_main_result":false}' % rid,
    '{"type":"stdout","id":"%s-9","text":"other-cell\\\\n"}' % rid.rsplit("-", 1)[0],
]
with kernel.channel.lock:
    kernel.channel.sock.sendall("".join(line + "\\n" for line in lines).encode())
print("still here")
6 * 7
"""


def test_kernel_lines_whose_start_differs_from_their_content_are_encoded_again(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    # A results budget (plus the host's 1 MiB of slack) that the extra field's
    # 20,000 values (64 bytes each, counted as parsed) go over, and its text does not.
    sbx = make_sandbox(resources=Resources(result_bytes=64 * 1024))
    sbx.run_code("kept = 1")
    execution = sbx.run_code(FORGED_HEADERS, timeout=10)
    assert execution.error is None, execution.error
    assert "".join(execution.logs.stdout) == "type-twice\nid-twice\nextra-field\nstill here\n"
    assert not execution.truncated
    assert [r.text for r in execution.results] == ["7", "42"]
    # The same sandbox and kernel: nothing broke the protocol.
    assert sbx.run_code("kept + 1").text == "2"
    assert sbx._core.restarts == 0
