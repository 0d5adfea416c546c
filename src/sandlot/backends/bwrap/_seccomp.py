"""Compile :func:`sandlot.seccomp.filter_rules` into a BPF program with libseccomp.

libseccomp (the library behind systemd, Docker, Podman and Chromium's Linux
filters) does the hard part: refusing foreign architectures (i386 ``int 0x80``, x32
numbers on x86-64), building the argument comparisons and emitting correct BPF.
Syscall numbers come from the policy's own table for the native architecture, not from
libseccomp's (which lags the kernel: 2.5.4 has nothing after Linux 6.6); the filter's
default action refuses every number the table does not allow. We call it through
ctypes because its official Python binding is not published on PyPI (it ships with
distributions, for their own interpreter only) and the unofficial ones are
unmaintained; the surface we need is a handful of functions.

The program is handed to bwrap with ``--seccomp FD``; bwrap sets
``PR_SET_NO_NEW_PRIVS`` and installs it right before it execs the runner, so it
applies to every process in the sandbox and cannot be removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

from sandlot._exceptions import IsolationUnavailable, PolicyError
from sandlot.seccomp import (
    AUDIT_ARCH,
    DENIED,
    SYSCALL_NUMBERS,
    UNREVIEWED_ERRNO,
    Denial,
    Rule,
    filter_rules,
    zygote_denials,
)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_FLTATR_CTL_OPTIMIZE = 8
_SCMP_ERRNO = 0x00050000
_OPS = {"eq": 4, "ge": 5, "masked_eq": 7}

LIBSECCOMP_FIX = (
    "install libseccomp (Debian/Ubuntu: apt-get install libseccomp2; Fedora: dnf install "
    "libseccomp)"
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise IsolationUnavailable(
            f"libseccomp is not available ({exc}), so sandlot cannot build its syscall "
            f"filter and refuses to start a sandbox. Fix: {LIBSECCOMP_FIX}"
        ) from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_arch_native.argtypes = []
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_pfc.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _fail(what: str, rc: int) -> IsolationUnavailable:
    return IsolationUnavailable(
        f"libseccomp could not {what} ({os.strerror(-rc) if rc < 0 else rc}); sandlot "
        f"refuses to start a sandbox without its syscall filter. Fix: {LIBSECCOMP_FIX} "
        "(version 2.5 or newer)"
    )


def native_arch() -> str:
    """The policy's name for the architecture libseccomp filters natively (raises
    IsolationUnavailable where the policy has no reviewed table)."""
    token = _lib().seccomp_arch_native()
    for name, audit in AUDIT_ARCH.items():
        if audit == token:
            return name
    raise IsolationUnavailable(
        f"sandlot's syscall policy has reviewed tables for {', '.join(AUDIT_ARCH)} only, "
        f"and this host's native architecture is another (audit arch {token:#x}); "
        "sandlot refuses to start a sandbox without its syscall filter. Fix: run sandlot "
        "on an x86-64 or arm64 host"
    )


def _rules(denials: tuple[Denial, ...]) -> tuple[Rule, ...]:
    try:
        return filter_rules(denials)
    except PolicyError as exc:
        raise IsolationUnavailable(
            f"sandlot's syscall policy cannot be compiled: {exc}; sandlot refuses to start "
            "a sandbox without its syscall filter"
        ) from exc


def _add(lib: ctypes.CDLL, ctx: int, rule: Rule, number: int) -> None:
    tests = (_ArgCmp * max(1, len(rule.when)))()
    for i, test in enumerate(rule.when):
        if test.op == "masked_eq":
            tests[i] = _ArgCmp(test.index, _OPS["masked_eq"], test.mask, test.value)
        else:
            tests[i] = _ArgCmp(test.index, _OPS[test.op], test.value, 0)
    action = SCMP_ACT_ALLOW if rule.errno is None else _SCMP_ERRNO | (rule.errno & 0xFFFF)
    rc = lib.seccomp_rule_add_array(ctx, action, number, len(rule.when), tests)
    if rc < 0:
        raise _fail(f"add a rule for {rule.syscall}", rc)


def _export(denials: tuple[Denial, ...], pfc: bool) -> bytes:
    lib = _lib()
    numbers = SYSCALL_NUMBERS[native_arch()]
    rules = _rules(denials)
    # Allowlist: whatever no rule matches, above all every number the reviewed table
    # does not have (calls of a newer kernel), fails as on a kernel without it.
    ctx = lib.seccomp_init(_SCMP_ERRNO | UNREVIEWED_ERRNO)
    if not ctx:
        raise _fail("create a filter", -ctypes.get_errno())
    fd = os.memfd_create("sandlot-seccomp", os.MFD_CLOEXEC)
    try:
        # A syscall from another ABI (i386 via int 0x80, x32) would bypass rules
        # written for the native numbers: kill the process instead.
        rc = lib.seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS)
        if rc < 0:
            raise _fail("refuse foreign architectures", rc)
        # A binary search over syscall numbers: with ~370 allowed calls, a linear chain
        # would cost every syscall hundreds of comparisons.
        rc = lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)
        if rc < 0:
            raise _fail("build a binary-tree filter", rc)
        for rule in rules:
            number = numbers.get(rule.syscall)
            # A call this architecture does not have has no number to allow or deny;
            # the default action refuses every number the table leaves out. A denial
            # with the default's own errno is the default (libseccomp refuses it).
            if number is not None and rule.errno != UNREVIEWED_ERRNO:
                _add(lib, ctx, rule, number)
        rc = (lib.seccomp_export_pfc if pfc else lib.seccomp_export_bpf)(ctx, fd)
        if rc < 0:
            raise _fail("export the filter", rc)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
        lib.seccomp_release(ctx)


@functools.cache
def filter_program(zygote: bool = False) -> bytes:
    """The sandbox's BPF program (built once per process; raises IsolationUnavailable).

    ``zygote``: the zygote's own, which lets it set up the sandboxes it forks
    (:func:`sandlot.seccomp.zygote_denials`); each of them then installs the full one."""
    program = _export(zygote_denials() if zygote else DENIED, pfc=False)
    if not program or len(program) % 8:
        raise _fail("produce a valid program", 0)
    return program


def filter_source() -> str:
    """The same filter as readable pseudo-code (``sandlot doctor --seccomp``, reviews)."""
    return _export(DENIED, pfc=True).decode()


def program_fd(zygote: bool = False) -> int:
    """A fresh file descriptor holding the program, positioned at 0, for ``--seccomp``.

    Not close-on-exec: bwrap must inherit it (the caller passes it in ``pass_fds``
    and closes it after starting bwrap).
    """
    program = filter_program(zygote)
    fd = os.memfd_create("sandlot-seccomp", 0)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
