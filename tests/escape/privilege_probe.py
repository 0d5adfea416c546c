"""Run inside a sandbox by test_privilege.py: make each refused syscall with ctypes and
print {name: "OK" | errno name} as JSON. Single-threaded on purpose (see the test module)."""

import ctypes
import errno
import json
import os
import platform
import socket
import struct
import subprocess
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86 = {
    "ptrace": 101,
    "mount": 165,
    "umount2": 166,
    "unshare": 272,
    "setns": 308,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "reboot": 169,
    "swapon": 167,
    "acct": 163,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "iopl": 172,
    "ioperm": 173,
    "chroot": 161,
    "pivot_root": 155,
    "syslog": 103,
    "process_vm_readv": 310,
    "kcmp": 312,
    "pidfd_getfd": 438,
    "pidfd_open": 434,
    "fsopen": 430,
    "sethostname": 170,
    "clone3": 435,
    "setuid": 105,
}
ARM = {
    "ptrace": 117,
    "mount": 40,
    "umount2": 39,
    "unshare": 97,
    "setns": 268,
    "keyctl": 219,
    "add_key": 217,
    "request_key": 218,
    "bpf": 280,
    "perf_event_open": 241,
    "userfaultfd": 282,
    "io_uring_setup": 425,
    "kexec_load": 104,
    "kexec_file_load": 294,
    "init_module": 105,
    "finit_module": 273,
    "delete_module": 106,
    "settimeofday": 170,
    "clock_settime": 112,
    "clock_adjtime": 266,
    "reboot": 142,
    "swapon": 224,
    "acct": 89,
    "open_by_handle_at": 265,
    "name_to_handle_at": 264,
    "chroot": 51,
    "pivot_root": 41,
    "syslog": 116,
    "process_vm_readv": 270,
    "kcmp": 272,
    "pidfd_getfd": 438,
    "pidfd_open": 434,
    "fsopen": 430,
    "sethostname": 161,
    "clone3": 435,
    "setuid": 146,
}
NR = {"x86_64": X86, "aarch64": ARM}[platform.machine()]
buf = ctypes.create_string_buffer(4096)
child = subprocess.Popen(["sleep", "60"])
now = int(time.time())
now_tv = struct.pack("qq", now, 0)
now_ts = struct.pack("qq", now, 0)


def call(name, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(
        ctypes.c_long(NR[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    )
    return "OK" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())


def pidfd(pid):
    """A pidfd for ``pid``, or -1 where pidfd_open does not exist (gVisor): the
    pidfd_getfd probe then still asks the kernel, which answers for the call itself."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def sock(family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        return "OK"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, exc.errno)


probes = {
    "ptrace": lambda: call("ptrace", 0x4206, child.pid, 0, 0),  # PTRACE_SEIZE a sibling
    "mount": lambda: call("mount", b"none", b"/tmp", b"tmpfs", 0, 0),
    "umount2": lambda: call("umount2", b"/tmp", 0),
    "unshare": lambda: call("unshare", 0x10000000),
    "setns": lambda: call("setns", os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "keyctl": lambda: call("keyctl", 0, -3, 1),  # KEYCTL_GET_KEYRING_ID, session, create
    "add_key": lambda: call("add_key", b"user", b"sandlot", b"x", 1, -2),
    "request_key": lambda: call("request_key", b"user", b"sandlot-none", 0, 0),
    "bpf": lambda: call("bpf", 0, buf, 72),  # BPF_MAP_CREATE with a zeroed attribute
    "perf_event_open": lambda: call("perf_event_open", buf, 0, -1, -1, 0),
    "userfaultfd": lambda: call("userfaultfd", 1),  # UFFD_USER_MODE_ONLY
    "io_uring_setup": lambda: call("io_uring_setup", 1, buf),
    "kexec_load": lambda: call("kexec_load", 0, 0, 0, 0),
    "kexec_file_load": lambda: call("kexec_file_load", -1, -1, 0, b"", 0),
    "init_module": lambda: call("init_module", buf, 16, b""),
    "finit_module": lambda: call("finit_module", 0, b"", 0),
    "delete_module": lambda: call("delete_module", b"ext4", 0),
    "settimeofday": lambda: call("settimeofday", now_tv, 0),
    "clock_settime": lambda: call("clock_settime", 0, now_ts),
    "clock_adjtime": lambda: call("clock_adjtime", 0, buf),
    # LINUX_REBOOT_CMD_CAD_OFF: harmless even where it is allowed.
    "reboot": lambda: call("reboot", 0xFEE1DEAD, 672274793, 0, 0),
    "swapon": lambda: call("swapon", b"/tmp/swap", 0),
    "acct": lambda: call("acct", b"/tmp/acct"),
    "open_by_handle_at": lambda: call("open_by_handle_at", -100, buf, 0),
    "name_to_handle_at": lambda: call(
        "name_to_handle_at", -100, b"/tmp", buf, ctypes.byref(ctypes.c_int()), 0
    ),
    "iopl": lambda: call("iopl", 3),
    "ioperm": lambda: call("ioperm", 0x80, 1, 1),
    "chroot": lambda: call("chroot", b"/tmp"),
    "pivot_root": lambda: call("pivot_root", b"/tmp", b"/tmp"),
    "syslog": lambda: call("syslog", 3, buf, 4096),
    "process_vm_readv": lambda: call("process_vm_readv", child.pid, buf, 0, buf, 0, 0),
    "kcmp": lambda: call("kcmp", os.getpid(), child.pid, 0, 0, 0),
    "pidfd_getfd": lambda: call("pidfd_getfd", pidfd(child.pid), 0, 0),
    "fsopen": lambda: call("fsopen", b"tmpfs", 0),
    "sethostname": lambda: call("sethostname", b"x", 1),
    "clone3": lambda: call("clone3", 0, 0),
    "setuid": lambda: call("setuid", 0),
    "socket raw": lambda: sock(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    "socket raw6": lambda: sock(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),
    "socket packet": lambda: sock(socket.AF_PACKET, socket.SOCK_RAW, 0),
    "socket netlink": lambda: sock(socket.AF_NETLINK, socket.SOCK_RAW, 0),
}
out = {}
for name, probe in probes.items():
    try:
        out[name] = probe()
    except Exception as exc:
        out[name] = repr(exc)
child.kill()
print(json.dumps(out))
