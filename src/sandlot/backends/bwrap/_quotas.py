"""How sandboxes that draw on one host uid's per-user kernel quotas share them.

The kernel charges inotify instances and watches, message queue bytes and queued
signals to the host uid that owns the outermost user namespace a process is in,
whatever uid it runs as inside. Sandboxes that share such an owner each get a fixed
share instead: the forks of one zygote (its uid), and checkpointable sandboxes (their
user namespaces are root's, :mod:`._persist`). A share is a user namespace's
``/proc/sys/user`` limits (which the kernel checks at every level) and rlimits
(``RLIMIT_MSGQUEUE`` and ``RLIMIT_SIGPENDING``, counted per user namespace and uid).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

INOTIFY_SHARE = 8
"""inotify instances each forked sandbox may hold (of ``fs.inotify.max_user_instances``,
128 by default, per host uid): it sizes the shares, and so how many sandboxes one zygote
forks at a time (15 by default, one share kept back). Data work rarely watches files."""
DEFAULT_RLIMITS = {"msgqueue": 819200, "sigpending": 4096}
"""Per-sandbox values where this process's own limit is unlimited (the kernel's defaults
for ``RLIMIT_MSGQUEUE``; a modest number of queued signals)."""
RLIMIT_BY_NAME = {"msgqueue": resource.RLIMIT_MSGQUEUE, "sigpending": resource.RLIMIT_SIGPENDING}


@dataclass(frozen=True)
class Shares:
    """How a zygote splits its host uid's per-user quotas between the sandboxes it forks."""

    sandboxes: int
    """Live forked sandboxes at most (one more share is kept back)."""
    user: dict[str, int]
    """``/proc/sys/user`` limits of each sandbox's own user namespace."""
    rlimits: dict[str, int]
    """Each sandbox's soft and hard rlimits."""
    zygote_rlimits: tuple[tuple[int, int], ...]
    """The zygote's own rlimits (as root: room for every share; else unchanged)."""

    def request(self) -> dict[str, dict[str, int]]:
        return {"user": self.user, "rlimits": self.rlimits}


def shares(raise_limits: bool) -> Shares:
    """The shares of this host's per-user quotas, one per forked sandbox and one kept.

    inotify limits are host-wide per uid (sysctls), so they are divided. rlimits are
    divided too, unless this process may raise hard limits (``raise_limits``: root
    with CAP_SYS_RESOURCE, which containers usually drop): then the zygote's own
    limits are raised instead, so each sandbox gets what a cold one would."""
    instances = _sysctl_int("fs/inotify/max_user_instances", 128)
    watches = _sysctl_int("fs/inotify/max_user_watches", 8192)
    slots = max(2, instances // INOTIFY_SHARE)
    user = {
        "max_inotify_instances": instances // slots,
        "max_inotify_watches": watches // slots,
        "max_user_namespaces": 0,
    }
    rlimits: dict[str, int] = {}
    zygote: list[tuple[int, int]] = []
    for name, which in RLIMIT_BY_NAME.items():
        soft, hard = resource.getrlimit(which)
        if raise_limits:
            each = DEFAULT_RLIMITS[name] if soft == resource.RLIM_INFINITY else soft
            zygote.append((which, each * slots))
        else:
            whole = DEFAULT_RLIMITS[name] * slots if hard == resource.RLIM_INFINITY else hard
            each = whole // slots
        rlimits[name] = each
    return Shares(slots - 1, user, rlimits, tuple(zygote))


def can_raise_limits() -> bool:
    """Root with CAP_SYS_RESOURCE (bit 24 of the effective set)."""
    if os.geteuid() != 0:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def _sysctl_int(name: str, default: int) -> int:
    try:
        return int(Path("/proc/sys", name).read_text())
    except (OSError, ValueError):
        return default
