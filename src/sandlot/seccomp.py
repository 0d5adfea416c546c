"""The sandbox's syscall policy: inert data every backend compiles into its own filter.

The filter allows by default and denies a list, like Docker's default profile, plus
what a code-execution sandbox needs on top of it (io_uring, raw/packet/netlink
sockets, the new mount API). Each entry says why it is denied; SECURITY.md renders
the same list. Nothing here has side effects:

* the bubblewrap backend compiles it with libseccomp into a BPF program that bwrap
  installs before the runner starts (``backends.bwrap._seccomp``);
* a container backend compiles it into an OCI/Docker seccomp profile.

A denied syscall fails with ``EPERM`` (or ``ENOSYS`` where C libraries fall back to
an older call we can inspect, such as ``clone3`` -> ``clone``); the process is not
killed, so well-behaved libraries that probe for a feature keep working.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Literal

# clone(2) flags that create namespaces (linux/sched.h).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NAMESPACE_FLAGS = (
    CLONE_NEWNS
    | CLONE_NEWCGROUP
    | CLONE_NEWUTS
    | CLONE_NEWIPC
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWTIME
)

# Socket address families (linux/socket.h) and types.
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16
AF_PACKET = 17
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF  # the low bits of socket(2)'s type; the rest are SOCK_NONBLOCK etc.
ALLOWED_SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)

TIOCSTI = 0x5412  # ioctl: push a character into a terminal's input queue

# personality(2) flags that weaken exploit mitigations.
ADDR_NO_RANDOMIZE = 0x0040000
READ_IMPLIES_EXEC = 0x0400000


@dataclass(frozen=True, slots=True)
class ArgTest:
    """One comparison of a syscall argument; a denial applies when all of its hold."""

    index: int
    op: Literal["eq", "ge", "masked_eq"]
    value: int
    mask: int = 0
    """For ``masked_eq``: the test is ``(arg & mask) == value``."""


@dataclass(frozen=True, slots=True)
class Denial:
    """One syscall the sandbox may not make: always, or when every test in ``when`` holds."""

    syscall: str
    reason: str
    errno: int = errno.EPERM
    when: tuple[ArgTest, ...] = ()


def _group(names: str, reason: str, err: int = errno.EPERM) -> tuple[Denial, ...]:
    return tuple(Denial(name, reason, err) for name in names.split())


_NAMESPACE_BITS = tuple(1 << i for i in range(32) if NAMESPACE_FLAGS & (1 << i))

DENIED: tuple[Denial, ...] = (
    *_group(
        "mount umount umount2 pivot_root chroot fsopen fsconfig fsmount fspick move_mount "
        "open_tree mount_setattr",
        "mounting file systems would let code reshape or hide its view of the sandbox "
        "and reach kernel file system code rarely exercised unprivileged",
    ),
    *_group(
        "unshare setns",
        "new or joined namespaces (especially user namespaces) expose kernel attack "
        "surface meant for privileged code and could undo the sandbox's isolation",
    ),
    *_group(
        "ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd",
        "inspecting or writing another process's memory or descriptors; the sandbox's "
        "supervisor holds the host channel",
    ),
    *_group(
        "kexec_load kexec_file_load init_module finit_module delete_module create_module "
        "query_module get_kernel_syms",
        "loading kernels or kernel modules",
    ),
    *_group("reboot", "rebooting the host or its kernel state"),
    *_group("swapon swapoff", "changing the host's swap"),
    *_group(
        "keyctl add_key request_key",
        "the kernel keyring is not namespaced: keys could leak between sandboxes and "
        "the keyring code has a history of vulnerabilities",
    ),
    *_group("bpf", "eBPF programs run in the kernel; a long source of privilege escalations"),
    *_group(
        "perf_event_open",
        "performance counters leak information about other processes and the kernel",
    ),
    *_group(
        "userfaultfd",
        "user-space page-fault handling is a common primitive for kernel exploits",
    ),
    *_group(
        "open_by_handle_at name_to_handle_at",
        "file handles bypass path lookup and could open files outside the sandbox's "
        "mounts (the 'shocker' container escape)",
    ),
    *_group(
        "settimeofday clock_settime clock_settime64 clock_adjtime clock_adjtime64 adjtimex stime",
        "the system clock is shared with the host",
    ),
    *_group("acct", "process accounting writes host files"),
    *_group("quotactl quotactl_fd", "disk quotas are host configuration"),
    *_group("iopl ioperm", "direct I/O port access to hardware"),
    *_group(
        "io_uring_setup io_uring_enter io_uring_register",
        "io_uring bypasses syscall filtering for the operations it performs and has had "
        "many privilege-escalation bugs; Python does not use it",
        errno.ENOSYS,
    ),
    *_group(
        "lookup_dcookie nfsservctl uselib ustat sysfs _sysctl vm86 vm86old",
        "obsolete interfaces with no use in a sandbox",
    ),
    *_group("syslog", "the kernel log can reveal host addresses and other tenants' activity"),
    *_group("vhangup", "hanging up a terminal that is not the sandbox's"),
    *_group(
        "sethostname setdomainname",
        "identity of the host (the sandbox has its own UTS namespace regardless)",
    ),
    *_group(
        "mbind set_mempolicy move_pages migrate_pages get_mempolicy",
        "NUMA placement lets code affect memory placement of other workloads",
    ),
    *_group(
        "fanotify_init",
        "file-system-wide event monitoring; with a mount mark it watches the host's files",
    ),
    *_group(
        "clone3",
        "its flags sit in memory a filter cannot read; C libraries fall back to clone, "
        "whose namespace flags are checked",
        errno.ENOSYS,
    ),
    # One rule per flag: the denial must hold when *any* namespace bit is set.
    *(
        Denial(
            "clone",
            "creating namespaces (the flags are argument 0 on x86-64 and arm64)",
            when=(ArgTest(0, "masked_eq", bit, bit),),
        )
        for bit in _NAMESPACE_BITS
    ),
    Denial(
        "ioctl",
        "TIOCSTI pushes keystrokes into a terminal's input (a classic sandbox escape)",
        when=(ArgTest(1, "masked_eq", TIOCSTI, 0xFFFFFFFF),),
    ),
    Denial(
        "personality",
        "ADDR_NO_RANDOMIZE turns off address-space randomisation",
        when=(ArgTest(0, "masked_eq", ADDR_NO_RANDOMIZE, ADDR_NO_RANDOMIZE),),
    ),
    Denial(
        "personality",
        "READ_IMPLIES_EXEC makes readable memory executable",
        when=(ArgTest(0, "masked_eq", READ_IMPLIES_EXEC, READ_IMPLIES_EXEC),),
    ),
    *(
        Denial(
            "socket",
            "raw IP sockets craft arbitrary packets",
            when=(
                ArgTest(0, "eq", family),
                ArgTest(1, "masked_eq", SOCK_RAW, SOCK_TYPE_MASK),
            ),
        )
        for family in (AF_INET, AF_INET6)
    ),
    # Every family but unix, IPv4 and IPv6: netlink (kernel configuration, a large
    # attack surface), packet (raw frames), and the dozens of rarely used protocol
    # families that have been a steady source of kernel bugs.
    *(
        Denial(
            "socket",
            "only unix, IPv4 and IPv6 sockets are allowed (netlink, packet and every "
            "other family are refused)",
            errno.EAFNOSUPPORT,
            when=(ArgTest(0, "eq", family),),
        )
        for family in range(AF_INET6)
        if family not in ALLOWED_SOCKET_FAMILIES
    ),
    Denial(
        "socket",
        "only unix, IPv4 and IPv6 sockets are allowed (netlink, packet and every "
        "other family are refused)",
        errno.EAFNOSUPPORT,
        when=(ArgTest(0, "ge", AF_INET6 + 1),),
    ),
)
"""Every denial, in the order SECURITY.md lists them."""


ZYGOTE_SETUP: frozenset[str] = frozenset({"mount", "unshare", "setns", "sethostname"})
"""Denied in every sandbox, allowed in the zygote (``sandlot.runner._zygote``): it needs
them to give each sandbox it forks fresh namespaces (``setns`` returns it to its own pid
namespace after each), mounts and a hostname. It runs no user code, and every sandbox
installs the full filter on top before any runs."""


def zygote_denials() -> tuple[Denial, ...]:
    """The zygote's own filter: :data:`DENIED` without :data:`ZYGOTE_SETUP`."""
    return tuple(d for d in DENIED if d.syscall not in ZYGOTE_SETUP)


def denied_names() -> frozenset[str]:
    """Syscalls denied outright (whatever their arguments)."""
    return frozenset(d.syscall for d in DENIED if not d.when)


def markdown_table() -> str:
    """The deny list as the table SECURITY.md carries (a unit test keeps them equal)."""
    rows: dict[tuple[str, str], list[str]] = {}
    for denial in DENIED:
        name = denial.syscall
        if denial.when:
            tests = " and ".join(_describe(t) for t in denial.when)
            name = f"{name} ({tests})"
        rows.setdefault((denial.reason, errno.errorcode[denial.errno]), []).append(name)
    lines = ["| Syscalls | Fails with | Why |", "|---|---|---|"]
    for (reason, err), names in rows.items():
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | `{err}` | {reason} |")
    return "\n".join(lines)


def _describe(test: ArgTest) -> str:
    if test.op == "masked_eq":
        if test.mask == test.value:
            return f"arg{test.index} has {test.value:#x}"
        return f"arg{test.index} & {test.mask:#x} == {test.value:#x}"
    symbol = "==" if test.op == "eq" else ">="
    return f"arg{test.index} {symbol} {test.value}"
