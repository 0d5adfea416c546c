"""The syscall policy (``sandlot.seccomp``) and its libseccomp compilation."""

from __future__ import annotations

import ctypes
import errno
import itertools
import random
from pathlib import Path

import pytest
import seccomp_bpf as bpf

from sandlot import seccomp
from sandlot._exceptions import IsolationUnavailable, PolicyError
from sandlot.backends.bwrap import _seccomp

SECURITY_MD = Path(__file__).resolve().parents[2] / "SECURITY.md"


def test_security_md_lists_every_denial_with_its_reason() -> None:
    assert seccomp.markdown_table() in SECURITY_MD.read_text()


def test_the_baseline_is_denied_outright() -> None:
    names = seccomp.denied_names()
    required = {
        "mount", "umount2", "ptrace", "kexec_load", "init_module", "finit_module", "reboot",
        "swapon", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
        "open_by_handle_at", "unshare", "setns", "clock_settime", "settimeofday", "acct",
        "quotactl", "iopl", "ioperm", "io_uring_setup", "io_uring_enter", "io_uring_register",
        "fsopen", "move_mount", "open_tree", "pidfd_getfd", "process_vm_readv",
    }  # fmt: skip
    assert required <= names, required - names


def test_namespace_flags_of_clone_are_each_denied() -> None:
    bits = {test.value for d in seccomp.DENIED if d.syscall == "clone" for test in d.when}
    for flag in ("CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWNET", "CLONE_NEWPID"):
        assert getattr(seccomp, flag) in bits


def test_only_unix_and_inet_socket_families_remain() -> None:
    refused: set[int] = set()
    floor = None
    for d in seccomp.DENIED:
        if d.syscall == "socket" and len(d.when) == 1:
            test = d.when[0]
            assert d.errno == errno.EAFNOSUPPORT
            if test.op == "eq":
                refused.add(test.value)
            else:
                floor = test.value
    assert floor == seccomp.AF_INET6 + 1
    allowed = set(range(floor)) - refused
    assert allowed == {seccomp.AF_UNIX, seccomp.AF_INET, seccomp.AF_INET6}
    assert floor <= seccomp.AF_NETLINK and floor <= seccomp.AF_PACKET


def test_libseccomp_compiles_the_policy() -> None:
    program = _seccomp.filter_program()
    assert program and len(program) % 8 == 0  # struct sock_filter is 8 bytes
    source = _seccomp.filter_source()
    assert "ERRNO(1)" in source and "ERRNO(38)" in source  # EPERM and ENOSYS rules


# --- the allowlist -------------------------------------------------------------------------


def _native() -> tuple[str, int]:
    arch = _seccomp.native_arch()
    return arch, seccomp.AUDIT_ARCH[arch]


def _policy_action(denials: tuple[seccomp.Denial, ...], name: str, args: list[int]) -> int:
    """What the policy says a call gets, read straight from the denials."""
    for denial in denials:
        if denial.syscall == name and all(_holds(t, args[t.index]) for t in denial.when):
            return bpf.RET_ERRNO | denial.errno
    return bpf.RET_ALLOW


def _holds(test: seccomp.ArgTest, value: int) -> bool:
    if test.op == "eq":
        return value == test.value
    if test.op == "ge":
        return value >= test.value
    return value & test.mask == test.value


def test_tables_agree_with_libseccomp_wherever_it_knows_the_call() -> None:
    # The tables were written from the kernel's own; libseccomp's (2.5.4 stops at Linux
    # 6.6) must agree on every call it knows, and know nothing the tables lack.
    lib = _seccomp._lib()
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    for arch, table in seccomp.SYSCALL_NUMBERS.items():
        token = lib.seccomp_arch_resolve_name(arch.encode())
        assert token == seccomp.AUDIT_ARCH[arch]
        for name, number in table.items():
            theirs = lib.seccomp_syscall_resolve_name_arch(token, name.encode())
            assert theirs < 0 or theirs == number, (arch, name, number, theirs)
        for number in range(1024):
            pointer = lib.seccomp_syscall_resolve_num_arch(token, number)
            if pointer:
                name = ctypes.string_at(pointer).decode()
                libc.free(pointer)
                assert table.get(name) == number, (arch, name, number)
        assert seccomp.highest_reviewed(arch) == 470  # listns, Linux 6.19


def test_calls_of_recent_kernels_are_in_the_tables() -> None:
    for table in seccomp.SYSCALL_NUMBERS.values():
        recent = {"statmount": 457, "listmount": 458, "mseal": 462, "open_tree_attr": 467}
        assert {name: table[name] for name in recent} == recent


def test_every_number_outside_the_reviewed_table_is_refused() -> None:
    # Every path through the compiled program, for all 2**32 syscall numbers at once:
    # only numbers of calls the policy allows (outright or for some arguments) can be
    # allowed, and every other number fails with ENOSYS or, as another ABI, is killed.
    arch, audit = _native()
    table = seccomp.SYSCALL_NUMBERS[arch]
    for zygote, denials in ((False, seccomp.DENIED), (True, seccomp.zygote_denials())):
        program = _seccomp.filter_program(zygote=zygote)
        outright = {d.syscall for d in denials if not d.when}
        may_allow = {number for name, number in table.items() if name not in outright}
        reached = bpf.reach(program, audit)
        allowed = reached.pop(bpf.RET_ALLOW)
        assert set(bpf.members(allowed)) <= may_allow
        assert len(set(bpf.members(allowed))) > 300  # control: the table is allowed
        outside = bpf.complement(set(table.values()))
        unreviewed_errno = bpf.RET_ERRNO | seccomp.UNREVIEWED_ERRNO
        for action, numbers in reached.items():
            if action not in (unreviewed_errno, bpf.RET_KILL_PROCESS):
                assert not bpf.overlap(numbers, outside), (hex(action), numbers)
        assert bpf.overlap(reached[unreviewed_errno], outside)
        top = seccomp.highest_reviewed(arch)
        for number in (top + 1, top + 2, 1000, 0x3FFFFFFF, 0xFFFFFFFF):
            assert bpf.run(program, number, audit) == unreviewed_errno, number
        # Another architecture's calls never get past the check.
        assert set(bpf.reach(program, 0x40000003)) == {bpf.RET_KILL_PROCESS}  # i386


def test_each_reviewed_call_gets_what_the_policy_says() -> None:
    arch, audit = _native()
    for zygote, denials in ((False, seccomp.DENIED), (True, seccomp.zygote_denials())):
        program = _seccomp.filter_program(zygote=zygote)
        for name, number in seccomp.SYSCALL_NUMBERS[arch].items():
            if any(d.syscall == name and d.when for d in denials):
                continue  # argument rules: the next test
            want = _policy_action(denials, name, [0] * 6)
            assert bpf.run(program, number, audit) == want, (zygote, name)
    setns = seccomp.SYSCALL_NUMBERS[arch]["setns"]
    assert bpf.run(_seccomp.filter_program(zygote=True), setns, audit) == bpf.RET_ALLOW


def _probe_values(tests: list[seccomp.ArgTest]) -> list[int]:
    rng = random.Random(7)
    values = {0, 1, 2, 3, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 0x80000, 0x800}
    for test in tests:
        for base in (test.value, test.value | 1 << 40, test.value | 0x80800):
            values.update({base, base - 1 & (1 << 64) - 1, base + 1})
        for bit in range(64):
            if test.op == "masked_eq" and test.mask >> bit & 1:
                values.add(test.value ^ 1 << bit)
    values.update(rng.getrandbits(64) for _ in range(40))
    values.update(rng.getrandbits(5) for _ in range(20))
    return sorted(values)


def test_argument_rules_hold_for_every_probed_argument() -> None:
    # The compiled allow rules are the exact complement of the conditional denials:
    # every probed value gets what the denials say (libseccomp would otherwise have
    # swallowed the denials, or left some values to the ENOSYS default).
    arch, audit = _native()
    program = _seccomp.filter_program()
    conditional = sorted({d.syscall for d in seccomp.DENIED if d.when})
    assert conditional == ["clone", "ioctl", "personality", "socket"]
    for name in conditional:
        tests = [t for d in seccomp.DENIED if d.syscall == name for t in d.when]
        indexes = sorted({t.index for t in tests})
        per_arg = {i: _probe_values([t for t in tests if t.index == i]) for i in indexes}
        for combination in itertools.product(*per_arg.values()):
            args = [0] * 6
            for index, value in zip(indexes, combination, strict=True):
                args[index] = value
            want = _policy_action(seccomp.DENIED, name, args)
            got = bpf.run(program, seccomp.SYSCALL_NUMBERS[arch][name], audit, args)
            assert got == want, (name, [hex(a) for a in args], hex(got), hex(want))


def test_the_policy_refuses_to_compile_a_name_no_table_has() -> None:
    # A misspelt denial would leave the real call allowed: no filter at all instead.
    typo = (seccomp.Denial("mont", "a typo"),)
    with pytest.raises(PolicyError, match="mont"):
        seccomp.filter_rules(typo)
    with pytest.raises(IsolationUnavailable, match=r"cannot be compiled.*mont"):
        _seccomp._export(typo, pfc=False)


@pytest.mark.parametrize(
    ("denials", "match"),
    [
        (
            (
                seccomp.Denial("socket", "a", errno.EPERM, (seccomp.ArgTest(0, "eq", 2),)),
                seccomp.Denial("socket", "b", errno.EACCES, (seccomp.ArgTest(0, "ge", 2),)),
            ),
            "overlap",
        ),
        (
            (
                seccomp.Denial(
                    "socket", "a", when=(seccomp.ArgTest(0, "eq", 2), seccomp.ArgTest(0, "ge", 1))
                ),
            ),
            "twice",
        ),
        (
            (
                seccomp.Denial("socket", "a", when=(seccomp.ArgTest(0, "eq", 2),)),
                seccomp.Denial("socket", "b", when=(seccomp.ArgTest(0, "masked_eq", 1, 1),)),
            ),
            "mix",
        ),
        (
            (seccomp.Denial("socket", "a"), seccomp.Denial("socket", "b", errno.EACCES)),
            "one denial",
        ),
    ],
)
def test_the_policy_refuses_denials_a_filter_cannot_express(
    denials: tuple[seccomp.Denial, ...], match: str
) -> None:
    with pytest.raises(PolicyError, match=match):
        seccomp.filter_rules(denials)


def test_interval_denials_compile_to_their_exact_complement() -> None:
    # Not in today's policy, but the compiler supports it: a range in the middle.
    denial = seccomp.Denial(
        "socket", "x", when=(seccomp.ArgTest(0, "ge", 5), seccomp.ArgTest(1, "eq", 7))
    )
    rules = [r for r in seccomp.filter_rules((denial,)) if r.syscall == "socket"]
    allowed = [r for r in rules if r.errno is None]
    for family in [*range(12), 1 << 40]:
        for kind in (0, 6, 7, 8, 1 << 33 | 7):
            denied = family >= 5 and kind == 7
            hit = any(all(_holds(t, (family, kind)[t.index]) for t in r.when) for r in allowed)
            assert hit is not denied, (family, kind)
