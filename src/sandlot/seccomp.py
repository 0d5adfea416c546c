"""The sandbox's syscall policy: inert data every backend compiles into its own filter.

The filter is an allowlist. sandlot ships the system call table of each architecture
it supports (:data:`SYSCALL_NUMBERS`: x86-64 and arm64, every call up to
:data:`REVIEWED_THROUGH`); a call in that table is allowed unless :data:`DENIED` refuses
it (always, or for some arguments), and every other number fails with ``ENOSYS``, so a
kernel newer than the policy adds nothing a sandbox can call. The deny list covers
Docker's default profile plus what a code-execution sandbox needs on top of it
(io_uring, raw/packet/netlink sockets, the new mount API); each entry says why, and
SECURITY.md renders the same list. Nothing here has side effects:

* the bubblewrap backend compiles :func:`filter_rules` with libseccomp into a BPF
  program that bwrap installs before the runner starts (``backends.bwrap._seccomp``);
* a container backend compiles it into an OCI/Docker seccomp profile.

A denied syscall fails with ``EPERM`` (or ``ENOSYS`` where C libraries fall back to
an older call we can inspect, such as ``clone3`` -> ``clone``, or where the call is new
and callers treat it as missing); the process is not killed, so well-behaved libraries
that probe for a feature keep working.

Numbers come from the policy's own table, never from libseccomp's: a name libseccomp
does not know (it lags the kernel) is still resolved, and a denial naming a call no
table has (a misspelling would leave the real call allowed) stops the filter from
being built (:class:`~sandlot._exceptions.PolicyError`).
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from sandlot._exceptions import PolicyError

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


# --- the reviewed system call tables ----------------------------------------------------

REVIEWED_THROUGH = "Linux 6.19"
"""The newest kernel whose system calls every table below lists, each one reviewed: it
is either allowed or in :data:`DENIED`. Calls a later kernel adds fail with
:data:`UNREVIEWED_ERRNO` until they are reviewed here."""

UNREVIEWED_ERRNO = errno.ENOSYS
"""What a call outside the table fails with: what an older kernel answers, which C
libraries and Python already handle (glibc falls back from ``faccessat2``, ``clone3``,
``fchmodat2``... to the older call)."""

AUDIT_ARCH: Mapping[str, int] = MappingProxyType({"x86_64": 0xC000003E, "aarch64": 0xC00000B7})
"""The architectures the policy covers, with the value seccomp filters see in
``seccomp_data.arch`` (linux/audit.h). A call made through another ABI (i386 ``int
0x80``, x32, arm32) kills the process: its numbers mean other calls."""


def _table(text: str) -> Mapping[str, int]:
    """Parse a table: each line is a number and the names of the calls numbered from it
    on, ``-`` for an unassigned number (five a line, as in the kernel's own tables)."""
    numbers: dict[str, int] = {}
    for line in text.strip().splitlines():
        first, *names = line.split()
        for offset, name in enumerate(names):
            if name != "-":
                numbers[name] = int(first) + offset
    return MappingProxyType(numbers)


# From the kernel's arch/x86/entry/syscalls/syscall_64.tbl (the 64-bit and common ABIs;
# the x32 numbers, 512 and up plus bit 30, are another ABI and kill the process).
# Numbers whose kernel entry is sys_ni_syscall (create_module, tuxcall, vserver...) are
# listed: the kernel answers ENOSYS for them itself. uretprobe and uprobe (335, 336) are
# allowed: the kernel lets them past every seccomp filter anyway, and they do nothing
# unless called from the return trampolines of uprobes the host attached.
_X86_64 = """
0 read write open close stat
5 fstat lstat poll lseek mmap
10 mprotect munmap brk rt_sigaction rt_sigprocmask
15 rt_sigreturn ioctl pread64 pwrite64 readv
20 writev access pipe select sched_yield
25 mremap msync mincore madvise shmget
30 shmat shmctl dup dup2 pause
35 nanosleep getitimer alarm setitimer getpid
40 sendfile socket connect accept sendto
45 recvfrom sendmsg recvmsg shutdown bind
50 listen getsockname getpeername socketpair setsockopt
55 getsockopt clone fork vfork execve
60 exit wait4 kill uname semget
65 semop semctl shmdt msgget msgsnd
70 msgrcv msgctl fcntl flock fsync
75 fdatasync truncate ftruncate getdents getcwd
80 chdir fchdir rename mkdir rmdir
85 creat link unlink symlink readlink
90 chmod fchmod chown fchown lchown
95 umask gettimeofday getrlimit getrusage sysinfo
100 times ptrace getuid syslog getgid
105 setuid setgid geteuid getegid setpgid
110 getppid getpgrp setsid setreuid setregid
115 getgroups setgroups setresuid getresuid setresgid
120 getresgid getpgid setfsuid setfsgid getsid
125 capget capset rt_sigpending rt_sigtimedwait rt_sigqueueinfo
130 rt_sigsuspend sigaltstack utime mknod uselib
135 personality ustat statfs fstatfs sysfs
140 getpriority setpriority sched_setparam sched_getparam sched_setscheduler
145 sched_getscheduler sched_get_priority_max sched_get_priority_min sched_rr_get_interval mlock
150 munlock mlockall munlockall vhangup modify_ldt
155 pivot_root _sysctl prctl arch_prctl adjtimex
160 setrlimit chroot sync acct settimeofday
165 mount umount2 swapon swapoff reboot
170 sethostname setdomainname iopl ioperm create_module
175 init_module delete_module get_kernel_syms query_module quotactl
180 nfsservctl getpmsg putpmsg afs_syscall tuxcall
185 security gettid readahead setxattr lsetxattr
190 fsetxattr getxattr lgetxattr fgetxattr listxattr
195 llistxattr flistxattr removexattr lremovexattr fremovexattr
200 tkill time futex sched_setaffinity sched_getaffinity
205 set_thread_area io_setup io_destroy io_getevents io_submit
210 io_cancel get_thread_area lookup_dcookie epoll_create epoll_ctl_old
215 epoll_wait_old remap_file_pages getdents64 set_tid_address restart_syscall
220 semtimedop fadvise64 timer_create timer_settime timer_gettime
225 timer_getoverrun timer_delete clock_settime clock_gettime clock_getres
230 clock_nanosleep exit_group epoll_wait epoll_ctl tgkill
235 utimes vserver mbind set_mempolicy get_mempolicy
240 mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify
245 mq_getsetattr kexec_load waitid add_key request_key
250 keyctl ioprio_set ioprio_get inotify_init inotify_add_watch
255 inotify_rm_watch migrate_pages openat mkdirat mknodat
260 fchownat futimesat newfstatat unlinkat renameat
265 linkat symlinkat readlinkat fchmodat faccessat
270 pselect6 ppoll unshare set_robust_list get_robust_list
275 splice tee sync_file_range vmsplice move_pages
280 utimensat epoll_pwait signalfd timerfd_create eventfd
285 fallocate timerfd_settime timerfd_gettime accept4 signalfd4
290 eventfd2 epoll_create1 dup3 pipe2 inotify_init1
295 preadv pwritev rt_tgsigqueueinfo perf_event_open recvmmsg
300 fanotify_init fanotify_mark prlimit64 name_to_handle_at open_by_handle_at
305 clock_adjtime syncfs sendmmsg setns getcpu
310 process_vm_readv process_vm_writev kcmp finit_module sched_setattr
315 sched_getattr renameat2 seccomp getrandom memfd_create
320 kexec_file_load bpf execveat userfaultfd membarrier
325 mlock2 copy_file_range preadv2 pwritev2 pkey_mprotect
330 pkey_alloc pkey_free statx io_pgetevents rseq
335 uretprobe uprobe - - -
420 - - - - pidfd_send_signal
425 io_uring_setup io_uring_enter io_uring_register open_tree move_mount
430 fsopen fsconfig fsmount fspick pidfd_open
435 clone3 close_range openat2 pidfd_getfd faccessat2
440 process_madvise epoll_pwait2 mount_setattr quotactl_fd landlock_create_ruleset
445 landlock_add_rule landlock_restrict_self memfd_secret process_mrelease futex_waitv
450 set_mempolicy_home_node cachestat fchmodat2 map_shadow_stack futex_wake
455 futex_wait futex_requeue statmount listmount lsm_get_self_attr
460 lsm_set_self_attr lsm_list_modules mseal setxattrat getxattrat
465 listxattrat removexattrat open_tree_attr file_getattr file_setattr
470 listns
"""

# From the kernel's scripts/syscall.tbl with arm64's ABIs (common, 64, renameat, rlimit,
# memfd_secret). 244-259 are reserved for architecture-specific calls, none on arm64.
_AARCH64 = """
0 io_setup io_destroy io_submit io_cancel io_getevents
5 setxattr lsetxattr fsetxattr getxattr lgetxattr
10 fgetxattr listxattr llistxattr flistxattr removexattr
15 lremovexattr fremovexattr getcwd lookup_dcookie eventfd2
20 epoll_create1 epoll_ctl epoll_pwait dup dup3
25 fcntl inotify_init1 inotify_add_watch inotify_rm_watch ioctl
30 ioprio_set ioprio_get flock mknodat mkdirat
35 unlinkat symlinkat linkat renameat umount2
40 mount pivot_root nfsservctl statfs fstatfs
45 truncate ftruncate fallocate faccessat chdir
50 fchdir chroot fchmod fchmodat fchownat
55 fchown openat close vhangup pipe2
60 quotactl getdents64 lseek read write
65 readv writev pread64 pwrite64 preadv
70 pwritev sendfile pselect6 ppoll signalfd4
75 vmsplice splice tee readlinkat newfstatat
80 fstat sync fsync fdatasync sync_file_range
85 timerfd_create timerfd_settime timerfd_gettime utimensat acct
90 capget capset personality exit exit_group
95 waitid set_tid_address unshare futex set_robust_list
100 get_robust_list nanosleep getitimer setitimer kexec_load
105 init_module delete_module timer_create timer_gettime timer_getoverrun
110 timer_settime timer_delete clock_settime clock_gettime clock_getres
115 clock_nanosleep syslog ptrace sched_setparam sched_setscheduler
120 sched_getscheduler sched_getparam sched_setaffinity sched_getaffinity sched_yield
125 sched_get_priority_max sched_get_priority_min sched_rr_get_interval restart_syscall kill
130 tkill tgkill sigaltstack rt_sigsuspend rt_sigaction
135 rt_sigprocmask rt_sigpending rt_sigtimedwait rt_sigqueueinfo rt_sigreturn
140 setpriority getpriority reboot setregid setgid
145 setreuid setuid setresuid getresuid setresgid
150 getresgid setfsuid setfsgid times setpgid
155 getpgid getsid setsid getgroups setgroups
160 uname sethostname setdomainname getrlimit setrlimit
165 getrusage umask prctl getcpu gettimeofday
170 settimeofday adjtimex getpid getppid getuid
175 geteuid getgid getegid gettid sysinfo
180 mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify
185 mq_getsetattr msgget msgctl msgrcv msgsnd
190 semget semctl semtimedop semop shmget
195 shmctl shmat shmdt socket socketpair
200 bind listen accept connect getsockname
205 getpeername sendto recvfrom setsockopt getsockopt
210 shutdown sendmsg recvmsg readahead brk
215 munmap mremap add_key request_key keyctl
220 clone execve mmap fadvise64 swapon
225 swapoff mprotect msync mlock munlock
230 mlockall munlockall mincore madvise remap_file_pages
235 mbind get_mempolicy set_mempolicy migrate_pages move_pages
240 rt_tgsigqueueinfo perf_event_open accept4 recvmmsg -
260 wait4 prlimit64 fanotify_init fanotify_mark name_to_handle_at
265 open_by_handle_at clock_adjtime syncfs setns sendmmsg
270 process_vm_readv process_vm_writev kcmp finit_module sched_setattr
275 sched_getattr renameat2 seccomp getrandom memfd_create
280 bpf execveat userfaultfd membarrier mlock2
285 copy_file_range preadv2 pwritev2 pkey_mprotect pkey_alloc
290 pkey_free statx io_pgetevents rseq kexec_file_load
420 - - - - pidfd_send_signal
425 io_uring_setup io_uring_enter io_uring_register open_tree move_mount
430 fsopen fsconfig fsmount fspick pidfd_open
435 clone3 close_range openat2 pidfd_getfd faccessat2
440 process_madvise epoll_pwait2 mount_setattr quotactl_fd landlock_create_ruleset
445 landlock_add_rule landlock_restrict_self memfd_secret process_mrelease futex_waitv
450 set_mempolicy_home_node cachestat fchmodat2 map_shadow_stack futex_wake
455 futex_wait futex_requeue statmount listmount lsm_get_self_attr
460 lsm_set_self_attr lsm_list_modules mseal setxattrat getxattrat
465 listxattrat removexattrat open_tree_attr file_getattr file_setattr
470 listns
"""

SYSCALL_NUMBERS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {"x86_64": _table(_X86_64), "aarch64": _table(_AARCH64)}
)
"""Architecture -> system call name -> number: every call the policy has reviewed."""


def highest_reviewed(arch: str) -> int:
    """The highest system call number the policy knows on ``arch``."""
    return max(SYSCALL_NUMBERS[arch].values())


def _known_names() -> frozenset[str]:
    return frozenset(name for table in SYSCALL_NUMBERS.values() for name in table)


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
        "mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick move_mount "
        "open_tree open_tree_attr mount_setattr",
        "mounting file systems would let code reshape or hide its view of the sandbox "
        "and reach kernel file system code rarely exercised unprivileged",
    ),
    *_group(
        "statmount listmount listns",
        "listing and inspecting mounts and namespaces by kernel-wide id is recent kernel "
        "code a sandbox has no use for (its own mounts are in /proc/self/mountinfo); "
        "ENOSYS reads as a kernel without them",
        errno.ENOSYS,
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
        "settimeofday clock_settime clock_adjtime adjtimex",
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
        "lookup_dcookie nfsservctl uselib ustat sysfs _sysctl",
        "obsolete interfaces with no use in a sandbox",
    ),
    *_group("syslog", "the kernel log can reveal host addresses and other tenants' activity"),
    *_group("vhangup", "hanging up a terminal that is not the sandbox's"),
    *_group(
        "sethostname setdomainname",
        "identity of the host (the sandbox has its own UTS namespace regardless)",
    ),
    *_group(
        "mbind set_mempolicy set_mempolicy_home_node move_pages migrate_pages get_mempolicy",
        "NUMA placement lets code affect memory placement of other workloads",
    ),
    *_group(
        "fanotify_init",
        "file-system-wide event monitoring; with a mount mark it watches the host's files",
    ),
    *_group(
        "mseal",
        "sealing memory mappings is recent memory-management code Python does not use; "
        "ENOSYS reads as an older kernel, which every caller handles",
        errno.ENOSYS,
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


# --- the policy as a complete filter --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of a compiled filter: ``syscall`` is allowed (``errno`` None) or fails
    with ``errno``, when every test in ``when`` holds (at most one test per argument,
    which is what libseccomp and container runtimes accept in one rule)."""

    syscall: str
    errno: int | None
    when: tuple[ArgTest, ...] = ()


def filter_rules(denials: Sequence[Denial] = DENIED) -> tuple[Rule, ...]:
    """The whole filter, for every architecture: ``denials`` as rules, then a rule
    allowing every other call of the reviewed tables. Anything no rule matches (a number
    outside the tables) fails with :data:`UNREVIEWED_ERRNO`.

    A call denied only for some arguments gets allow rules for exactly the other
    arguments (libseccomp keeps one action per syscall and argument values: an
    unconditional allow would silently swallow the conditional denials). Raises
    :class:`PolicyError` for a name no table has, or denials a filter cannot express."""
    known = _known_names()
    unknown = sorted({d.syscall for d in denials} - known)
    if unknown:
        raise PolicyError(
            f"the seccomp policy denies {', '.join(unknown)}, which is not a system call "
            f"of {' or '.join(SYSCALL_NUMBERS)} in sandlot's reviewed tables; a misspelt "
            "name would leave the real call allowed, so no filter is built. Fix the name "
            "in sandlot.seccomp.DENIED (or review the call and add it to the table)"
        )
    by_name: dict[str, list[Denial]] = {}
    for denial in denials:
        by_name.setdefault(denial.syscall, []).append(denial)
    rules: list[Rule] = []
    allows: list[Rule] = []
    for name, group in by_name.items():
        outright = {d.errno for d in group if not d.when}
        if outright and (len(outright) > 1 or len(outright) < len(group)):
            raise PolicyError(
                f"the seccomp policy denies {name} outright and again with another errno "
                "or for some arguments; keep one denial"
            )
        if outright:
            rules.append(Rule(name, outright.pop()))
            continue
        rules.extend(Rule(name, d.errno, d.when) for d in group)
        allows.extend(_allowed_otherwise(name, group))
    rules.extend(allows)
    rules.extend(Rule(name, None) for name in sorted(known - by_name.keys()))
    return tuple(rules)


_MAX = (1 << 64) - 1  # arguments are compared as 64-bit values


@dataclass(frozen=True, slots=True)
class _Cell:
    """Argument values on which every test of the policy on that argument agrees."""

    member: int
    tests: tuple[ArgTest | None, ...]
    """The cell as a union of single tests (``None``: every value)."""


def _holds(test: ArgTest, value: int) -> bool:
    if test.op == "eq":
        return value == test.value
    if test.op == "ge":
        return value >= test.value
    return value & test.mask == test.value


def _allowed_otherwise(name: str, denials: Sequence[Denial]) -> list[Rule]:
    """Allow rules covering every argument value none of ``denials`` refuses.

    Each argument's values are cut into cells on which all the policy's tests agree;
    every combination of cells is then denied (by exactly one denial) or allowed, and
    allowed combinations become rules, merged where an argument does not matter."""
    for denial in denials:
        indexes = [t.index for t in denial.when]
        if len(indexes) != len(set(indexes)) or not all(0 <= i < 6 for i in indexes):
            raise PolicyError(f"a {name} denial tests an argument twice or one that is not 0-5")
        for test in denial.when:
            outside_mask = test.op == "masked_eq" and test.value & ~test.mask
            if not 0 <= test.value <= _MAX or outside_mask:
                raise PolicyError(f"a {name} denial has a test that can never hold: {test}")
    indexes = sorted({t.index for d in denials for t in d.when})
    cells = [_cells(name, i, [t for d in denials for t in d.when if t.index == i]) for i in indexes]
    allowed: set[tuple[int, ...]] = set()
    used: set[Denial] = set()
    for box in itertools.product(*(range(len(c)) for c in cells)):
        values = {i: cells[k][box[k]].member for k, i in enumerate(indexes)}
        hits = [d for d in denials if all(_holds(t, values[t.index]) for t in d.when)]
        if len({d.errno for d in hits}) > 1:
            raise PolicyError(f"two {name} denials with different errors overlap")
        used.update(hits)
        if not hits:
            allowed.add(box)
    if len(used) < len(denials):
        raise PolicyError(f"a {name} denial can never hold (another one covers it)")
    # An argument whose every cell is allowed, the others fixed, needs no test.
    for k in range(len(indexes)):
        every = set(range(len(cells[k])))
        rest: dict[tuple[int, ...], set[int]] = {}
        for box in allowed:
            rest.setdefault(box[:k] + box[k + 1 :], set()).add(box[k])
        allowed = set()
        for others, members in rest.items():
            if members == every:
                allowed.add((*others[:k], -1, *others[k:]))
            else:
                allowed.update((*others[:k], m, *others[k:]) for m in members)
    rules: list[Rule] = []
    for box in sorted(allowed):
        options = [(None,) if c < 0 else cells[k][c].tests for k, c in enumerate(box)]
        for combination in itertools.product(*options):
            tests = tuple(t for t in combination if t is not None)
            if not tests:  # cannot happen once a denial holds somewhere; never emit it
                raise PolicyError(f"the {name} denials leave every argument allowed")
            rules.append(Rule(name, None, tests))
    return rules


def _cells(name: str, index: int, tests: Sequence[ArgTest]) -> list[_Cell]:
    masked = [t for t in tests if t.op == "masked_eq"]
    if not masked:
        return _interval_cells(index, tests)
    if len(masked) < len(tests):
        raise PolicyError(f"the {name} denials mix bit tests and comparisons on argument {index}")
    return _bit_cells(name, index, masked)


def _interval_cells(index: int, tests: Sequence[ArgTest]) -> list[_Cell]:
    """``eq`` and ``ge`` tests cut the values into intervals."""
    cuts = {t.value for t in tests} | {t.value + 1 for t in tests if t.op == "eq"}
    bounds = [0, *sorted(c for c in cuts if 0 < c <= _MAX), _MAX + 1]
    return [_Cell(lo, _interval(index, lo, hi - 1)) for lo, hi in itertools.pairwise(bounds)]


def _interval(index: int, lo: int, hi: int) -> tuple[ArgTest | None, ...]:
    """[lo, hi] as single tests: ``ge`` for a tail, else aligned power-of-two blocks."""
    if lo == 0 and hi == _MAX:
        return (None,)
    if hi == _MAX:
        return (ArgTest(index, "ge", lo),)
    blocks: list[ArgTest | None] = []
    while lo <= hi:
        size = lo & -lo if lo else 1 << 64
        while lo + size - 1 > hi:
            size >>= 1
        if size == 1:
            blocks.append(ArgTest(index, "eq", lo))
        else:
            blocks.append(ArgTest(index, "masked_eq", lo, _MAX ^ (size - 1)))
        lo += size
    return tuple(blocks)


def _bit_cells(name: str, index: int, tests: Sequence[ArgTest]) -> list[_Cell]:
    """``masked_eq`` tests: one cell per pattern of which tests hold. A test that holds
    is its own (mask, bits); one that does not is "some bit of its mask differs", a
    union of single-bit tests."""
    atoms = sorted({(t.mask, t.value) for t in tests})
    cells: list[_Cell] = []
    for pattern in itertools.product((True, False), repeat=len(atoms)):
        options = [
            [(mask, value)] if holds else [(1 << b, ~value & 1 << b) for b in _bits(mask)]
            for (mask, value), holds in zip(atoms, pattern, strict=True)
        ]
        found: dict[tuple[int, int], None] = {}
        for choice in itertools.product(*options):
            merged = _merge(choice)
            if merged is not None:
                found[merged] = None
        if len(found) > 64:
            raise PolicyError(f"the {name} denials on argument {index} are too complex a filter")
        if found:
            tests_ = tuple(ArgTest(index, "masked_eq", value, mask) for mask, value in found)
            cells.append(_Cell(next(iter(found))[1], tests_))
    return cells


def _bits(mask: int) -> list[int]:
    return [b for b in range(64) if mask >> b & 1]


def _merge(parts: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The (mask, bits) of all ``parts`` at once, or None if two disagree on a bit."""
    mask = bits = 0
    for part_mask, part_bits in parts:
        if (bits ^ part_bits) & mask & part_mask:
            return None
        mask |= part_mask
        bits |= part_bits
    return mask, bits


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
