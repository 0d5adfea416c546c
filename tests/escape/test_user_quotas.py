"""Per-user kernel quotas are per sandbox: one sandbox cannot use up another's.

The kernel counts some resources per *user*, not per process, cgroup or namespace:
inotify instances (``fs.inotify.max_user_instances``, 128 by default) and POSIX message
queue bytes (``RLIMIT_MSGQUEUE``). Sandboxes that ran as one host uid shared them, so
one sandbox holding every inotify instance made ``inotify_init`` fail in every other
sandbox, running or new, until it was killed. Each test here makes one sandbox take
all it can, then checks that a sandbox started before it and one started after it
still get their own (SECURITY.md, "Per-user kernel quotas").
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from escape_helpers import is_gvisor

from sandlot import Resources, Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

MAX_INSTANCES = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
# Room for every instance the quota allows plus the runner's own descriptors.
RESOURCES = Resources(open_files=MAX_INSTANCES + 256)

SETUP = """
import ctypes, errno, json, os
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mq_open.restype = ctypes.c_int
_libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]

def _inotify():
    fd = _libc.inotify_init1(0)
    return fd, (0 if fd >= 0 else ctypes.get_errno())

class _Attr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_long) for n in ("flags", "maxmsg", "msgsize", "curmsgs")]
    _fields_ += [("reserved", ctypes.c_long * 4)]

def _mq(name):
    # One message of 8 KiB: about 8 KiB against its creator's RLIMIT_MSGQUEUE for as
    # long as the queue exists (the default 819200 bytes fill up before the IPC
    # namespace's 256 queues do).
    attr = _Attr(0, 1, 8192, 0)
    fd = _libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr))
    return fd, (0 if fd >= 0 else ctypes.get_errno())
"""

HOG_INOTIFY = """
_hog = []
for _ in range(%d):
    fd, err = _inotify()
    if fd < 0:
        break
    _hog.append(fd)
print(json.dumps({"held": len(_hog), "stopped_by": errno.errorcode.get(err, err)}))
"""

HOG_MQ = """
_queues = []
for i in range(1000):
    fd, err = _mq("/hog-%d" % i)
    if fd < 0:
        break
    _queues.append(fd)
print(json.dumps({"held": len(_queues), "stopped_by": errno.errorcode.get(err, err)}))
"""

TRY = """
fd, err = _inotify()
q, qerr = _mq("/mine")
print(json.dumps({"inotify": errno.errorcode.get(err, "ok"),
                  "mq": errno.errorcode.get(qerr, "ok")}))
"""


def _json(sbx: Sandbox, code: str) -> Any:
    execution = sbx.run_code(textwrap.dedent(code), timeout=60)
    assert execution.error is None, execution.error
    return json.loads("".join(execution.logs.stdout).strip().splitlines()[-1])


def _shares_a_host_uid(sbx: Sandbox) -> str | None:
    """Why ``sbx`` shares its host uid with other sandboxes, where sandlot documents it."""
    if sbx._core.backend.name == "bwrap" and os.geteuid() != 0:
        return "as an ordinary user, every cold sandbox runs as that user (SECURITY.md)"
    return None


def test_one_sandbox_cannot_use_up_anothers_inotify_and_mq_quota(
    make_sandbox: Callable[..., Sandbox], request: pytest.FixtureRequest
) -> None:
    running = make_sandbox(resources=RESOURCES)
    hog = make_sandbox(resources=RESOURCES)
    reason = _shares_a_host_uid(hog)
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    for sbx in (running, hog):
        _json(sbx, SETUP + "print(1)")
    inotify = _json(hog, HOG_INOTIFY % (MAX_INSTANCES + 1))
    queues = _json(hog, HOG_MQ)
    if not is_gvisor(hog):  # gVisor's own kernel has no per-user limit on either
        # Positive control: the hog really reaches a quota (not some other limit), and
        # is refused one more of each.
        assert inotify["stopped_by"] == "EMFILE", inotify
        assert queues["held"] >= 1 and queues["stopped_by"] == "EMFILE", queues
        assert _json(hog, TRY) == {"inotify": "EMFILE", "mq": "EMFILE"}
    new = make_sandbox(resources=RESOURCES)
    _json(new, SETUP + "print(1)")
    assert _json(running, TRY) == {"inotify": "ok", "mq": "ok"}, "a running sandbox"
    assert _json(new, TRY) == {"inotify": "ok", "mq": "ok"}, "a sandbox started after"
