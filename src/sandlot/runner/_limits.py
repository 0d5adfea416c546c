"""Resource limits for the processes that run user code (kernels and commands).

The supervisor itself stays unlimited: it is not running user code, and a
lifetime CPU or address-space limit on it would end a long session for no reason.
Every kernel applies the limits to itself before it runs any cell, and every
command starts through the ``exec`` role, which applies them and then execs the
shell; everything user code starts inherits them.

``check`` runs in the supervisor at start-up: a limit that cannot be applied
(because it exceeds the hard limit the sandbox was started with) stops the
sandbox before it is ready, so sandlot fails closed instead of running unlimited.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any, Dict, List, Tuple

CPU_GRACE = 5
"""Seconds between SIGXCPU (soft limit: reported as a timeout) and SIGKILL (hard)."""

_NAMES = {
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def _pairs(limits: Dict[str, Any]) -> List[Tuple[str, int, int]]:
    pairs = []
    for name, value in sorted(limits.items()):
        if value is None:
            continue
        if name not in _NAMES:
            raise ValueError("unknown resource limit %r" % name)
        soft = int(value)
        hard = soft + CPU_GRACE if name == "cpu" else soft
        pairs.append((name, soft, hard))
    return pairs


def check(limits: Dict[str, Any]) -> None:
    """Raise ValueError if a limit is above what this process could still set."""
    for name, _soft, hard in _pairs(limits):
        current = resource.getrlimit(_NAMES[name])[1]
        if current != resource.RLIM_INFINITY and hard > current:
            raise ValueError(
                "%s limit %d is above the host's hard limit %d" % (name, hard, current)
            )


def apply(limits: Dict[str, Any]) -> None:
    """Set every limit (soft and hard) on the calling process."""
    for name, soft, hard in _pairs(limits):
        resource.setrlimit(_NAMES[name], (soft, hard))


def exec_main(argv: List[str]) -> int:
    """``exec --limits JSON [--ctty] -- PROGRAM ARGS...``: apply the limits, then exec.

    ``--ctty``: stdin is a terminal to make this session's controlling terminal (a
    ``pty``; the process was started in a new session)."""
    import json

    split = argv.index("--")
    limits = json.loads(argv[argv.index("--limits") + 1])
    program = argv[split + 1 :]
    try:
        apply(limits)
    except (OSError, ValueError) as exc:
        sys.stderr.write("sandlot: cannot apply resource limits: %s\n" % exc)
        return 126
    if "--ctty" in argv[:split]:
        import fcntl
        import termios

        try:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        except OSError as exc:
            sys.stderr.write("sandlot: cannot take the terminal: %s\n" % exc)
            return 126
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        sys.stderr.write("sandlot: cannot run %s: %s\n" % (program[0], exc))
        return 127
