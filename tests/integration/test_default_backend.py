"""``Sandbox()`` with no backend named: bubblewrap, started through the zygote.

A process's first sandbox starts cold (it does not wait for the zygote to import the data
stack); the zygote starts in the background once that sandbox runs, and later sandboxes
are forked from it. Each check runs in a fresh interpreter: this test process has
zygotes of its own from other tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.requires_bwrap, pytest.mark.requires_template]

TEMPLATE = "python-data"


def _run(script: str) -> dict[str, object]:
    # The timeout bounds a hang (a close that waits for a zygote which never answers);
    # it is not a speed assertion. A script that stops processes prints their pids
    # first ("stopped": [...]), so that a hang does not leave them behind.
    try:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired as hung:
        out = hung.stdout.decode() if isinstance(hung.stdout, bytes) else hung.stdout or ""
        for line in out.splitlines():
            for pid in json.loads(line).get("stopped", []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        raise
    assert result.returncode == 0, result.stderr
    parsed: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return parsed


def test_the_first_default_sandbox_starts_cold_and_later_ones_fork_from_the_zygote() -> None:
    outcome = _run(
        f"""
        import json, time
        from sandlot import Sandbox
        from sandlot.backends.bwrap import _zygote

        def kind(sbx):
            return type(sbx._core._handle._process).__name__

        first = Sandbox({TEMPLATE!r}, timeout=60)
        zygotes = _zygote.zygotes_for({TEMPLATE!r}, _zygote.DATA_STACK)
        deadline = time.monotonic() + 60
        while not zygotes[0].alive:  # started in the background after the first sandbox
            assert time.monotonic() < deadline, "the zygote did not start within 60 s"
            time.sleep(0.05)
        second = Sandbox({TEMPLATE!r}, timeout=60)
        print(json.dumps({{
            "backend": first.backend.name,
            "kinds": [kind(first), kind(second)],
            "cells": [first.run_code("1 + 1").text, second.run_code("2 + 2").text],
            # The zygote's data stack is there without an import in the cell.
            "preloaded": second.run_code("import sys; 'pandas' in sys.modules").text,
        }}))
        """
    )
    assert outcome["backend"] == "zygote"
    assert outcome["kinds"] == ["Popen", "_ForkedSandbox"]
    assert outcome["cells"] == ["2", "4"]
    assert outcome["preloaded"] == "True"


def test_exiting_while_the_zygote_starts_does_not_wait_for_it() -> None:
    # The zygote is stopped (SIGSTOP) while it imports the data stack: it will never
    # answer. Closing it at exit must cut the start short and clean it up, not wait out
    # the start timeout (two minutes).
    outcome = _run(
        f"""
        import json, os, signal, time
        from sandlot import Sandbox
        from sandlot.backends.bwrap import _zygote

        def children(pid):
            found = []
            for task in os.listdir(f"/proc/{{pid}}/task"):
                with open(f"/proc/{{pid}}/task/{{task}}/children") as handle:
                    found += [int(c) for c in handle.read().split()]
            return found

        def tree(pid):
            return [pid] + [p for c in children(pid) for p in tree(c)]

        first = Sandbox({TEMPLATE!r}, timeout=60)
        zygote = _zygote.zygotes_for({TEMPLATE!r}, _zygote.DATA_STACK)[0]
        first.kill()
        deadline = time.monotonic() + 60
        while zygote._starting is None:  # waiting for the zygote's "ready"
            assert time.monotonic() < deadline, "the zygote's start did not begin"
            time.sleep(0.01)
        bwraps = [
            pid for pid in children(os.getpid())
            if b"--cap-add" in open(f"/proc/{{pid}}/cmdline", "rb").read()
        ]
        stopped = [pid for bwrap in bwraps for pid in tree(bwrap)]
        print(json.dumps({{"stopped": stopped}}), flush=True)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        _zygote.close_all()
        left = []
        for pid in stopped:
            try:
                with open(f"/proc/{{pid}}/stat") as handle:
                    state = handle.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state not in ("Z", "X"):
                left.append(pid)
        print(json.dumps({{
            "bwraps": bwraps, "left": left, "alive": zygote.alive,
            "ready": zygote.vm_bytes > 0,
        }}))
        """
    )
    assert len(outcome["bwraps"]) == 1, outcome  # type: ignore[arg-type]
    assert outcome["alive"] is False and outcome["ready"] is False
    # bubblewrap itself is killed and reaped by the cut-short start; the processes
    # inside die with it (their parent-death signal), possibly a moment later.
    assert outcome["bwraps"][0] not in outcome["left"]  # type: ignore[index,operator]


def test_sandboxes_start_run_and_die_in_a_process_with_descriptors_past_1024() -> None:
    # A process with hundreds of sandboxes holds thousands of descriptors. select()
    # refuses any past 1024: waits on a sandbox's pidfd raised (kill() too), and a
    # zygote, whose control socket keeps the host's descriptor number, died.
    outcome = _run(
        f"""
        import json, os, resource
        from sandlot import Sandbox
        from sandlot.backends.bwrap import _zygote

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4096
        if hard != resource.RLIM_INFINITY and hard < want:
            want = hard if os.geteuid() != 0 else want
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        backend = _zygote.ZygoteBackend(preload=("json",))  # started now, past 1024
        forked = Sandbox({TEMPLATE!r}, backend=backend, timeout=60)
        cold = Sandbox({TEMPLATE!r}, backend="bwrap", timeout=60)
        texts = [forked.run_code("6 * 7").text, cold.run_code("6 * 7").text]
        zygote = _zygote.zygotes_for({TEMPLATE!r}, ("json",))[0]
        numbers = [min(held), max(held), zygote._control.fileno()]
        forked.kill()
        cold.kill()
        again = Sandbox({TEMPLATE!r}, backend=backend, timeout=60)
        texts.append(again.run_code("7 * 7").text)
        kind = type(again._core._handle._process).__name__
        again.kill()
        print(json.dumps({{"texts": texts, "numbers": numbers, "forked": kind}}))
        """
    )
    numbers = outcome["numbers"]
    assert isinstance(numbers, list) and numbers[2] > 1024, numbers  # the case, really
    assert outcome["texts"] == ["42", "42", "49"]
    assert outcome["forked"] == "_ForkedSandbox"
