"""Privilege escapes: capabilities, setuid, and the syscalls a sandbox must not make.

Each syscall is made for real from inside the sandbox with ctypes (``libc.syscall``), in a
fresh single-threaded process (some calls, like ``unshare(CLONE_NEWUSER)``, refuse
multi-threaded callers for reasons of their own), and must be refused. Two layers refuse
them: the sandbox holds no capabilities in its user namespace, and the seccomp filter
(``sandlot.seccomp``) denies each call outright. ``LAYERS`` says which layer the test
proves; checked by hand with the seccomp filter removed, every "seccomp" entry succeeded
(or failed past the filter, e.g. EINVAL from the call itself) and its test failed.
"""

from __future__ import annotations

import errno
import json
import signal
from pathlib import Path

import pytest
from escape_helpers import (
    HostProcess,
    alive,
    cell_json,
    container_view,
    host_processes,
    is_container,
    is_gvisor,
    is_vm,
    parent_and_state,
    xfail_under_gvisor,
)

from sandlot import Sandbox

pytestmark = [
    pytest.mark.requires_bwrap,
    pytest.mark.requires_template,
    pytest.mark.all_backends,
    pytest.mark.local_only,
]

PROBES = (Path(__file__).parent / "privilege_probe.py").read_text()

EPERM = {errno.EPERM}
EXPECTED: dict[str, tuple[set[int], str]] = {
    # name: (accepted errnos, the layer that refuses it)
    "ptrace": (EPERM, "seccomp (a same-uid sibling is otherwise traceable)"),
    "process_vm_readv": (EPERM, "seccomp (same-uid memory reads are otherwise allowed)"),
    "kcmp": (EPERM, "seccomp"),
    "pidfd_getfd": (EPERM, "seccomp (a sibling's descriptors are otherwise takeable)"),
    "mount": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "umount2": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "fsopen": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "chroot": (EPERM, "no CAP_SYS_CHROOT, and seccomp"),
    "pivot_root": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "unshare": (EPERM, "seccomp, and bwrap --disable-userns"),
    "setns": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "clone3": ({errno.ENOSYS}, "seccomp (so libc falls back to clone, whose flags are checked)"),
    "keyctl": (EPERM, "seccomp (the keyring is not namespaced)"),
    "add_key": (EPERM, "seccomp"),
    "request_key": (EPERM, "seccomp"),
    "bpf": (EPERM, "seccomp"),
    "perf_event_open": (EPERM, "seccomp (perf_event_paranoid otherwise answers EACCES)"),
    "userfaultfd": (EPERM, "seccomp (user-mode userfaultfd is otherwise allowed)"),
    "io_uring_setup": ({errno.ENOSYS}, "seccomp"),
    "kexec_load": (EPERM, "no CAP_SYS_BOOT, and seccomp"),
    "kexec_file_load": (EPERM, "no CAP_SYS_BOOT, and seccomp"),
    "init_module": (EPERM, "no CAP_SYS_MODULE, and seccomp"),
    "finit_module": (EPERM, "no CAP_SYS_MODULE, and seccomp"),
    "delete_module": (EPERM, "no CAP_SYS_MODULE, and seccomp"),
    "reboot": (EPERM, "no CAP_SYS_BOOT, and seccomp"),
    "swapon": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "acct": (EPERM, "no CAP_SYS_PACCT, and seccomp"),
    "settimeofday": (EPERM, "no CAP_SYS_TIME, and seccomp"),
    "clock_settime": (EPERM, "no CAP_SYS_TIME, and seccomp"),
    "clock_adjtime": (EPERM, "no CAP_SYS_TIME, and seccomp"),
    "open_by_handle_at": (EPERM, "no CAP_DAC_READ_SEARCH, and seccomp"),
    "name_to_handle_at": (EPERM, "seccomp"),
    "iopl": (EPERM, "no CAP_SYS_RAWIO, and seccomp"),
    "ioperm": (EPERM, "no CAP_SYS_RAWIO, and seccomp"),
    "syslog": (EPERM, "dmesg_restrict, and seccomp"),
    "sethostname": (EPERM, "no CAP_SYS_ADMIN, and seccomp"),
    "setuid": ({errno.EPERM, errno.EINVAL}, "uid 0 is not mapped in the user namespace"),
    "socket raw": (EPERM, "no CAP_NET_RAW, and seccomp"),
    "socket raw6": (EPERM, "no CAP_NET_RAW, and seccomp"),
    "socket packet": ({errno.EPERM, errno.EAFNOSUPPORT}, "no CAP_NET_RAW, and seccomp"),
    "socket netlink": ({errno.EAFNOSUPPORT}, "seccomp"),
}


@pytest.fixture(scope="module")
def probed(sandbox: Sandbox) -> dict[str, object]:
    """Every probe's outcome ("OK" or an errno name), from one process in the sandbox."""
    sandbox.files.write("/tmp/privilege_probe.py", PROBES)
    command = sandbox.commands.run("python3 /tmp/privilege_probe.py", timeout=60)
    assert command.exit_code == 0, command.stderr
    outcome: dict[str, object] = json.loads(command.stdout)
    return outcome


def test_every_probe_ran(probed: dict[str, object]) -> None:
    assert set(probed) == set(EXPECTED)


GVISOR_ALSO: dict[str, tuple[int, str]] = {
    # gVisor (runsc 20221219) does not implement pidfd_getfd: ENOSYS, not seccomp's EPERM.
    "pidfd_getfd": (errno.ENOSYS, "not implemented by gVisor"),
    # The profile's rule asks for EAFNOSUPPORT; under runsc the call fails with EPERM.
    "socket netlink": (errno.EPERM, "seccomp, as runsc applies it"),
}
"""Other refusals that hold under gVisor, where the sandbox's syscalls reach gVisor's
kernel (the Sentry), not the host's."""


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_syscall_is_refused(probed: dict[str, object], name: str, sandbox: Sandbox) -> None:
    accepted, layer = EXPECTED[name]
    if is_gvisor(sandbox) and name in GVISOR_ALSO:
        also, why = GVISOR_ALSO[name]
        accepted, layer = accepted | {also}, f"{layer}; gVisor: {why}"
    names = {errno.errorcode[code] for code in accepted}
    assert probed[name] in names, f"{name}: got {probed[name]}, want {names} ({layer})"


def test_unprivileged_inside(sandbox: Sandbox) -> None:
    status = cell_json(
        sandbox,
        """
import ctypes, json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
libc = ctypes.CDLL(None, use_errno=True)
print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
                  "groups": os.getgroups(),
                  "no_new_privs": libc.prctl(39, 0, 0, 0, 0),  # PR_GET_NO_NEW_PRIVS
                  **{k: status[k].split() for k in ("Uid", "Gid", "CapEff", "CapPrm",
                                                     "CapInh", "CapAmb", "NoNewPrivs")
                     if k in status}}))
""",
    )
    assert status["uid"] != 0 and status["euid"] != 0 and status["gid"] != 0
    assert 0 not in status["groups"]
    assert "0" not in status["Uid"] and "0" not in status["Gid"]
    capability_sets = ["CapEff", "CapPrm", "CapInh", "CapAmb"]
    if is_gvisor(sandbox):
        # gVisor has no ambient capabilities (no CapAmb line; PR_CAP_AMBIENT is EINVAL);
        # they could only be a subset of CapPrm and CapInh, both checked empty here.
        capability_sets.remove("CapAmb")
    for capabilities in capability_sets:
        assert int(status[capabilities][0], 16) == 0, (capabilities, status[capabilities])
    assert status["no_new_privs"] == 1
    if not is_gvisor(sandbox):  # gVisor's /proc/self/status has no NoNewPrivs line
        assert status["NoNewPrivs"] == ["1"]
    shell = sandbox.commands.run("id -u; grep CapEff /proc/self/status")
    assert shell.stdout.split()[0] != "0"
    assert shell.stdout.split()[-1] == "0000000000000000"


def test_setuid_binaries_grant_nothing(sandbox: Sandbox) -> None:
    # Proves: setuid and setgid bits have no effect inside (no_new_privs, nosuid mounts,
    # and no host uid 0 to become). Would fail if the sandbox ran without
    # PR_SET_NO_NEW_PRIVS on mounts without nosuid, where su and mount gain privilege.
    # A container's root is one overlay the engine cannot mount nosuid: there, the image
    # has no setuid or setgid bit left at all (cleared when the template image is built;
    # checked by hand: without that, su, mount, passwd... keep theirs).
    if is_container(sandbox):
        found = sandbox.commands.run("find / -xdev -perm /6000 2>/dev/null").stdout.split()
        assert found == [], found
        assert sandbox.commands.run("command -v su mount").exit_code == 0  # control: there
    else:
        found = sandbox.commands.run("find /usr -xdev -perm /6000 -type f 2>/dev/null").stdout
        assert found.split(), "no setuid/setgid binaries to try (the host's /usr has su, mount)"
    outcome = cell_json(
        sandbox,
        """
import ctypes, json, os, subprocess
outcome = {"mounts": [line.split()[4] + " " + line.split()[5]
                       for line in open("/proc/self/mountinfo")],
            "nnp": ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)}  # PR_GET_NO_NEW_PRIVS
runs = {}
for argv in (["su", "-c", "id -u", "root"], ["mount", "-t", "tmpfs", "none", "/tmp"],
             ["newgrp", "root"], ["chsh", "-s", "/bin/sh", "root"]):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10,
                              stdin=subprocess.DEVNULL)
        runs[argv[0]] = [done.returncode, done.stdout.strip()]
    except (OSError, subprocess.TimeoutExpired) as exc:
        runs[argv[0]] = [None, repr(exc)]
outcome["runs"] = runs
outcome["euid"] = os.geteuid()
print(json.dumps(outcome))
""",
    )
    assert outcome["nnp"] == 1
    if not is_container(sandbox):
        usr_mounts = [m for m in outcome["mounts"] if m.startswith("/usr ")]
        assert usr_mounts and all("nosuid" in m for m in usr_mounts), outcome["mounts"]
    for name, (code, stdout) in outcome["runs"].items():
        assert code != 0 and stdout != "0", (name, code, stdout)
    assert outcome["euid"] != 0


def test_cannot_create_namespaces_or_mount(sandbox: Sandbox) -> None:
    outcome = cell_json(
        sandbox,
        """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
outcome = {}
flags = {"user": 0x10000000, "mount": 0x00020000, "net": 0x40000000, "pid": 0x20000000,
         "user+mount": 0x10020000}
for name, flag in flags.items():
    rc = libc.unshare(flag)
    outcome["unshare " + name] = "OK" if rc == 0 else ctypes.get_errno()
if hasattr(os, "unshare"):
    try:
        os.unshare(os.CLONE_NEWUSER)
        outcome["os.unshare"] = "OK"
    except OSError as exc:
        outcome["os.unshare"] = exc.errno
os.makedirs("/tmp/mnt", exist_ok=True)
rc = libc.mount(b"none", b"/tmp/mnt", b"tmpfs", 0, None)
outcome["mount tmpfs"] = "OK" if rc == 0 else ctypes.get_errno()
rc = libc.mount(b"/usr", b"/tmp/mnt", None, 0x1000, None)  # MS_BIND
outcome["bind mount"] = "OK" if rc == 0 else ctypes.get_errno()
rc = libc.mount(None, b"/", None, 0x20 | 0x1000, None)  # MS_REMOUNT | MS_BIND (read-write)
outcome["remount / rw"] = "OK" if rc == 0 else ctypes.get_errno()
rc = libc.chroot(b"/tmp")
outcome["chroot"] = "OK" if rc == 0 else ctypes.get_errno()
print(json.dumps(outcome))
""",
    )
    assert "OK" not in outcome.values(), outcome
    assert len(outcome) >= 9
    commands = {
        "unshare -U true": "unshare -U true",
        "unshare -r true": "unshare -r true",
        "unshare -m true": "unshare -m true",
        "mount": "mkdir -p /tmp/m2 && mount -t tmpfs none /tmp/m2",
    }
    has_unshare = sandbox.commands.run("command -v unshare").exit_code == 0
    for label, cmd in commands.items():
        if label.startswith("unshare") and not has_unshare:
            continue
        result = sandbox.commands.run(cmd)
        assert result.exit_code != 0, (label, result)


def _host_supervisor(bwrap: int) -> HostProcess:
    """The supervisor as the host sees it: bwrap's only child (it is pid 1 inside), or
    the sandbox's outermost process itself when it was forked from a zygote."""
    if b"supervisor" in Path(f"/proc/{bwrap}/cmdline").read_bytes().split(b"\0"):
        return bwrap, host_processes()[bwrap][1]
    children = [(pid, start) for pid, (ppid, start, _) in host_processes().items() if ppid == bwrap]
    assert len(children) == 1, children
    [(pid, start)] = children
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"supervisor" in cmdline, cmdline
    return pid, start


SIGNAL_PID_1 = """
import json, os, signal, subprocess, time
assert os.getppid() == 1  # the kernel's parent is the supervisor, the sandbox's init
sent = []
for signum in sorted(signal.valid_signals()):
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        continue  # last, below
    os.kill(1, signum)
    sent.append(int(signum))
os.kill(1, signal.SIGSTOP)
os.kill(1, signal.SIGKILL)
shell = subprocess.run(["sh", "-c", "kill -STOP 1 && kill -9 1 && echo sent"],
                       capture_output=True, text=True)
time.sleep(0.5)  # a delivered signal would have taken effect by now
state = open("/proc/1/stat").read().rsplit(")", 1)[1].split()[0]
print(json.dumps({"sent": sent, "shell": shell.stdout, "state": state}))
"""


def test_user_code_cannot_signal_the_supervisor(
    fresh_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    # The supervisor is pid 1 of the sandbox's pid namespace and leaves every signal at
    # SIG_DFL: the kernel drops them all, SIGKILL and SIGSTOP included, when they come
    # from inside. Only the host (from outside the namespace) can end it.
    xfail_under_gvisor(
        fresh_sandbox,
        request,
        "gVisor (runsc 20221219) delivers SIGKILL from inside the sandbox to "
        "its pid 1: code can end its own sandbox (SandboxLost; a fresh one starts on "
        "the next call). See docs/docker.md",
    )
    fresh_sandbox.files.write("before.txt", "x")
    if is_container(fresh_sandbox):
        # The container's first process is the supervisor (no engine init); its host
        # parent is the engine's (containerd-shim, conmon), which must not change.
        pid = container_view(fresh_sandbox).init_pid()
        supervisor: HostProcess = (pid, host_processes()[pid][1])
        outside = parent_and_state(pid)[0]
    else:
        outside = fresh_sandbox._core._handle._process.pid  # type: ignore[union-attr, attr-defined]
        # A VM's pid 1 is the guest's: the host sees only QEMU, which must live on.
        supervisor = (
            (outside, host_processes()[outside][1])
            if is_vm(fresh_sandbox)
            else _host_supervisor(outside)
        )
    report = cell_json(fresh_sandbox, SIGNAL_PID_1)
    assert signal.SIGINT in report["sent"] and signal.SIGTERM in report["sent"]  # control
    assert report["shell"] == "sent\n"  # control: the shell's kills were accepted
    assert report["state"] not in ("T", "t", "Z", "X"), report
    # Host side: the same supervisor process, running, not stopped.
    assert alive({supervisor}) == {supervisor}
    parent, state = parent_and_state(supervisor[0])
    assert supervisor[0] == outside or parent == outside  # zygote: it is the outermost
    assert state not in ("T", "t"), "the supervisor was stopped"
    # Through commands.run too.
    assert fresh_sandbox.commands.run("kill -STOP 1; kill -9 1; sleep 0.3").exit_code == 0
    assert parent_and_state(supervisor[0])[1] not in ("T", "t"), "the supervisor was stopped"
    # It still serves: same sandbox, same files, no restart.
    assert fresh_sandbox.run_code("1 + 1").text == "2"
    assert fresh_sandbox.files.read("before.txt") == "x"
    assert fresh_sandbox._core.restarts == 0
    assert alive({supervisor}) == {supervisor}


STEAL_CHANNEL = """
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
supervisor = os.getppid()
argv = open("/proc/%d/cmdline" % supervisor, "rb").read().split(b"\\0")
# bwrap: an inherited socket (--fd N); containers (--stdio): stdout, the attach stream
channel_fd = int(argv[argv.index(b"--fd") + 1]) if b"--fd" in argv else 1
report = {"supervisor": supervisor, "fd": channel_fd}
ctypes.set_errno(0)
pidfd = libc.syscall(434, supervisor, 0)  # pidfd_open
report["pidfd_open"] = -ctypes.get_errno() if pidfd < 0 else "ok"
ctypes.set_errno(0)
stolen = libc.syscall(438, pidfd, channel_fd, 0) if pidfd >= 0 else -1  # pidfd_getfd
report["pidfd_getfd"] = ctypes.get_errno() if stolen < 0 else "stolen"
# Control: the same call on this process's own descriptors works.
own = libc.syscall(434, os.getpid(), 0)
copy = libc.syscall(438, own, 1, 0) if own >= 0 else -1
report["own_getfd"] = "ok" if copy >= 0 else ctypes.get_errno()
for path in ("/proc/1/fd/%d" % channel_fd, "/proc/1/environ", "/proc/1/mem"):
    try:
        os.close(os.open(path, os.O_RDONLY))
        report[path] = "opened"
    except OSError as exc:
        report[path] = exc.errno
try:
    report["readlink"] = os.readlink("/proc/1/fd/%d" % channel_fd)
except OSError as exc:
    report["readlink"] = exc.errno
ctypes.set_errno(0)
attached = libc.ptrace(16, supervisor, None, None)  # PTRACE_ATTACH
report["ptrace_attach"] = ctypes.get_errno() if attached != 0 else "attached"
if attached == 0:
    libc.ptrace(17, supervisor, None, None)  # PTRACE_DETACH
print(json.dumps(report), flush=True)
"""


def test_the_host_channel_cannot_be_stolen(
    fresh_sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    # Two layers. seccomp refuses pidfd_getfd and ptrace outright (even on the caller's
    # own process). Under it, the supervisor is not dumpable (PR_SET_DUMPABLE 0): user
    # code with the same uid can neither reach the channel through /proc/1/fd, nor read
    # its environment or memory, which no syscall filter could tell apart from an
    # ordinary open().
    xfail_under_gvisor(
        fresh_sandbox,
        request,
        "gVisor (runsc 20221219) ignores the supervisor's PR_SET_DUMPABLE 0 for "
        "/proc/1/fd and /proc/1/environ: same-uid code can open the supervisor's "
        "stdin/stdout, the host channel (the host still validates and caps every "
        "message; /proc/1/mem and ptrace stay refused). See docs/docker.md",
    )
    fresh_sandbox.files.write("before.txt", "x")
    report = cell_json(fresh_sandbox, STEAL_CHANNEL)
    assert report["supervisor"] == 1
    # seccomp refuses it even on the caller itself; a VM has no seccomp filter (its
    # guest kernel is the sandbox's own), so there only the non-dumpable layer holds.
    assert report["own_getfd"] == ("ok" if is_vm(fresh_sandbox) else errno.EPERM), report
    assert report["pidfd_open"] == "ok", report  # a pidfd alone grants nothing
    assert report["pidfd_getfd"] == errno.EPERM, report
    assert report[f"/proc/1/fd/{report['fd']}"] in (errno.EACCES, errno.EPERM), report
    assert report["readlink"] in (errno.EACCES, errno.EPERM), report
    assert report["/proc/1/environ"] in (errno.EACCES, errno.EPERM), report
    assert report["/proc/1/mem"] in (errno.EACCES, errno.EPERM), report
    assert report["ptrace_attach"] == errno.EPERM, report
    # Nothing happened to the sandbox: same files, still serving.
    assert fresh_sandbox.run_code("1 + 1").text == "2"
    assert fresh_sandbox.files.read("before.txt") == "x"
    assert fresh_sandbox._core.restarts == 0
