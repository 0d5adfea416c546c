"""Helpers for tests that look at the host: its processes, and conditions that become
true asynchronously (bounded waits, never sleeps as synchronisation)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WAIT = 120.0
"""Seconds to wait for anything asynchronous; generous, the machine is shared."""


def host_pids(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def eventually(check: Callable[[], bool], what: str, wait: float = WAIT) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.1)
